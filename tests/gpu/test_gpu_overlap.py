"""The gradient buckets on GPUs: each bucket's all-reduce on a second stream, ordered by events (skipped without CUDA).

Two towers sharing GPU 0 average through the device mean (one kernel per range); two GPUs or more through NCCL.
The bucketed run must give the one call's bits, and the streams' order is checked by holding one stream back with a
spinning kernel: an all-reduce that did not wait for backward, or an update that did not wait for the all-reduce,
would read unfinished gradients.
"""
import numpy as np
import pytest

from tests.conftest import DIGITS, cuda_count, cupy_performance_warnings_fail
from towers import Config, Trainer
from towers.arrays import to_host
from towers.data.loading import load_dataset
from towers.errors import UserError

pytestmark = [pytest.mark.gpu, *cupy_performance_warnings_fail()]

PER_LAYER, SOME, ONE_BUCKET = 1e-9, 0.002, 1e6  # the mlp (64-64-10): a bucket per layer; layer2, then layer1; one


def spin(stream, cycles: int) -> None:
    """Queue a kernel that spins ``cycles`` clock cycles on ``stream``: the work queued behind it waits."""
    import cupy

    kernel = cupy.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) { }
    }""", "spin")
    kernel((1,), (1,), (np.int64(cycles),), stream=stream)


def train(mib, steps=4, n=2, devices="0", hold=None, **settings):
    """Every replica's weights, the EMA, the all-reduce count and the overlap of a run on the GPU(s).

    ``hold``: "compute" spins each tower's stream before its compute, "all-reduce" the all-reduce stream before
    each bucket.
    """
    cfg = Config(n_gpu=n, devices=devices, hidden=64, batch_size=60, momentum=0.9, l2=1e-3,
                 allreduce_bucket_mib=mib, **settings)
    with Trainer(cfg, dataset=load_dataset(str(DIGITS))) as tr:
        engine = tr.executor.engine
        overlap = engine.keeper.overlap
        if hold == "compute":
            for t in engine.towers:
                t.compute = _held(t.compute, lambda t=t: spin(t.stream, 20_000_000))
        elif hold == "all-reduce":
            overlap.issue = _held(overlap.issue, lambda: [spin(s, 50_000_000) for s in set(overlap.streams)])
        tr.run_steps(steps)
        tr.synchronize()
        params = [to_host(r.params) for r in tr.executor.replicas]
        return params, to_host(tr.executor.ema.shadow), tr.all_reduces, overlap


def _held(fn, first):
    def call(*args, **kwargs):
        first()
        return fn(*args, **kwargs)
    return call


def same_bits(run, base):
    params, ema, *_ = run
    assert all(np.array_equal(p, params[0]) for p in params)  # replicas identical
    assert np.array_equal(params[0], base[0][0]) and np.array_equal(ema, base[1])


def test_two_towers_sharing_the_gpu_average_each_bucket_on_a_second_stream_with_the_same_bits():
    base = train(0)
    assert base[3] is None and base[2] == 4
    for mib, calls in ((PER_LAYER, 4), (SOME, 4), (ONE_BUCKET, 1)):
        run = train(mib)
        same_bits(run, base)
        overlap = run[3]
        assert run[2] == 4 * calls
        towers = overlap.towers
        # One all-reduce stream for the GPU, not the towers' own.
        assert overlap.streams[0] is overlap.streams[1] and overlap.streams[0] is not towers[0].stream


@pytest.mark.parametrize("hold", ["compute", "all-reduce"])
def test_the_all_reduce_waits_for_backward_and_the_update_for_the_all_reduce(hold):
    """``compute``: backward runs late, so an all-reduce that did not wait for its event would average the last
    step's gradients; ``all-reduce``: the averages run late, so an update that did not wait would apply a tower's
    own gradient."""
    same_bits(train(PER_LAYER, hold=hold), train(0))


def test_lenet5_with_accumulation_and_gradients_rounded_for_the_all_reduce():
    settings = dict(model="lenet5", optimizer="sgd", accumulate=2, allreduce_dtype="bf16", steps=2)
    same_bits(train(0.5, **settings), train(0, **settings))


@pytest.mark.skipif(cuda_count() < 2, reason="needs at least 2 GPUs")
def test_nccl_over_two_gpus_averages_the_buckets_with_the_same_bits():
    # Two ranks: NCCL's sum of two is the same whatever the message size.
    same_bits(train(PER_LAYER, devices="0,1"), train(0, devices="0,1"))


def test_sync_bn_on_gpus_with_buckets_is_refused():
    with pytest.raises(UserError, match="allreduce_bucket_mib.*sync_bn.*on GPUs"):
        train(1.0, steps=0, sync_bn=True)
