"""Sync-BN: N towers x B examples train like 1 tower x N*B, up to float rounding, and as close to float64 as float32 allows.

The towers run concurrently on threads, as the engine runs them, and their
``context.sync`` is a small barrier-based average of the one array each
batch-norm call hands in (forward: gathered means and averaged variances;
backward: sums).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy
import pytest

from tests.conftest import cpu_form
from towers.ops import activation
from towers.nn.context import TowerSync
from towers.nn.conv import Conv2D
from towers.nn.layers import Dense, ReLU, Sequential, Workspace
from towers.nn.models import resnet
from towers.nn.normalization import BatchNorm
from towers.nn.pooling import GlobalAvgPool
from towers.nn.replica import Replica
from towers.nn.residual import Residual


class BarrierSync:
    """``for_tower(i)``: a ``TowerSync`` averaging one array in place across ``n`` threads."""

    def __init__(self, n: int):
        self.n, self.slots, self.calls = n, [None] * n, 0
        self.barrier = threading.Barrier(n)

    def for_tower(self, i: int):
        def sync(a):
            assert a.ndim == 1 and a.flags.c_contiguous and a.dtype in (numpy.float32, numpy.float64)
            self.slots[i] = a
            self.barrier.wait()  # every tower's array is in
            mean = sum(s for s in self.slots) / a.dtype.type(self.n)  # the same order in every thread
            self.barrier.wait()  # every tower has read every array
            a[...] = mean
            if i == 0:
                self.calls += 1
        return TowerSync(sync, i, self.n)


def _model():
    return Sequential([
        Conv2D("c", 4, 3, padding="same", bias=False), BatchNorm("bn1"), ReLU(),
        Residual([Conv2D("c1", 6, 3, padding=1, stride=2, bias=False), BatchNorm("bn1"), ReLU(),
                  Conv2D("c2", 6, 3, padding=1, bias=False), BatchNorm("bn2")], shortcut="A", scope="block"),
        GlobalAvgPool(), Dense("fc", 8), BatchNorm("bn2"), ReLU(), Dense("out", 3),
    ]).build((6, 6, 2))


def _train(n_towers: int, batch: int, steps: int, sync: bool):
    """(params, per-tower buffers, per-step mean gradients) after ``steps`` SGD steps of ``n_towers`` x ``batch``."""
    model = _model()
    init = model.init_params(0)
    reps = [Replica(model, numpy) for _ in range(n_towers)]
    s = BarrierSync(n_towers) if sync else None
    for i, r in enumerate(reps):
        r.set_params(init)
        r.context.tower = i
        r.context.sync = s.for_tower(i) if s else None
    rng = numpy.random.default_rng(1)
    grads = []
    with ThreadPoolExecutor(n_towers) as pool:
        for step in range(steps):
            x = rng.normal(2.0, 1.5, (n_towers * batch, 6, 6, 2)).astype(numpy.float32)
            y = rng.integers(0, 3, n_towers * batch)

            def tower(i):
                r = reps[i]
                r.context.step = step
                sl = slice(i * batch, (i + 1) * batch)
                return r.loss_and_grads(x[sl], y[sl], 1e-3)

            list(pool.map(tower, range(n_towers)))
            g = sum(r.grads for r in reps) / numpy.float32(n_towers)  # the gradient all-reduce
            grads.append(g)
            for r in reps:
                r.params -= numpy.float32(0.1) * g
    if s is not None:
        assert s.calls == steps * 2 * 4  # 4 batch-norm layers: one forward and one backward sync each
    return reps[0].params.copy(), [r.buffers.copy() for r in reps], grads


@pytest.mark.parametrize("n_towers", [2, 3])
def test_sync_bn_towers_train_like_one_big_tower(n_towers):
    params, buffers, grads = _train(n_towers, 4, 3, sync=True)
    big_params, big_buffers, big_grads = _train(1, 4 * n_towers, 3, sync=False)
    for g, bg in zip(grads, big_grads):
        numpy.testing.assert_allclose(g, bg, rtol=2e-4, atol=2e-6)
    numpy.testing.assert_allclose(params, big_params, rtol=1e-4, atol=1e-6)
    for b in buffers:  # every tower keeps the global batch's moving statistics
        numpy.testing.assert_array_equal(b, buffers[0])
        numpy.testing.assert_allclose(b, big_buffers[0], rtol=1e-4, atol=1e-6)


def test_without_sync_towers_normalize_with_their_own_batch():
    # The check above can fail: per-tower statistics give other gradients and buffers.
    params, buffers, grads = _train(2, 4, 1, sync=False)
    _, big_buffers, big_grads = _train(1, 8, 1, sync=False)
    assert not numpy.allclose(grads[0], big_grads[0], rtol=1e-3, atol=1e-5)
    assert not numpy.allclose(buffers[0], buffers[1], rtol=1e-3)


def _concurrently(n: int, tower):
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(tower, range(n)))


def test_sync_bn_combines_the_towers_statistics_without_cancelling():
    # Three towers (the gathered means are scaled by 3 and back: not exact)
    # whose batches sit at mean 100 + 0.004 * tower, std 0.01: the global
    # variance is the towers' variance plus that of their means, each small
    # beside 100^2.  Against float64 on the concatenated batch.
    n, b, c = 3, 64, 2
    rng = numpy.random.default_rng(3)
    x = (100 + 0.004 * numpy.repeat(numpy.arange(n), b)[:, None] + 0.01 * rng.normal(size=(n * b, c)))
    x = x.astype(numpy.float32)
    dy = rng.normal(size=x.shape).astype(numpy.float32)
    gamma, beta = numpy.array([1.3, -0.6], numpy.float32), numpy.array([0.2, 0.1], numpy.float32)
    s = BarrierSync(n)
    bn = BatchNorm("bn", epsilon=1e-5)
    bn.build((c,))
    states = []
    for i in range(n):
        p = {"gamma": gamma, "beta": beta, "moving_mean": numpy.zeros(c, numpy.float32),
             "moving_variance": numpy.ones(c, numpy.float32)}
        g = {"gamma": numpy.zeros(c, numpy.float32), "beta": numpy.zeros(c, numpy.float32)}
        ws = Workspace(numpy)
        ws.ctx.sync = s.for_tower(i)
        states.append((p, g, ws))

    def tower(i):
        p, g, ws = states[i]
        rows = slice(i * b, (i + 1) * b)
        y = bn.forward(p, x[rows], ws).copy()
        return y, bn.backward(p, g, dy[rows], ws, need_dx=True).copy()

    out = _concurrently(n, tower)
    x64, dy64 = x.astype(numpy.float64), dy.astype(numpy.float64)
    xc = x64 - x64.mean(axis=0)
    inv_std = 1 / numpy.sqrt((xc * xc).mean(axis=0) + 1e-5)
    xhat = xc * inv_std
    want_y = xhat * gamma + beta
    want_dx = gamma * inv_std * (dy64 - dy64.mean(axis=0) - xhat * (dy64 * xhat).mean(axis=0))
    y, dx = numpy.concatenate([o[0] for o in out]), numpy.concatenate([o[1] for o in out])
    assert numpy.abs(y - want_y).max() < 2e-5 * numpy.abs(want_y).max()
    assert numpy.abs(dx - want_dx).max() < 2e-5 * numpy.abs(want_dx).max()
    dgamma = sum(st[1]["gamma"].astype(numpy.float64) for st in states)  # what the gradient all-reduce sums
    numpy.testing.assert_allclose(dgamma, (dy64 * xhat).sum(axis=0), rtol=2e-5)
    for p, _, _ in states:  # every tower: the same moving statistics, to the bit
        numpy.testing.assert_array_equal(p["moving_mean"], states[0][0]["moving_mean"])
        numpy.testing.assert_array_equal(p["moving_variance"], states[0][0]["moving_variance"])
    numpy.testing.assert_allclose(states[0][0]["moving_mean"], 0.9 * x64.mean(axis=0), rtol=1e-6)


def _resnet_step(dtype, x, y, n: int, masks: dict, compiled=False):
    """The mean gradient of one sync-BN step of ResNet-20 on ``n`` towers (threads), as float64.

    ``masks``: the ReLU masks per (tower, call); a float32 step records them,
    a float64 step applies them (see the test).  ``compiled``: numba's compiled
    CPU forms (``towers.ops.forms``), and each tower's own statistics (no
    sync-BN: batch norm's compiled loops are for those).
    """
    model = resnet(3)(x.shape[1:], 10).build(x.shape[1:])
    reps = [Replica(model, numpy, dtype=dtype) for _ in range(n)]
    s = BarrierSync(n)
    for i, r in enumerate(reps):
        r.set_params(model.init_params(0))
        r.context.tower, r.context.sync = i, s.for_tower(i) if not compiled else None
    b = len(x) // n
    calls = threading.local()
    record = activation.relu_backward

    def relu_backward(y, dy):
        key = (calls.tower, calls.count)
        calls.count += 1
        if dtype == numpy.float32:
            masks[key] = y > 0
            record(y, dy)
        else:
            dy *= masks[key]

    def tower(i):
        calls.tower, calls.count = i, 0
        rows = slice(i * b, (i + 1) * b)
        reps[i].loss_and_grads(x[rows].astype(dtype), y[rows], 1e-4)

    activation.relu_backward = relu_backward
    try:
        with cpu_form("numba" if compiled else "numpy"):
            _concurrently(n, tower)
    finally:
        activation.relu_backward = record
    return sum(r.grads.astype(numpy.float64) for r in reps) / n


@pytest.mark.slow
def test_one_sync_bn_step_of_resnet20_lands_near_float64():
    """One step of ResNet-20, 2 towers x 8 with sync-BN, against the same step in float64.

    The images are nearly flat (pixels 124..132 of 255): the first
    convolution's outputs then have a mean several times their spread, where
    E[x^2] - E[x]^2 cancels (the old float32 code: 3e-5 to 7e-5 of the
    update; the centred one: about 2e-6; PyTorch's float32: 6e-6).  A ReLU
    whose input lies within float32's rounding of 0 may switch sides between
    the two precisions, and one such flip moves the early layers' gradients
    by about 1e-3: the float64 step therefore takes the float32 step's ReLU
    masks, and the comparison is of the arithmetic between them.
    """
    rng = numpy.random.default_rng(0)
    x = ((128 + rng.integers(-4, 5, (16, 32, 32, 3))) / 255).astype(numpy.float32)
    y = rng.integers(0, 10, 16)
    masks: dict = {}
    g32 = _resnet_step(numpy.float32, x, y, 2, masks)
    g64 = _resnet_step(numpy.float64, x, y, 2, masks)
    assert len(masks) == 2 * 19  # every ReLU of both towers
    # The update is -lr * g (SGD's first step, with or without momentum).
    assert numpy.linalg.norm(g32 - g64) / numpy.linalg.norm(g64) < 1e-5


@pytest.mark.slow
def test_one_compiled_step_of_resnet20_lands_near_float64():
    """The same step through numba's compiled batch norm (``cpu_kernels``), one tower, against float64.

    The float32 step runs the compiled loops (float64 sums); the float64 step
    the NumPy passes.  The loops keep the centred moments, so they land as near
    as the NumPy passes do.
    """
    pytest.importorskip("numba", reason="numba is not installed: the compiled CPU forms are optional")

    rng = numpy.random.default_rng(0)
    x = ((128 + rng.integers(-4, 5, (8, 32, 32, 3))) / 255).astype(numpy.float32)
    y = rng.integers(0, 10, 8)
    masks: dict = {}
    g32 = _resnet_step(numpy.float32, x, y, 1, masks, compiled=True)
    g64 = _resnet_step(numpy.float64, x, y, 1, masks)
    assert len(masks) == 19
    assert numpy.linalg.norm(g32 - g64) / numpy.linalg.norm(g64) < 1e-5


# -- one value per channel: refused when the model is built ---------------------------------------


def _bn_run(layers, shape, **settings):
    from towers import Config, Dataset, Trainer

    rng = numpy.random.default_rng(0)
    ds = Dataset.from_arrays(rng.random((8, *shape), dtype=numpy.float32), numpy.arange(8) % 2)
    return Trainer(Config(devices="cpu", steps=1, quiet=True, summary_every=0, **settings), model=layers, dataset=ds)


@pytest.mark.parametrize("settings, where", [
    (dict(batch_size=1), "set `batch_size` 2 or more, or set `sync_bn` with 2 or more towers"),
    (dict(batch_size=1, accumulate=4), "`accumulate` 4 adds none, each micro-batch is normalized alone"),
    (dict(batch_size=1, sync_bn=True), "`batch_size` 1 on 1 tower with `sync_bn`"),
])
def test_batch_norm_over_one_value_per_channel_is_refused_naming_the_layer(settings, where):
    # It trained to 8-12% (every example's output was beta): the layer is named, nested ones by their scopes.
    from towers import UserError
    from towers.errors import render

    flat = [Dense("h", 6), BatchNorm("bn"), ReLU(), Dense("out", 2)]
    nested = [Dense("h", 6), Residual([Dense("d", 6), BatchNorm("bn")], scope="block"), Dense("out", 2)]
    for layers, name in ((flat, "bn"), (nested, "block/bn")):
        with pytest.raises(UserError) as e:
            _bn_run(layers, (5,), **settings)
        assert str(e.value).startswith(f"{name}: batch norm would normalize 1 value per channel in training ("), e.value
        assert render(where) in str(e.value), e.value


def test_batch_norm_with_two_values_per_channel_trains():
    # Batch 1 of 2x2 maps (4 values a channel), and batch 1 on 2 towers pooled by sync-BN (2 values).
    conv = [Conv2D("c", 3, 1, bias=False), BatchNorm("bn"), GlobalAvgPool(), Dense("out", 2)]
    with _bn_run(conv, (2, 2, 1), batch_size=1) as tr:
        tr.run_steps(1)
    with _bn_run([Dense("h", 6), BatchNorm("bn"), Dense("out", 2)], (5,), batch_size=1, n_gpu=2, sync_bn=True) as tr:
        tr.run_steps(1)
