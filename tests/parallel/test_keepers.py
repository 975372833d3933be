"""The step engine's keepers (``towers.parallel.sync``) and the one all-reduce count (``Counted``).

The engine runs a step and asks its keeper for the gradients each tower's
update applies (``average``), then updates the towers itself: a keeper of
our own that never averages must leave each tower where one tower alone
would be; one that hands every tower the first tower's gradient must make
every replica the first tower's run; one that returns None must leave the
weights and the EMA where they were.
The count is the communication report's: one per grads step on serial or
threaded towers (a sliced all-reduce counts once), sync-BN's statistic
averages not counted.
"""
from __future__ import annotations

import numpy
import pytest

import towers
from towers.parallel.reducers import Counted, Reducer
from towers.parallel.sync import Keeping

SMALL = dict(devices="cpu", hidden=16, batch_size=8, lr=0.1, optimizer="sgd", blas_threads=1, lr_decay=1.0, quiet=True,
             summary_every=0, log_every=1000, checkpoint_every=0)


class Alone(Keeping):
    """Each tower updates on its own gradient and nothing is ever averaged."""

    shared = False

    def average(self, towers_, part, on, buckets=None):
        assert part is None
        return [t.replica.grads for t in towers_]

    def comparable(self, step):
        return False


class FirstTowers(Keeping):
    """Every tower applies the first tower's gradient (a slice of it on tower threads): a strategy that returns
    buffers of its own choosing, as a communication hook does."""

    def average(self, towers_, part, on, buckets=None):
        first = towers_[0].replica.grads
        return [first if part is None else first[part]] * len(towers_)


class Never(Keeping):
    """Every step is skipped, as fp16's overflow skips one."""

    def average(self, towers_, part, on, buckets=None):
        return None


def _batches(steps: int, rows: int):
    rng = numpy.random.default_rng(3)
    return [(rng.integers(0, 256, (rows, 8, 8)).astype(numpy.uint8), rng.integers(0, 10, rows).astype(numpy.int32))
            for _ in range(steps)]


@pytest.mark.parametrize("cpu_towers", ["serial", "threads"])
def test_a_custom_keeper_decides_how_replicas_stay_together(cpu_towers):
    steps, b = 4, SMALL["batch_size"]
    data = _batches(steps, 2 * b)
    with towers.Trainer(towers.Config(**SMALL, n_gpu=2, cpu_towers=cpu_towers)) as tr:
        # Grads mode's CPU towers share one parameter buffer: a keeper that updates them apart is refused.
        with pytest.raises(ValueError, match="share one parameter buffer"):
            tr.executor.engine.keeper = Alone(tr.executor.reducer, tr.executor.timer)
    # Weights mode builds them apart; its keeper is then replaced.
    with towers.Trainer(towers.Config(**SMALL, n_gpu=2, cpu_towers=cpu_towers, sync="weights")) as tr:
        tr.executor.engine.keeper = Alone(tr.executor.reducer, tr.executor.timer)
        for x, y in data:
            tr.train_step(x, y)
        tr.synchronize()
        assert tr.all_reduces == 0  # the keeper never reduced
        assert tr.check_replicas() is False
        got = [r.params.copy() for r in tr.executor.replicas]
    for i in range(2):  # tower i trained alone on its slice of every batch
        with towers.Trainer(towers.Config(**SMALL, n_gpu=1)) as one:
            for x, y in data:
                one.train_step(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])
            numpy.testing.assert_allclose(got[i], one.executor.replicas[0].params, rtol=1e-6, atol=1e-7)
    assert not numpy.array_equal(got[0], got[1])


@pytest.mark.parametrize("cpu_towers", ["serial", "threads"])
def test_the_engine_updates_every_tower_with_the_buffers_its_keeper_returns(cpu_towers):
    steps, b = 3, SMALL["batch_size"]
    data = _batches(steps, 2 * b)
    with towers.Trainer(towers.Config(**SMALL, n_gpu=2, cpu_towers=cpu_towers, sync="weights")) as tr:
        tr.executor.engine.keeper = FirstTowers(tr.executor.reducer, tr.executor.timer)
        for x, y in data:
            tr.train_step(x, y)
        tr.synchronize()
        assert tr.all_reduces == 0
        got = [r.params.copy() for r in tr.executor.replicas]
    with towers.Trainer(towers.Config(**SMALL, n_gpu=1)) as one:  # tower 0 alone on its slice of every batch
        for x, y in data:
            one.train_step(x[:b], y[:b])
        want = one.executor.replicas[0].params
    for g in got:
        numpy.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("sync", ["grads", "weights"])
def test_a_keeper_that_returns_none_skips_the_update_and_the_ema(sync):
    with towers.Trainer(towers.Config(**SMALL, n_gpu=2, sync=sync)) as tr:
        before, ema = tr.get_weights(), tr.get_weights(ema=True)
        keeper = Never(tr.executor.reducer, tr.executor.timer)
        keeper.same_updates = True  # grads mode's CPU towers share one buffer: what it returns they apply once
        tr.executor.engine.keeper = keeper
        for x, y in _batches(2, 2 * SMALL["batch_size"]):
            tr.train_step(x, y)
        assert tr.step == 2
        for name, w in tr.get_weights().items():
            numpy.testing.assert_array_equal(w, before[name], err_msg=name)
        for name, w in tr.get_weights(ema=True).items():
            numpy.testing.assert_array_equal(w, ema[name], err_msg=name)


def bn_model():
    return [towers.Flatten(), towers.Dense("fc1", 12), towers.BatchNorm("bn"), towers.ReLU(), towers.Dense("fc2", 10)]


@pytest.mark.parametrize("cpu_towers, sync_bn", [("serial", False), ("threads", False), ("threads", True),
                                                 ("serial", True)])
def test_one_all_reduce_per_grads_step_on_any_schedule(cpu_towers, sync_bn):
    steps = 5
    with towers.Trainer(towers.Config(**SMALL, n_gpu=2, cpu_towers=cpu_towers, sync_bn=sync_bn),
                        model=bn_model()) as tr:
        for x, y in _batches(steps, 2 * SMALL["batch_size"]):
            tr.train_step(x, y)
        tr.synchronize()
        assert tr.executor.engine.threaded == (cpu_towers == "threads" or sync_bn)
        assert tr.all_reduces == steps


class Sum(Reducer):
    """Adds one to every element: enough to see which calls reach the reducer."""

    splittable = True

    def average(self, buffers):
        for b in buffers:
            b += 1


def test_counted_counts_a_sliced_all_reduce_once():
    bufs = [numpy.zeros(10, numpy.float32) for _ in range(2)]
    c = Counted(Sum())
    c.average(bufs)
    assert c.count == 1
    for part in (slice(5, 10), slice(0, 5)):  # the slices of one all-reduce, in any order
        c.average([b[part] for b in bufs], part)
    assert c.count == 2 and all((b == 2).all() for b in bufs)
