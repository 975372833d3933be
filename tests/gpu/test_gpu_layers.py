"""Every layer forward and backward on the GPU against the CPU (skipped without CUDA).

Each case is a small model (the layer under test, then a dense layer to a
loss): one replica on the device under test and one on the CPU
(``tests/gpu_compare.py``), the same weights, input and labels; the training
loss, every gradient, the buffers a training forward moves (batch norm's
moving statistics) and the evaluation logits must agree within ``TOL``
(relative; GEMMs sum in another order on cuBLAS than in OpenBLAS).  Kernels
that give NumPy's bits are checked exactly in ``tests/gpu/test_gpu.py``.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import cupy_performance_warnings_fail
from tests.gpu_compare import DRY, record, rel, xp
from towers.arrays import to_host
from towers.nn.conv import Conv2D
from towers.nn.dropout import Dropout
from towers.nn.layers import Dense, Flatten, ReLU, Sequential
from towers.nn.normalization import LRN, BatchNorm
from towers.nn.pooling import AvgPool2D, GlobalAvgPool, MaxPool2D
from towers.nn.replica import Replica
from towers.nn.residual import Residual

pytestmark = [pytest.mark.gpu, pytest.mark.dry_run, *cupy_performance_warnings_fail()]

TOL = 1e-4  # one step: the measured differences are recorded (TOWERS_GPU_REPORT)


def _conv(scope, filters, k=3, **kw):
    return Conv2D(scope, filters, k, **kw)


CASES = {
    # convolutions: TF SAME and VALID, explicit padding, strides 1 and 2, without bias
    "conv SAME": ([_conv("c", 6, 5)], (9, 11, 3)),
    "conv VALID": ([_conv("c", 4, 3, padding="VALID")], (8, 7, 2)),
    "conv pad 1 stride 2": ([_conv("c", 5, 3, padding=1, stride=2, bias=False, stddev="he")], (9, 9, 3)),
    "conv SAME stride 2": ([_conv("c", 4, 3, stride=2)], (8, 10, 3)),
    "conv 1x1": ([_conv("c", 7, 1)], (5, 5, 4)),
    "conv whole": ([Conv2D("c", 6, 3, algorithm="whole")], (7, 7, 3)),
    # pooling
    "maxpool 2": ([_conv("c", 4), MaxPool2D(2)], (8, 10, 2)),
    "maxpool 2 odd (SAME)": ([_conv("c", 4), MaxPool2D(2)], (7, 9, 2)),
    "maxpool 3 stride 2": ([_conv("c", 4), MaxPool2D(3, 2)], (9, 9, 2)),
    "avgpool 2": ([_conv("c", 4), AvgPool2D(2)], (8, 8, 2)),
    "avgpool 3 stride 2 SAME": ([_conv("c", 4), AvgPool2D(3, 2, "SAME")], (9, 9, 2)),
    "global avgpool": ([_conv("c", 4), GlobalAvgPool()], (6, 5, 2)),
    # normalization
    "batchnorm conv": ([_conv("c", 5, bias=False), BatchNorm("bn"), ReLU()], (6, 6, 3)),
    "batchnorm dense": ([Flatten(), Dense("d", 12), BatchNorm("bn"), ReLU()], (5, 5, 1)),
    "batchnorm no scale no center": ([_conv("c", 5), BatchNorm("bn", scale=False, center=False)], (6, 6, 2)),
    "lrn (cifar10's)": ([_conv("c", 8), ReLU(), LRN(4, 1.0, 0.001 / 9, 0.75)], (6, 6, 3)),
    "lrn (defaults)": ([_conv("c", 8), LRN()], (5, 5, 2)),
    # dropout: the mask is drawn on the host, the same on both devices
    "dropout": ([Flatten(), Dense("d", 16), ReLU(), Dropout(0.5)], (6, 6, 1)),
    # residual blocks: identity, option A (stride 2, padded channels), projection (option B)
    "residual identity": ([_conv("in", 4, bias=False), Residual(
        [_conv("c1", 4, bias=False), BatchNorm("bn1"), ReLU(), _conv("c2", 4, bias=False), BatchNorm("bn2")],
        scope="block")], (8, 8, 3)),
    "residual option A": ([_conv("in", 4, bias=False), Residual(
        [_conv("c1", 8, padding=1, stride=2, bias=False), BatchNorm("bn1"), ReLU(), _conv("c2", 8, bias=False),
         BatchNorm("bn2")], shortcut="A", scope="block")], (8, 8, 3)),
    "residual projection": ([_conv("in", 4, bias=False), Residual(
        [_conv("c1", 8, padding=1, stride=2, bias=False), BatchNorm("bn1"), ReLU(), _conv("c2", 8, bias=False),
         BatchNorm("bn2")], shortcut="projection", scope="block")], (8, 8, 3)),
}


def _pair(layers, shape, seed=0):
    model = Sequential(list(layers) + [Flatten(), Dense("out", 10)])
    model.build(shape)
    params = model.init_params(seed)
    reps = []
    for m in (np, xp()):
        r = Replica(model, m)
        r.set_params(params)
        r.context.seed, r.context.tower, r.context.step = 7, 1, 3  # dropout draws from these
        reps.append(r)
    return reps


def _data(shape, n=16, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n,) + tuple(shape)).astype(np.float32), rng.integers(0, 10, n)


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_forward_and_backward_match_the_cpu(case):
    layers, shape = CASES[case]
    cpu, dev = _pair(layers, shape)
    x, y = _data(shape)
    m = xp()
    losses = []
    for r, module in ((cpu, np), (dev, m)):
        losses.append(float(r.loss_and_grads(module.asarray(x), module.asarray(y.astype(np.int32)), l2=1e-3)))
    d = {"loss": rel(losses[1], losses[0])}
    total = float(np.linalg.norm(cpu.grads))
    for name in cpu.grad:
        g = to_host(dev.grad[name])
        assert np.isfinite(g).all(), f"{case}: {name}'s gradient is not finite on the device"
        # A gradient that is zero by the mathematics (a bias before batch norm) is rounding noise on both
        # devices (a millionth of the whole gradient): its difference counts against a thousandth of the whole.
        noise = np.linalg.norm(cpu.grad[name]) < 1e-6 * total
        d["grad " + name] = rel(g, cpu.grad[name], 1e-3 * total if noise else 0.0)
    for name in cpu.buffer:  # moved by the training forward (batch norm's moving statistics)
        d["buffer " + name] = rel(to_host(dev.buffer[name]), cpu.buffer[name])
    # Evaluation mode: moving statistics, no dropout.
    logits = to_host(dev.forward(m.asarray(x)))
    assert np.isfinite(logits).all(), f"{case}: non-finite evaluation logits on the device"
    d["eval logits"] = rel(logits, cpu.forward(x))
    record("layer " + case, **d)
    bad = {k: v for k, v in d.items() if not v < TOL}
    assert not bad, f"{case}: differences above {TOL}: {bad}"


def test_dropout_masks_are_the_same_on_both_devices_and_differ_by_tower():
    """The mask comes from the host generator of (seed, tower, step, layer): equal across devices, not towers."""
    layers = [Flatten(), Dropout(0.3)]
    outs = {}
    for tower in (0, 1):
        model = Sequential(layers + [Dense("out", 4)])
        model.build((3, 5))
        for module in (np, xp()):
            r = Replica(model, module)
            r.context.training, r.context.seed, r.context.tower, r.context.step = True, 5, tower, 2
            ws = r._local[1][2]
            x = module.ones((8, 15), dtype=np.float32)
            outs[tower, module.__name__] = to_host(model.layers[1].forward({}, x, ws)).copy()
    first = outs[0, "numpy"]
    assert np.array_equal(outs[0, xp().__name__], first)
    assert np.array_equal(outs[1, xp().__name__], outs[1, "numpy"])
    assert not np.array_equal(outs[1, "numpy"], first)
    kept = first != 0
    np.testing.assert_allclose(first[kept], np.float32(1 / 0.7), rtol=1e-6)


@pytest.mark.skipif(DRY, reason="needs CuPy arrays")
def test_host_labels_with_device_logits_are_taken():
    """A replica driven by hand with host labels (int64) trains as with device labels."""
    cpu, dev = _pair([Flatten(), Dense("d", 8), ReLU()], (4, 4))
    x, y = _data((4, 4))
    m = xp()
    host = float(dev.loss_and_grads(m.asarray(x), y, l2=0.0))  # NumPy int64 labels
    ref = float(cpu.loss_and_grads(x, y, l2=0.0))
    assert rel(host, ref) < TOL


@pytest.mark.skipif(DRY, reason="needs CuPy arrays")
@pytest.mark.parametrize("shape,scale,center", [((16, 16, 16), True, True), ((8, 8, 64), False, True),
                                                ((5, 7, 3), True, False), ((40,), True, True)])
def test_batch_norm_kernels_match_the_array_passes_on_the_gpu(shape, scale, center):
    """Batch norm's GPU kernels (three launches a way) against its array passes on the same GPU: output, moving
    statistics, gamma's and beta's gradients and dx within float32 rounding (the kernels sum in float64); the
    kernels really ran (``ws.saved["kernels"]``)."""
    from towers.ops import batch_norm

    m = xp()
    layer = BatchNorm("bn", scale=scale, center=center)
    params, _ = layer.build(shape)
    rng = np.random.default_rng(3)
    x = m.asarray((rng.standard_normal((64,) + shape) * 3 + 5).astype(np.float32))  # off-centre: a shift matters
    dy = m.asarray(rng.standard_normal((64,) + shape).astype(np.float32))
    start = {q.name: (rng.standard_normal(q.shape) * 0.1 + (q.name in ("gamma", "moving_variance"))).astype(
        np.float32) for q in params}
    out = {}
    for on in (True, False):
        batch_norm.DEVICE_KERNELS[0] = on
        try:
            p = {k: m.asarray(v) for k, v in start.items()}
            g = {q.name: m.zeros(q.shape, np.float32) for q in params if q.trainable}
            ws = layers_ws(m)
            y = layer.forward(p, x, ws)
            assert ws.saved["kernels"] is on
            dx = layer.backward(p, g, dy, ws, True)
            out[on] = {"y": to_host(y), "dx": to_host(dx), **{k: to_host(v) for k, v in p.items()},
                       **{"g " + k: to_host(v) for k, v in g.items()}}
        finally:
            batch_norm.DEVICE_KERNELS[0] = True
    for k in out[False]:
        assert rel(out[True][k], out[False][k]) < 1e-5, f"{k}: {rel(out[True][k], out[False][k])}"


def layers_ws(m):
    from towers.nn.layers import Workspace

    return Workspace(m)
