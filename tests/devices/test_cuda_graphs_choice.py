"""``cuda_graphs`` where it cannot run, and the step scalars its graphs read, on the CPU.

Whether the graphs train as eager steps do is checked on a GPU (``tests/gpu/test_gpu_graphs.py``).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.gpu_compare import flat, images
from towers import Config, Trainer
from towers.errors import UserError
from towers.nn.context import StepScalars
from towers.nn.dropout import Dropout
from towers.nn.layers import Dense, Flatten, Sequential
from towers.nn.models import build_model
from towers.nn.residual import Residual
from towers.ops import forms


@pytest.mark.parametrize("settings,what", [
    (dict(accumulate=2), "accumulate"),
    (dict(sync_bn=True, n_gpu=2), "sync_bn"),
    (dict(allreduce_bucket_mib=1.0), "allreduce_bucket_mib"),
])
def test_what_a_graph_cannot_capture_is_refused_by_name(settings, what):
    with pytest.raises(UserError, match=rf"cuda_graphs.*{what}.*drop one of them"):
        Config(cuda_graphs=True, **settings).resolved()
    Config(**settings).resolved()  # without graphs: accepted


def test_the_command_line_refuses_it_in_one_line():
    r = run_cli("--cuda-graphs", "--accumulate", "2", "--steps", "1")
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--cuda-graphs" in lines[0] and "--accumulate" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_dropout_is_refused_with_graphs_even_nested():
    inner = Sequential([Flatten(), Dense("fc", 16), Dropout(0.5)])
    assert inner.layers[2].draws_on_host() and not Dropout(0.0).draws_on_host()
    block = Residual([Dense("a", 16), Dropout(0.3)], scope="block")
    model = Sequential([Flatten(), Dense("fc", 16), block, Dense("out", 10)])
    ds = images(32, (4, 4, 1))
    with pytest.raises(UserError, match="cuda_graphs.*dropout"):
        Trainer(Config(devices="cpu", cuda_graphs=True, batch_size=8, quiet=True), model=model, dataset=ds)
    assert block.draws_on_host()  # (a block knows its layers once built)
    Trainer(Config(devices="cpu", batch_size=8, quiet=True), model=model, dataset=ds).close()


def test_cpu_towers_ignore_cuda_graphs_and_train_as_without_it():
    """No GPU tower: nothing to capture, the GEMM binding stays CuPy's, the run is the eager one bit for bit."""
    ds = images(48, (12, 12, 3))
    runs = []
    for graphs in (True, False):
        tr = Trainer(Config(devices="cpu", model="resnet20", batch_size=8, quiet=True, summary_every=0,
                            cuda_graphs=graphs), dataset=ds)
        try:
            tr.run_steps(3)
            assert tr.executor.forms.gemm == "cupy"
            assert all(t.graphs is None for t in tr.executor.towers)
            runs.append(flat(tr.get_weights()))
        finally:
            tr.close()
    assert np.array_equal(runs[0], runs[1])


def test_step_scalars_follow_the_step_with_one_copy_per_change():
    s = StepScalars()
    calls = []

    def value(step):
        calls.append(step)
        return min(0.5, 1.0 / (1 + step))

    d = s.device("d", value, np, 0)
    assert d.shape == (1,) and d.dtype == np.float32 and d[0] == np.float32(0.5)
    again = s.device("d", value, np, 0)
    assert np.shares_memory(d, again) and calls == [0]  # one registration, one view
    s.refresh(3)
    assert d[0] == np.float32(0.25)  # the view the layer holds sees the new step
    assert s.device("d", value, np, 7)[0] == np.float32(0.125)  # a step not refreshed yet: refreshed first
    other = s.device("e", lambda step: float(step), np, 7)
    assert other[0] == 7 and d[0] == np.float32(0.125)


def test_step_scalars_refuse_what_a_capture_cannot_copy():
    import types

    s = StepScalars()
    s.device("d", lambda step: 1.0 / (1 + step), np, 2)
    s.capturing = True
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        s.device("new", lambda step: 0.0, np, 2)
    with pytest.raises(RuntimeError, match="inside a capture of step 2"):
        s.device("d", lambda step: 1.0 / (1 + step), np, 3)
    assert s.device("d", lambda step: 1.0 / (1 + step), np, 2)[0] == np.float32(1 / 3)
    s.capturing = False
    with pytest.raises(ValueError, match="numpy and"):
        s.device("d", lambda step: 0.0, types.ModuleType("other"), 2)


def test_batch_norm_steps_its_moving_statistics_by_the_scalar_of_the_step():
    """The moving statistics' step, 1 - min(momentum, (1 + step) / (10 + step)), taken by a replica at steps 0 and
    5 (``Replica.start_step``): the moving mean moves by that fraction towards the batch mean."""
    from towers.nn.replica import Replica

    model = build_model("resnet20", (8, 8, 3), 10)
    r = Replica(model, np)
    r.set_params(model.init_params(0))
    x = np.random.default_rng(0).standard_normal((4, 8, 8, 3)).astype(np.float32) + 3
    y = np.arange(4, dtype=np.int32)
    name = next(n for n, *_ in model.buffer_layout() if n.endswith("moving_mean"))
    for step in (0, 5):
        r.set_buffers(model.init_buffers())
        r.start_step(step)
        r.loss_and_grads(x, y, l2=0.0)
        batch_mean = r.buffer[name] / np.float32(1 - min(0.99, (1 + step) / (10 + step)))
        # the first layer's moving mean started at 0: it is (1 - d) x the batch mean of its input's conv output
        assert np.all(np.isfinite(batch_mean))
        if step == 0:
            first = batch_mean.copy()
        else:
            np.testing.assert_allclose(batch_mean, first, rtol=1e-5)


def _nvmath_starts() -> bool:
    from towers.devices import matmul

    try:
        return matmul.nvmath_available() is None
    except Exception:  # noqa: BLE001 - no CuPy at all
        return False


@pytest.mark.skipif(_nvmath_starts(), reason="nvmath-python starts here: the refusal is for machines where it does not")
def test_graphs_asked_where_nvmath_does_not_start_is_one_clear_error():
    """GEMMs inside a capture need nvmath-python's cuBLAS binding: without it, one line naming the package."""
    from towers.devices.placement import CPU

    model = build_model("lenet5", (28, 28, 1), 10)
    with pytest.raises(UserError, match=r"cuda_graphs.?: nvmath-python's cuBLAS binding does not start .*"
                                        r"pip install nvmath-python.*drop .?cuda_graphs"):
        forms.choose("numpy", model, True, "im2col", gpu=CPU, cuda_graphs=True)
    assert forms.choose("numpy", model, True, "im2col", gpu=CPU).gemm == "cupy"


@pytest.mark.parametrize("model,shape", [("resnet20", (12, 12, 3)), ("lenet5", (28, 28, 1)), ("cifar10", (24, 24, 3))])
def test_fresh_workspaces_mid_run_change_nothing(model, shape):
    """What a failed capture leaves (``Replica.reset_workspaces``): every scratch array made and filled afresh
    (padding borders, ones, row indices, constants), the run's bits unchanged."""
    ds = images(48, shape)
    runs = []
    for reset in (True, False):
        tr = Trainer(Config(devices="cpu", model=model, batch_size=8, quiet=True, summary_every=0,
                            cpu_kernels="numpy"), dataset=ds)
        try:
            tr.run_steps(2)
            if reset:
                for t in tr.executor.towers:
                    t.replica.reset_workspaces()
            tr.run_steps(2)
            runs.append((flat(tr.get_weights()), tr.evaluate(ema=False)))
        finally:
            tr.close()
    assert np.array_equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
