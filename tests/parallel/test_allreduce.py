"""The real all-reduce code driven over NumPy buffers through the NCCL stand-in."""
import numpy as np
import pytest

from towers.parallel.allreduce import NcclAllReduce
from towers.parallel.reducers import DeviceMean, Hierarchical, make_reducer
from towers.nn.models import build_model
from towers.nn.replica import Replica
from towers.devices.placement import resolve


def replicas(n, seed=0):
    model = build_model("mlp", (5,), 3, hidden=4)
    out = []
    rng = np.random.default_rng(seed)
    for _ in range(n):
        r = Replica(model, np)
        r.grads[...] = rng.normal(size=model.size).astype(np.float32)
        out.append(r)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_grouped_nccl_average_in_place_over_host_buffers(standin, n):
    reps = replicas(n)
    for r in reps:
        standin.register(r.grads)
    expected = np.mean([r.grads.astype(np.float64) for r in reps], axis=0)
    ptrs = [r.grads.ctypes.data for r in reps]

    ar = standin.reducer(n)
    assert isinstance(ar, Hierarchical) and not ar.splittable
    ar.average([r.grads for r in reps])

    kinds = [c[0] for c in standin.calls]
    assert kinds == ["initAll", "groupStart"] + ["allReduce"] * n + ["groupEnd"]
    assert standin.calls[0] == ("initAll", list(range(n)))  # a list, as CuPy requires
    for rank, c in enumerate(standin.calls[2 : 2 + n]):
        _, r_id, send, recv, count, dtype, op, stream = c
        assert r_id == rank and send == recv == ptrs[rank]  # in place, on each replica's buffer
        assert count == reps[0].grads.size  # elements, not bytes
        assert dtype == standin.NCCL_FLOAT32 and op == standin.NCCL_AVG and stream == 0
    for r in reps:
        np.testing.assert_allclose(r.grads, expected, rtol=1e-6, atol=1e-7)
        # The named gradient views see the averaged values.
        np.testing.assert_array_equal(r.grad["layer1/weights"].ravel(), r.grads[: 5 * 4])
    assert all(np.array_equal(reps[0].grads, r.grads) for r in reps)
    ar.close()
    assert [c for c in standin.calls if c[0] == "destroy"] == [("destroy", i) for i in range(n)]


def test_uneven_groups_give_the_mean_over_all_towers(standin):
    # Towers 0,1 share a "GPU", tower 2 has one to itself: sum*scale on each
    # device, then NCCL AVG over 2 ranks, must still be the mean over 3 towers.
    reps = replicas(3, seed=5)
    for r in reps:
        standin.register(r.grads)
    expected = np.mean([r.grads.astype(np.float64) for r in reps], axis=0)
    ar = standin.reducer(3, groups=[[0, 1], [2]])
    ar.average([r.grads for r in reps])
    assert sum(c[0] == "allReduce" for c in standin.calls) == 2
    for r in reps:
        np.testing.assert_allclose(r.grads, expected, rtol=1e-5, atol=1e-6)
    assert np.array_equal(reps[0].grads, reps[1].grads)


def test_cpu_towers_without_nccl_take_the_on_device_mean():
    reps = replicas(4, seed=2)
    expected = np.mean([r.grads.astype(np.float64) for r in reps], axis=0)
    ar = make_reducer(resolve(4, "cpu"), [None] * 4)
    assert isinstance(ar, DeviceMean) and ar.splittable and not ar.noop
    ar.average([r.grads for r in reps])
    for r in reps:
        np.testing.assert_allclose(r.grads, expected, rtol=1e-5, atol=1e-6)
        assert np.array_equal(r.grads, reps[0].grads)


def test_bad_arguments_fail_before_group_start(standin):
    a, b = np.ones(10, np.float32), np.ones(12, np.float32)
    standin.register(a, b)
    nar = NcclAllReduce([0, 1], nccl=standin)
    with pytest.raises(ValueError, match="one size and dtype"):
        nar.average([a, b], [0, 0])
    with pytest.raises(ValueError, match="one size and dtype"):
        nar.average([a, np.ones(10, np.float64)], [0, 0])
    assert not any(c[0] == "groupStart" for c in standin.calls)


def test_standin_catches_a_count_in_bytes_and_calls_outside_a_group(standin):
    a, b = np.ones(8, np.float32), np.ones(8, np.float32)
    standin.register(a, b)
    comms = standin.NcclCommunicator.initAll([0, 1])
    standin.groupStart()
    try:
        for c, buf in zip(comms, (a, b)):
            c.allReduce(buf.ctypes.data, buf.ctypes.data, buf.nbytes, standin.NCCL_FLOAT32, standin.NCCL_SUM, 0)
        with pytest.raises(standin.NcclError, match="outside every registered buffer"):
            standin.groupEnd()
    finally:
        standin._group_depth = 0
    with pytest.raises(RuntimeError, match="block forever"):
        comms[0].allReduce(a.ctypes.data, a.ctypes.data, 8, standin.NCCL_FLOAT32, standin.NCCL_SUM, 0)
    with pytest.raises(ValueError):
        standin.NcclCommunicator.initAll((0, 1))


def test_distinct_devices_are_required_before_init(standin):
    from towers.errors import UserError

    with pytest.raises(UserError, match="distinct GPUs"):
        NcclAllReduce([0, 0], nccl=standin)
    assert standin.calls == []


def test_an_asynchronous_nccl_error_stops_the_run_with_one_line_not_a_hang(standin):
    """A rank whose collective failed (NCCL reports it asynchronously; on a GPU the all-reduce would then never
    finish): the next host sync point polls it, aborts the communicators and raises one TrainingError line."""
    from towers import Config, Trainer
    from towers.data.batches import BatchSource
    from towers.data.loading import load_dataset
    from towers.errors import TrainingError
    from tests.conftest import DIGITS

    cfg = Config(n_gpu=2, devices="cpu", hidden=32, batch_size=50, nccl_timeout=600.0)
    ds = load_dataset(str(DIGITS))
    tr = Trainer(cfg, dataset=ds, reducer=standin.reducer(2))
    try:
        for r in tr.executor.replicas:
            standin.register(r.grads)
        src = BatchSource(ds, 100, cfg.seed)
        tr.train_step(*src.next_batch())
        tr.synchronize()  # no error: the poll finds none
        assert ("check_async_error", 1) in standin.calls and not any(c[0] == "abort" for c in standin.calls)
        standin.fail_async(1, message="remote process exited")
        tr.train_step(*src.next_batch())
        with pytest.raises(TrainingError) as e:
            tr.synchronize()
        line = str(e.value)
        assert "\n" not in line and line.startswith("NCCL all-reduce failed on rank 1 (device 1): NcclError: "
                                                     "remote process exited; the run stops"), line
        assert [c for c in standin.calls if c[0] == "abort"] == [("abort", 0), ("abort", 1)]
    finally:
        tr.close()


def test_the_poll_is_off_by_default_until_a_gpu_run_checks_it(standin):
    """Without `nccl_timeout` a host sync point asks NCCL nothing (the streams are waited for as before)."""
    from towers import Config, Trainer
    from towers.data.batches import BatchSource
    from towers.data.loading import load_dataset
    from tests.conftest import DIGITS

    cfg = Config(n_gpu=2, devices="cpu", hidden=32, batch_size=50)
    assert cfg.nccl_timeout == 0
    ds = load_dataset(str(DIGITS))
    with Trainer(cfg, dataset=ds, reducer=standin.reducer(2)) as tr:
        for r in tr.executor.replicas:
            standin.register(r.grads)
        tr.train_step(*BatchSource(ds, 100, cfg.seed).next_batch())
        tr.synchronize()
    assert not any(c[0] == "check_async_error" for c in standin.calls)


def test_an_all_reduce_that_never_finishes_times_out_with_one_line(standin):
    import time

    from towers.errors import TrainingError

    a, b = np.ones(8, np.float32), np.ones(8, np.float32)
    standin.register(a, b)
    nar = NcclAllReduce([0, 1], nccl=standin, stream_done=lambda ptr: False)  # a stream whose work never ends
    nar.average([a, b], [11, 12])
    t0 = time.monotonic()
    with pytest.raises(TrainingError, match=r"^NCCL all-reduce did not finish within 0.05 s on devices \[0, 1\]"):
        nar.wait(timeout=0.05)
    assert time.monotonic() - t0 < 5
    assert [c for c in standin.calls if c[0] == "abort"] == [("abort", 0), ("abort", 1)]
    nar.close()  # aborted: nothing left to destroy
