"""CPU towers in grads mode share one parameter buffer, and only its owner's optimizer step runs.

Every replica would apply the same update to the same weights, so the
update runs once (``towers.step.tower.build_towers``).  The reference here
keeps two replicas apart, each with its own buffer, averages their gradients
and applies one optimizer: a tower whose step also ran would update the
shared weights twice.
"""
from __future__ import annotations

import numpy
import pytest

import towers
from towers.data.dataset import input_scale
from towers.nn.replica import Replica
from towers.optim.optimizers import make_optimizer

SMALL = dict(devices="cpu", n_gpu=2, hidden=16, quiet=True, summary_every=0, log_every=1000, checkpoint_every=0,
             batch_size=8, l2=0.0)


def _batches(n, shape, steps):
    rng = numpy.random.default_rng(5)
    return [(rng.integers(0, 256, (n,) + shape).astype(numpy.uint8), rng.integers(0, 10, n).astype(numpy.int32))
            for _ in range(steps)]


@pytest.mark.parametrize("cpu_towers", ["threads", "serial"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_towers_sharing_their_weights_update_them_once(optimizer, cpu_towers):
    cfg = towers.Config(**SMALL, optimizer=optimizer, cpu_towers=cpu_towers, lr=0.05, lr_decay=1.0)
    with towers.Trainer(cfg) as t:
        reps = [tw.replica for tw in t.executor.towers]
        assert numpy.shares_memory(reps[0].params, reps[1].params)
        model, shape = reps[0].model, reps[0].model.input_shape
        start = reps[0].params.copy()
        batches = _batches(16, shape, 3)
        for x, y in batches:
            t.train_step(x, y)
        t.synchronize()
        got = reps[0].params.copy()
        resolved = t.cfg
    # The reference: two replicas apart, their mean gradient, one optimizer.
    ref = [Replica(model, numpy) for _ in range(2)]
    for r in ref:
        r.set_params(start)
    opt = make_optimizer(resolved, ref[0].params, None)
    for step, (x, y) in enumerate(batches):
        for i, r in enumerate(ref):
            r.loss_and_grads(x[8 * i: 8 * i + 8] * input_scale(x.dtype), y[8 * i: 8 * i + 8], 0.0, False)
        mean = (ref[0].grads + ref[1].grads) * numpy.float32(0.5)
        opt.step(mean, resolved.lr, step)
        ref[1].set_params(ref[0].params)
    numpy.testing.assert_allclose(got, ref[0].params, rtol=1e-5, atol=1e-6)


def test_weights_mode_keeps_each_towers_own_weights():
    with towers.Trainer(towers.Config(**SMALL, sync="weights", average_every=2)) as t:
        reps = [tw.replica for tw in t.executor.towers]
        assert not numpy.shares_memory(reps[0].params, reps[1].params)
