"""CUDA graphs of the GPU towers' forward and backward (``cuda_graphs``, ``towers.devices.cuda_graphs``).

Skipped without CUDA and without nvmath-python (the GEMMs' binding inside a
capture).  The graphed run is held to an eager run of the same process
choice (the same GEMM binding: both ``cuda_graphs`` Trainers, the eager one
with its towers' graphs taken away) and must give its bits: every loss, the
weights, the moving statistics and the EMA, over steps that want the loss or
not (one graph serves both), change batch norm's moving-statistics step
every step, evaluate between steps and set the weights back to the first
step's between two others (in place: the graph reads the same buffers), with
the batch staged from the host
(the labels in alternating buffers) or gathered on the device.  The losses
are read after the last step: a graph that baked in a step's number, kept a
stale input or handed out its output array would fail it.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import cupy_performance_warnings_fail
from tests.gpu_compare import DRY, flat, images, record, rel
from towers import Config, Trainer
from towers.devices import cudnn, matmul
from towers.nn.layers import Dense, Flatten, Layer, Sequential
from towers.ops.forms import Forms

pytestmark = [pytest.mark.gpu, *cupy_performance_warnings_fail(),
              pytest.mark.skipif(DRY, reason="needs CuPy arrays and CUDA graphs")]

#: want_loss per step: the first step is the warm-up, the second captures and launches, the rest launch.
WANT = (True, True, False, True, True, False, True, False, True)


@pytest.fixture
def nvmath():
    """Skipped where nvmath-python's cuBLAS binding does not start."""
    why = matmul.nvmath_available()
    if why is not None:
        pytest.skip(why)


def _trainer(ds, **settings) -> Trainer:
    cfg = Config(devices="0", cpu_kernels="numpy", quiet=True, summary_every=0, cuda_graphs=True, **settings)
    return Trainer(cfg, dataset=ds)


def _expected_counts(scales: list) -> tuple:
    """(captures, launches) of a tower whose steps had these loss scales (the graphs' key): a scale's first step
    is its warm-up, its second is captured and launched, its later ones launch."""
    seen, captured, launches = set(), set(), 0
    for s in scales:
        if s not in seen:
            seen.add(s)
            continue
        captured.add(s)
        launches += 1
    return len(captured), launches


def _lockstep(ds, evaluate_at: int = 4, reset_at: int = 6, **settings):
    """The graphed and the eager run of ``settings``, step by step (``WANT``); their losses (read after the last
    step), weights, EMA, the graphed run's towers' graph counts, whether the batches were staged from the host,
    and the counts the graphed run's loss scales call for (fp16 lowers its scale at an overflow: a new key)."""
    sides = [_trainer(ds, **settings), _trainer(ds, **settings)]
    for t in sides[1].executor.towers:
        t.graphs = None  # eager, with the same GEMM binding and everything else
    losses, scales = [[], []], []
    try:
        first = [side.get_weights() for side in sides]
        for k, want in enumerate(WANT):
            scales.append(sides[0].executor.engine.keeper.loss_scale)
            for side, out in zip(sides, losses):
                out.append(side.run_steps(1, want_loss=want))  # device arrays, or None
                side.synchronize()  # one Trainer's steps never overlap the other's
            if k == evaluate_at:
                evals = [side.evaluate(ema=False) for side in sides]
                assert evals[0] == evals[1], f"evaluation between steps: {evals}"
            if k == reset_at:
                for side, w in zip(sides, first):
                    side.set_weights(w)
        for side in sides:
            side.synchronize()
        losses = [[None if got is None else [float(v) for v in got] for got in out] for out in losses]
        assert [got is not None for got in losses[0]] == list(WANT)
        counts = [(t.graphs.captures, t.graphs.launches, t.graphs.refused) for t in sides[0].executor.towers]
        weights = [flat(side.get_weights()) for side in sides]
        ema = [flat(side.get_weights(ema=True)) for side in sides]
        staged = [side.executor.device_data is None for side in sides]
        assert staged[0] == staged[1]
        return losses, weights, ema, counts, staged[0], _expected_counts(scales)
    finally:
        for side in sides:
            side.close()


CASES = [
    ("mlp", (28, 28, 1), dict(batch_size=32, hidden=64, momentum=0.9, l2=1e-3), False),
    ("mlp staged", (28, 28, 1), dict(batch_size=32, hidden=64, momentum=0.9, l2=1e-3), True),
    ("resnet20", (16, 16, 3), dict(batch_size=8, lr=0.05, n_gpu=2), False),  # batch norm; 2 towers sharing the GPU
    ("resnet20 staged", (16, 16, 3), dict(batch_size=8, lr=0.05, n_gpu=2), True),
    ("cifar10", (24, 24, 3), dict(batch_size=12, lr=0.05), False),  # LRN, max-pooling
    ("resnet20 bf16", (16, 16, 3), dict(batch_size=8, lr=0.05, precision="bf16"), False),  # the rounding kernels
    ("mlp fp16", (28, 28, 1), dict(batch_size=32, hidden=64, precision="fp16"), False),  # the loss scale in the key
]


@pytest.mark.parametrize("case,shape,settings,staged", CASES, ids=[c[0] for c in CASES])
def test_graphed_steps_give_the_eager_steps_bits(case, shape, settings, staged, nvmath, monkeypatch):
    """``staged``: the training set does not stay on the GPU, so each step's batch is staged from the host (the
    labels in two buffers taken in turn: the graph's inputs are refreshed by a device copy)."""
    from towers.data import device_data

    if staged:
        monkeypatch.setattr(device_data, "FRACTION", 0.0)
    ds = images(64, shape)
    losses, weights, ema, counts, was_staged, expected = _lockstep(ds, model=case.split()[0], **settings)
    assert was_staged == staged
    record(f"graphs {case}", weights=rel(weights[0], weights[1]), ema=rel(ema[0], ema[1]), counts=str(counts),
           expected=str(expected))
    if "fp16" not in case:
        assert expected == (1, len(WANT) - 1)  # one scale: every step but the warm-up launches
    for captures, launched, refused in counts:
        assert refused is None, f"the capture failed: {refused}"
        assert (captures, launched) == expected, counts
    for k, (a, b) in enumerate(zip(*losses)):
        assert a == b, f"step {k}: losses {a} (graphs) against {b} (eager)"
    assert np.array_equal(weights[0], weights[1]), f"weights differ by {rel(weights[0], weights[1]):.3g}"
    assert np.array_equal(ema[0], ema[1]), f"EMA differs by {rel(ema[0], ema[1]):.3g}"


def test_graphed_steps_on_cudnn_give_the_eager_steps_bits(nvmath):
    try:
        cudnn.frontend()
    except ImportError as e:
        pytest.skip(f"the cuDNN frontend does not import: {e}")
    cudnn.refused.clear()
    before = dict(cudnn.calls)
    losses, weights, ema, counts, _, _ = _lockstep(images(64, (16, 16, 3)), model="resnet20", batch_size=8, lr=0.05,
                                                   n_gpu=2, gpu_conv="cudnn")
    assert all(c[2] is None and c[:2] == (1, len(WANT) - 1) for c in counts), counts
    assert all(cudnn.calls[op] > before[op] for op in before) and not cudnn.refused
    assert losses[0] == losses[1]
    assert np.array_equal(weights[0], weights[1]), f"weights differ by {rel(weights[0], weights[1]):.3g}"


class _ReadsBack(Layer):
    """Passes its input through, after reading one value back to the host: a sync point no capture accepts."""

    keeps_dy = True

    def forward(self, p, x, ws):
        float(x.ravel()[0])
        return x

    def backward(self, p, g, dy, ws, need_dx):
        return dy if need_dx else None


def test_a_failed_capture_leaves_the_tower_eager_with_the_reason_and_the_same_bits(nvmath):
    ds = images(64, (8, 8, 1))
    runs = []
    for graphs in (True, False):
        model = Sequential([Flatten(), Dense("fc", 32), _ReadsBack(), Dense("out", 10)])
        tr = Trainer(Config(devices="0", batch_size=16, quiet=True, summary_every=0, cuda_graphs=True),
                     model=model, dataset=ds)
        try:
            if not graphs:
                for t in tr.executor.towers:
                    t.graphs = None
            tr.run_steps(5, want_loss=True)
            if graphs:
                g = tr.executor.towers[0].graphs
                assert g.refused and g.captures == 0 and g.launches == 0, (g.refused, g.captures, g.launches)
            runs.append(flat(tr.get_weights()))
        finally:
            tr.close()
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_nvmath_gemms_match_cupys_eagerly_and_inside_a_capture(trans_a, trans_b, nvmath):
    import cupy

    from towers.ops.gemm import gemm

    rng = np.random.default_rng(0)
    m, n, k = 67, 45, 129
    a = cupy.asarray(rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32))
    b = cupy.asarray(rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32))
    want = cupy.asnumpy(cupy.matmul(a.T if trans_a else a, b.T if trans_b else b))
    stream = cupy.cuda.Stream(non_blocking=True)
    with Forms(gemm="nvmath").active(), stream:
        eager = cupy.empty((m, n), dtype=np.float32)
        gemm(a, b, eager, trans_a, trans_b)
        captured = cupy.zeros((m, n), dtype=np.float32)
        stream.begin_capture()
        gemm(a, b, captured, trans_a, trans_b)
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    assert rel(cupy.asnumpy(eager), want) < 1e-6
    assert np.array_equal(cupy.asnumpy(captured), cupy.asnumpy(eager))
