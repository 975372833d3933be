"""Sync-BN: N towers x B examples train like 1 tower x N*B, up to float rounding.

The towers run concurrently on threads, as the engine runs them, and their
``context.sync`` is a small barrier-based average of the one array each
batch-norm call hands in (forward moments, backward sums).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy
import pytest

from towers.nn.conv import Conv2D
from towers.nn.layers import Dense, ReLU, Sequential
from towers.nn.normalization import BatchNorm
from towers.nn.pooling import GlobalAvgPool
from towers.nn.replica import Replica
from towers.nn.residual import Residual


class BarrierSync:
    """``for_tower(i)``: a ``sync(array)`` averaging one array in place across ``n`` threads (float32)."""

    def __init__(self, n: int):
        self.n, self.slots, self.calls = n, [None] * n, 0
        self.barrier = threading.Barrier(n)

    def for_tower(self, i: int):
        def sync(a):
            assert a.ndim == 1 and a.flags.c_contiguous and a.dtype == numpy.float32
            self.slots[i] = a
            self.barrier.wait()  # every tower's array is in
            mean = sum(s for s in self.slots) / numpy.float32(self.n)  # the same order in every thread
            self.barrier.wait()  # every tower has read every array
            a[...] = mean
            if i == 0:
                self.calls += 1
        return sync


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
