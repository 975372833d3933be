"""Concurrent CPU towers, the phase profiler and the scaling-efficiency report."""
from __future__ import annotations

import time

import numpy
import pytest

from towers.errors import UserError
from towers.devices.cpu_threads import TowerThreads, chunks
from towers.data.dataset import Dataset
from towers import Config, Trainer
from towers.train import main, run


def _data(n=400, seed=0):
    rng = numpy.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 6, 6), dtype=numpy.uint8)
    y = (x.reshape(n, -1)[:, :3].sum(1) % 3).astype(numpy.int32)
    return Dataset(x, y, 3)


def _train(cpu_towers, steps=15, model="mlp", momentum=0.0, sync="grads", finish=False):
    ds = _data()
    cfg = Config(n_gpu=2, devices="cpu", cpu_towers=cpu_towers, batch_size=8, lr=0.1, hidden=16,
                 momentum=momentum, model=model, profile=True, sync=sync,
                 average_every=5 if sync == "weights" else 1, optimizer="sgd")
    tr = Trainer(cfg, dataset=ds)
    try:
        for s in range(steps):
            sl = slice(16 * s % 384, 16 * s % 384 + 16)
            # (a loss asked for with tower threads and no barrier joins them: not before ``finish``)
            losses = tr.train_step(ds.x[sl], ds.y[sl], want_loss=s == steps - 1 and not finish)
        if finish:
            tr.finish()  # weights mode: the last average, which must join the tower threads itself
        tr.synchronize()
        ex = tr.executor
        return [r.params.copy() for r in ex.replicas], ex.ema.shadow.copy(), losses, ex.timer
    finally:
        tr.close()


def _start_late(monkeypatch):
    """Tower threads 1.. start each step 5 ms after the caller's."""
    start = TowerThreads._call

    def late(self, fn, i):
        if i > 0:
            time.sleep(0.005)
        start(self, fn, i)

    monkeypatch.setattr(TowerThreads, "_call", late)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_threaded_towers_equal_serial_towers_bit_for_bit(momentum):
    p_t, e_t, l_t, _ = _train("threads", momentum=momentum)
    p_s, e_s, l_s, _ = _train("serial", momentum=momentum)
    for a, b in zip(p_t, p_s):
        numpy.testing.assert_array_equal(a, b)
    numpy.testing.assert_array_equal(p_t[0], p_t[1])  # replicas stay identical
    numpy.testing.assert_array_equal(e_t, e_s)
    assert [float(v) for v in l_t] == [float(v) for v in l_s]
    assert not numpy.array_equal(e_t, p_t[0])  # the EMA moved, but not onto the weights


def test_weights_mode_tower_threads_that_start_late_still_train_on_their_own_step(monkeypatch):
    """Weights mode has no barrier: the caller may start the next step before a tower
    thread has begun this one.  Each thread must still see its own step's batch."""
    p_s, e_s, _, _ = _train("serial", sync="weights", steps=13)
    _start_late(monkeypatch)
    p_t, e_t, _, _ = _train("threads", sync="weights", steps=13)
    for a, b in zip(p_t, p_s):
        numpy.testing.assert_array_equal(a, b)
    numpy.testing.assert_array_equal(e_t, e_s)
    assert not numpy.array_equal(p_t[0], p_t[1])  # steps 11-13: each tower on its own


def test_weights_mode_finish_averages_after_late_tower_threads_are_done(monkeypatch):
    """``finish`` right after a step (no ``synchronize`` between): its last average reads every tower's
    buffers, so it must wait for a tower thread still updating, as the averages every K steps do."""
    p_s, e_s, _, _ = _train("serial", sync="weights", steps=13, finish=True)
    _start_late(monkeypatch)
    p_t, e_t, _, _ = _train("threads", sync="weights", steps=13, finish=True)
    for a, b in zip(p_t, p_s):
        numpy.testing.assert_array_equal(a, b)
    numpy.testing.assert_array_equal(p_t[0], p_t[1])  # averaged at the end
    numpy.testing.assert_array_equal(e_t, e_s)


def test_profile_reports_every_phase_per_tower():
    *_, timer = _train("threads", model="lenet5", steps=3)
    text = timer.report(16)
    for phase in ("stage", "forward", "backward", "barrier", "all-reduce", "update+EMA"):
        assert phase in text
    assert "tower 1" in text and "examples/sec" in text


def test_tower_threads_reraise_and_recover():
    pool = TowerThreads(2)
    try:
        def bad(i):
            pool.barrier.wait()
            if i == 1:
                raise RuntimeError("tower 1 failed")
        with pytest.raises(RuntimeError, match="tower 1 failed"):  # from run or from wait
            pool.run(bad)
            pool.wait()
        seen = []
        pool.run(lambda i: seen.append(i))  # the pool still works afterwards
        pool.wait()
        assert sorted(seen) == [0, 1]
    finally:
        pool.close()


def test_tower_zero_error_is_raised_not_the_barrier_it_broke():
    """Tower 0 runs on the caller's thread (Ctrl-C lands there): its own error must come
    out of run(), not the BrokenBarrierError it causes in the threads waiting for it."""
    pool = TowerThreads(3)
    try:
        def bad(i):
            if i == 0:
                raise KeyboardInterrupt
            pool.barrier.wait()
        with pytest.raises(KeyboardInterrupt):
            pool.run(bad)
        seen = []
        pool.run(lambda i: (pool.barrier.wait(), seen.append(i)))  # the barrier works again
        pool.wait()
        assert sorted(seen) == [0, 1, 2]
    finally:
        pool.close()


def test_chunks_cover_exactly():
    parts = chunks(10, 3)
    assert [(p.start, p.stop) for p in parts] == [(0, 3), (3, 6), (6, 10)]


def test_scaling_efficiency_is_opt_in(tmp_path, capsys):
    rc = main(["--n-gpu", "2", "--steps", "30", "--quiet", "--profile", "--logdir", str(tmp_path / "a")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "profile: ms per step" in out
    last = [l for l in out.splitlines() if l.startswith("done:")][-1]
    assert "scaling efficiency" not in last  # no 1-tower run unless asked for
    rc = main(["--n-gpu", "2", "--steps", "30", "--quiet", "--measure-scaling", "--logdir", str(tmp_path / "b")])
    assert rc == 0
    last = [l for l in capsys.readouterr().out.splitlines() if l.startswith("done:")][-1]
    assert "scaling efficiency" in last and "1 tower:" in last


def test_bad_cpu_towers_flag():
    with pytest.raises(UserError, match="cpu_towers"):
        run(Config(cpu_towers="fibers"))


def test_blas_threads_leave_a_core_to_the_rest_of_the_machine(monkeypatch):
    from towers.devices import cpu_threads

    # cores: (a tower alone, 2 towers in threads, 2 towers serial)
    for cores, want in {1: (1, 1, 1), 2: (1, 1, 2), 4: (3, 1, 4), 16: (15, 7, 16)}.items():
        monkeypatch.setattr(cpu_threads, "cpu_count", lambda c=cores: c)
        got = (cpu_threads.blas_threads(1), cpu_threads.blas_threads(2), cpu_threads.blas_threads(2, serial=True))
        assert got == want, cores
    # a cluster host's share, which core_shares took from its machine's cores less one, is split as it is
    assert [cpu_threads.blas_threads(1, share=3), cpu_threads.blas_threads(2, share=3),
            cpu_threads.blas_threads(2, serial=True, share=3)] == [3, 1, 3]


def test_one_cpu_tower_leaves_a_core_to_the_rest_of_the_machine():
    # A tower alone took every core for BLAS: beside one busy process on 2 cores, its products waited for the
    # thread that process held (LeNet-5, 20 steps: 3.5x the time of one thread; README, Performance on the CPU).
    from threadpoolctl import threadpool_info

    from towers.devices.cpu_threads import cpu_count

    want = max(1, cpu_count() - 1)
    with Trainer(Config(devices="cpu", hidden=8, steps=1), dataset=_data()) as t:
        assert t.executor.blas_threads == want
        assert {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"} == {want}


def test_input_workers_default_to_spare_cores(monkeypatch):
    from towers.devices import cpu_threads

    monkeypatch.setattr(cpu_threads, "cpu_count", lambda: 2)
    assert cpu_threads.input_workers(None, cpu_towers=2) == 0  # both cores run towers
    assert cpu_threads.input_workers(2, cpu_towers=2) == 2  # a setting wins, up to the cores (capped above)
    monkeypatch.setattr(cpu_threads, "cpu_count", lambda: 16)
    assert cpu_threads.input_workers(None, cpu_towers=0) == 4  # GPU towers: spare cores, at most 4
    assert cpu_threads.input_workers(None, cpu_towers=13) == 2
