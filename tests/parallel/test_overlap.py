"""The gradient average in buckets during backward (``allreduce_bucket_mib``): the same bits, in order, counted."""
import numpy as np
import pytest

from tests.conftest import DIGITS
from towers import Config, Trainer
from towers.data.loading import load_dataset
from towers.devices.placement import resolve
from towers.errors import UserError
from towers.nn.layers import Dense, Flatten, ReLU, Sequential
from towers.parallel.buckets import plan_buckets
from towers.parallel.reducers import Counted, Reducer, make_reducer
from towers.train import main

# Three layers with parameters (780, 130 and 110 of them): 0.0005 MiB (131 floats) makes two buckets, {c, b} and
# {a}; 1e-9 MiB one per layer; 1e6 MiB one bucket, the whole buffer.
TWO_BUCKETS, PER_LAYER, ONE_BUCKET = 0.0005, 1e-9, 1e6


class Logged(Dense):
    """A Dense layer that notes its backward (its scope, and the context's tower: tower x K + micro-batch)."""

    def __init__(self, scope, units, log):
        super().__init__(scope, units)
        self.log = log

    def backward(self, p, g, dy, ws, need_dx):
        self.log.append(("backward", self.scope, ws.ctx.tower))
        return super().backward(p, g, dy, ws, need_dx)


def model(log=None):
    dense = (lambda s, u: Logged(s, u, log)) if log is not None else Dense
    return Sequential([Flatten(), dense("a", 12), ReLU(), dense("b", 10), ReLU(), dense("c", 10)])


class Recording(Reducer):
    """A real reducer that notes the range of the flat buffer each call averages."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log
        self.splittable, self.noop = inner.splittable, inner.noop

    def average(self, buffers):
        b = buffers[0]
        base = b if b.base is None else b.base
        lo = (b.ctypes.data - base.ctypes.data) // b.itemsize
        self.log.append(("average", lo, lo + b.size))
        self.inner.average(buffers)

    def close(self):
        self.inner.close()


def train(mib, steps=3, n=2, log=None, reducer=None, **settings):
    """Weights and EMA after ``steps`` of the run's own batches, its all-reduce count and its plan."""
    cfg = Config(n_gpu=n, devices="cpu", batch_size=10, seed=5, l2=1e-3, allreduce_bucket_mib=mib, **settings)
    with Trainer(cfg, model=model(log), dataset=load_dataset(str(DIGITS)), reducer=reducer) as tr:
        tr.run_steps(steps)
        overlap = tr.executor.engine.keeper.overlap
        return (tr.get_weights(), tr.get_weights(ema=True), tr.all_reduces,
                overlap.plan if overlap is not None else None)


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("cpu_towers, accumulate", [("serial", 1), ("threads", 1), ("serial", 2), ("threads", 3)])
def test_bucketed_runs_end_bit_identical_to_one_all_reduce(cpu_towers, accumulate):
    base = train(0, cpu_towers=cpu_towers, accumulate=accumulate)
    assert base[2] == 3 and base[3] is None
    for mib, n_buckets in ((PER_LAYER, 3), (TWO_BUCKETS, 2), (ONE_BUCKET, 1)):
        weights, ema, count, plan = train(mib, cpu_towers=cpu_towers, accumulate=accumulate)
        assert len(plan) == n_buckets
        assert same(weights, base[0]) and same(ema, base[1]), mib
        # Each range of a bucket is one all-reduce: two per bucket but the whole buffer's one.
        assert count == 3 * sum(len(b.ranges) for b in plan) == (3 if n_buckets == 1 else 6 * n_buckets)


def test_through_nccl_with_rounding_and_loss_scaling_the_bits_are_the_same(standin):
    """The NCCL code path (the stand-in) over 3 towers, two of them sharing a "GPU", with the gradients rounded to
    bfloat16 for the all-reduce and fp16's loss scale unscaling the mean: identical replicas, the same bits."""
    out = []
    for mib in (0, PER_LAYER):
        standin.reset()
        cfg = Config(n_gpu=3, devices="cpu", batch_size=10, l2=1e-3, allreduce_bucket_mib=mib,
                     allreduce_dtype="bf16", precision="fp16")
        with Trainer(cfg, model=model(), dataset=load_dataset(str(DIGITS)),
                     reducer=standin.reducer(3, groups=[[0, 1], [2]])) as tr:
            for r in tr.executor.replicas:
                standin.register(r.grads)
            tr.run_steps(3)
            assert tr.check_replicas()
            counts = [c[4] for c in standin.calls if c[0] == "allReduce"]
            out.append((tr.get_weights(), tr.all_reduces, counts))
    (base, n0, counts0), (bucketed, n1, counts1) = out
    assert same(bucketed, base)
    assert (n0, n1) == (3, 3 * 6)
    assert counts0 == [780 + 130 + 110] * 2 * 3  # two ranks, the whole buffer, each step
    plan = plan_buckets(model().build((8, 8)).layer_spans(), PER_LAYER * 2 ** 20)
    assert counts1 == [hi - lo for b in plan for lo, hi in b.ranges for _ in range(2)] * 3


@pytest.mark.parametrize("accumulate", [1, 2])
def test_buckets_are_averaged_in_backward_order_while_the_last_tower_runs_backward(accumulate):
    """Serial towers: bucket b is averaged right after the last tower's last micro-batch's backward has finished its
    layers, before the backward of the layers before it; earlier micro-batches issue nothing."""
    log = []
    *_, plan = train(TWO_BUCKETS, steps=1, log=log, cpu_towers="serial", accumulate=accumulate,
                     reducer=lambda placement, streams: Recording(make_reducer(placement, streams), log))
    assert [b.first_layer for b in plan] == [3, 1]  # {c, b}, then {a}
    first_of = {"b": plan[0], "a": plan[1]}
    want = []
    for tower in range(2):
        for k in range(accumulate):
            for scope in "cba":
                want.append(("backward", scope, tower * accumulate + k))
                if tower == 1 and k == accumulate - 1 and scope in first_of:
                    want += [("average", lo, hi) for lo, hi in first_of[scope].ranges]
    assert log == want


def test_tower_threads_issue_the_buckets_in_order_each_once_both_towers_finished_it():
    log = []
    for _ in range(3):  # threads interleave differently from run to run: the order of the averages does not
        log.clear()
        *_, plan = train(PER_LAYER, steps=1, log=log, cpu_towers="threads", accumulate=2,
                         reducer=lambda placement, streams: Recording(make_reducer(placement, streams), log))
        averages = [e for e in log if e[0] == "average"]
        assert averages == [("average", lo, hi) for b in plan for lo, hi in b.ranges]
        scope = {5: "c", 3: "b", 1: "a"}
        for b in plan:
            at = log.index(("average", *b.ranges[0]))
            # After both towers' last micro-batch finished the bucket's layers ...
            assert {("backward", scope[b.first_layer], t) for t in (1, 3)} <= set(log[:at])
            # ... and, but for the last bucket, before some backward of the layers before it.
            if b.index < len(plan) - 1:
                assert ("backward", "a", 1) in log[at:] or ("backward", "a", 3) in log[at:]


def test_one_tower_has_no_buckets_and_counts_nothing():
    weights, _, count, plan = train(TWO_BUCKETS, n=1)
    assert count == 0 and plan is None
    assert same(weights, train(0, n=1)[0])


def test_a_counted_view_on_other_streams_adds_to_the_same_count():
    a, b = np.ones(4, np.float32), np.full(4, 3, np.float32)
    counted = Counted(make_reducer(resolve(2, "cpu"), [None, None]))
    view = counted.on_streams([None, None])
    view.average([a[:2], b[:2]])
    counted.average([a[2:], b[2:]])
    assert counted.count == view.count == 2
    assert a.tolist() == b.tolist() == [2.0] * 4


@pytest.mark.parametrize("settings, why", [
    (dict(sync="weights"), "allreduce_bucket_mib applies to sync grads; set sync grads or drop it"),
    (dict(hosts=2, sync="ps"), "allreduce_bucket_mib applies to sync grads; set sync grads or drop it"),
    (dict(allreduce_bucket_mib=-1.0), "allreduce_bucket_mib must be a finite number >= 0, got -1.0"),
])
def test_settings_that_cannot_take_buckets_are_refused(settings, why):
    with pytest.raises(UserError) as e:
        Config(**{"allreduce_bucket_mib": 1.0, **settings}).resolved()
    assert str(e.value) == why


def test_the_flag_refused_with_weights_is_one_line(capsys, tmp_path):
    assert main(["--sync", "weights", "--allreduce-bucket-mib", "4", "--logdir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err == "towers.train: error: --allreduce-bucket-mib applies to --sync grads; set --sync grads or drop it\n"
    assert not (tmp_path / "a").exists()
