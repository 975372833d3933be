"""Convolutions on cuDNN (``gpu_conv`` cudnn, ``towers.devices.cudnn``) against the CPU and against im2col on the GPU.

Skipped without CUDA or without the cuDNN frontend (``nvidia-cudnn-frontend``).
Every check also asserts that cuDNN ran: the forward, weight-gradient and
input-gradient calls counted by ``towers.devices.cudnn.calls``, and no shape
left to im2col (``refused``), so a silent fallback fails the test.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import cupy_performance_warnings_fail
from tests.gpu import test_gpu_layers as layers
from tests.gpu_compare import DRY, compare, flat, images, rel, train
from towers.devices import cudnn
from towers.ops.forms import Forms

pytestmark = [pytest.mark.gpu, *cupy_performance_warnings_fail(),
              pytest.mark.skipif(DRY, reason="needs CuPy arrays and cuDNN")]


@pytest.fixture
def on_cudnn():
    """Device convolutions on cuDNN for the test (forms current in it: a ``Replica`` made by hand runs them; a
    ``Trainer`` runs its own); the ``gpu`` mark skips without CUDA (tests/conftest.py), this without the
    frontend."""
    try:
        cudnn.frontend()
    except ImportError as e:
        pytest.skip(f"the cuDNN frontend does not import: {e}")
    cudnn.refused.clear()
    start = dict(cudnn.calls)
    with Forms(cudnn=True).active():
        yield start


def _ran(start: dict, *ops) -> None:
    assert not cudnn.refused, f"shapes left to im2col: {cudnn.refused}"
    for op in ops:
        assert cudnn.calls[op] > start[op], f"cuDNN {op} never ran: {cudnn.calls} (from {start})"


CONV_CASES = sorted(c for c in layers.CASES if c.startswith(("conv", "residual", "maxpool", "batchnorm conv")))


@pytest.mark.parametrize("case", CONV_CASES)
def test_each_convolution_case_on_cudnn_matches_the_cpu(case, on_cudnn):
    """The layer cases of the im2col test (paddings, strides, 1x1, residual blocks), forward, every gradient and
    the evaluation logits, within the same tolerance; the first convolution takes no input gradient."""
    layers.test_layer_forward_and_backward_match_the_cpu(case)
    _ran(on_cudnn, "fprop", "wgrad")
    if case.startswith("residual"):  # the block's convolutions take their input gradient
        _ran(on_cudnn, "dgrad")


def test_a_convolution_on_cudnn_equals_im2col_on_the_gpu_at_resnet_sizes(on_cudnn):
    """A ResNet-sized 3x3 layer (batch 32, 32x32x16 -> 16, and a stride-2 16 -> 32): cuDNN's forward and both
    gradients against the im2col form on the same GPU, within float32 rounding of the sums."""
    import cupy

    from towers.nn.conv import Conv2D
    from towers.nn.layers import Dense, Flatten, Sequential
    from towers.nn.replica import Replica

    for conv, shape in ((Conv2D("c", 16, 3, bias=False, stddev="he"), (32, 32, 16)),
                        (Conv2D("c", 32, 3, padding=1, stride=2, bias=False, stddev="he"), (32, 32, 16))):
        model = Sequential([Conv2D("in", 16, 3, bias=False, stddev="he"), conv, Flatten(), Dense("out", 10)])
        model.build(shape)
        params = model.init_params(0)
        rng = np.random.default_rng(0)
        x = cupy.asarray(rng.standard_normal((32,) + shape).astype(np.float32))
        y = cupy.asarray(rng.integers(0, 10, 32).astype(np.int32))
        out = {}
        for form in (False, True):
            with Forms(cudnn=form).active():
                r = Replica(model, cupy)
                r.set_params(params)
                loss = float(r.loss_and_grads(x, y, l2=0.0))
                out[form] = (loss, cupy.asnumpy(r.grads), cupy.asnumpy(r.forward(x)))
        assert rel(out[True][0], out[False][0]) < 1e-5
        assert rel(out[True][1], out[False][1]) < 1e-4, "gradients differ beyond rounding"
        assert rel(out[True][2], out[False][2]) < 1e-5, "logits differ beyond rounding"
    _ran(on_cudnn, "fprop", "wgrad", "dgrad")


@pytest.mark.parametrize("model,data,settings", [
    ("resnet20", lambda: images(64, (16, 16, 3)), dict(batch_size=8, lr=0.05)),
    ("cifar10", lambda: images(96, (24, 24, 3)), dict(batch_size=12, lr=0.05)),
])
def test_training_on_cudnn_on_two_towers_sharing_the_gpu_matches_the_cpu(model, data, settings, on_cudnn):
    """Whole runs with ``gpu_conv`` cudnn: the CPU's weights within the im2col tests' tolerances, replicas
    bit-identical, cuDNN ran in every convolution."""
    tol, opts = (5e-2, dict(first=1e-4, accuracy=0.1)) if model == "resnet20" else (1e-4, {})
    compare(f"cudnn {model}", data(), 4, tol, model=model, n_gpu=2, gpu_conv="cudnn", **opts, **settings)
    _ran(on_cudnn, "fprop", "wgrad", "dgrad")


def test_two_cudnn_runs_give_the_same_bits(on_cudnn):
    """Deterministic engines only: a run repeats its bits (a step's weight gradient has no atomics)."""
    ds = images(64, (16, 16, 3))
    runs = [train("0", 3, ds, model="resnet20", batch_size=8, lr=0.05, n_gpu=2, gpu_conv="cudnn") for _ in range(2)]
    assert np.array_equal(flat(runs[0].weights), flat(runs[1].weights))
    _ran(on_cudnn, "fprop", "wgrad", "dgrad")
