"""Several hosts on a real local Ray (no mocks): equivalences, buffers, async, a killed host, resume.

One Ray instance (``local_ray`` in conftest) serves every in-process test;
the command-line tests start their own, as a user's run does.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy
import pytest

import towers
from towers.nn.layers import Layer, Param
from towers.output import checkpoint

pytest.importorskip("ray")
SMALL = dict(devices="cpu", hidden=32, log_every=10, quiet=True, summary_every=0)


def cluster(**kw):
    return towers.Trainer(towers.Config(**{**SMALL, **kw}))


def weights_after(trainer, n):
    """Both weight sets after ``n`` steps of the trainer's own batches (one host or several: the same call)."""
    trainer.run_steps(n)
    return trainer.get_weights(), trainer.get_weights(ema=True)


def one_host(n, model=None, **kw):
    with towers.Trainer(towers.Config(**{**SMALL, "n_gpu": 2, "steps": n, **kw}), model=model) as t:
        return weights_after(t, n) + (t.get_gradients(),)


def assert_same(a, b, rtol=0.0):
    for got, want in zip(a, b):
        assert got.keys() == want.keys()
        for k in want:
            numpy.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=1e-7 if rtol else 0, err_msg=k)


def test_two_hosts_match_one_host_two_towers(local_ray):
    """sync grads: 2 hosts x 1 tower give the bits of 1 host x 2 towers (sync ps: the server's test below)."""
    want = one_host(3)
    with cluster(hosts=2, n_gpu=1, steps=3) as t:
        assert t.global_batch == 200 and t.n_towers == 2 and type(t.executor).__name__ == "ClusterExecutor"
        got = weights_after(t, 3) + (t.get_gradients(),)  # the last step's mean gradient, host 0's
        assert t.check_replicas()
    assert_same(got, want)


def test_epochs_give_every_host_the_step_count_of_one_host(local_ray):
    """Each host derives the steps of `epochs` from its share (the run's examples per update) as the driver does:
    under a cosine schedule, which ends at them, two hosts give one host's weights."""
    kw = dict(epochs=1, lr_schedule="cosine")
    with towers.Trainer(towers.Config(**SMALL, n_gpu=2, **kw)) as t:
        assert t.cfg.steps == 8  # 1438 / 200, rounded up
        want = weights_after(t, 8)
    with cluster(hosts=2, n_gpu=1, **kw) as t:
        assert t.cfg.steps == 8
        got = weights_after(t, 8)
    assert_same(got, want)


def test_hosts_on_one_machine_split_its_cores_for_blas(local_ray, three_hosts):
    """CPU hosts sharing a machine each take their share of its cores for BLAS (each took every core: 2 hosts x 1
    tower ran at 0.16x of 1 host x 2 towers on 2 cores), so 2 hosts x 1 tower run what 1 host x 2 towers runs,
    bit for bit also on a product whose sums OpenBLAS orders by its thread count (784 x 500); hosts on other
    machines keep theirs; a `blas_threads` setting is every host's (the run of ``three_hosts`` sets it)."""
    from towers.cluster.driver import core_shares
    from towers.devices.cpu_threads import cpu_count

    rng = numpy.random.default_rng(0)
    data = towers.Dataset.from_arrays(rng.integers(0, 256, (400, 28, 28), dtype=numpy.uint8),
                                      rng.integers(0, 10, 400))
    mnist_mlp = {**SMALL, "hidden": 500, "steps": 3}
    share = max(1, (cpu_count() - 1) // 2)  # the machine's cores less one, split between the hosts
    with towers.Trainer(towers.Config(**mnist_mlp, hosts=2, n_gpu=1), dataset=data) as t:
        assert t.executor.host_blas_threads() == [share, share]
        got = weights_after(t, 3)
    with towers.Trainer(towers.Config(**mnist_mlp, n_gpu=2), dataset=data) as t:
        assert t.executor.blas_threads == share  # each tower thread's
        want = weights_after(t, 3)
    assert_same(got, want)
    assert three_hosts["blas_threads"] == [3, 3, 3]
    hosts = [{"cpu": True, "node_id": "a", "cores": 8}, {"cpu": True, "node_id": "b", "cores": 4},
             {"cpu": True, "node_id": "a", "cores": 8}, {"cpu": False, "node_id": "a", "cores": 8},
             {"cpu": True, "node_id": "c", "cores": 2}, {"cpu": True, "node_id": "c", "cores": 2},
             {"cpu": True, "node_id": "c", "cores": 2}]
    assert core_shares(hosts) == [3, 0, 3, 0, 1, 1, 1]  # 0: one host's rule (alone, or a GPU host)


def buffered_model():
    """An MLP after a layer with a buffer that every forward pass moves (made here: Ray ships it by value)."""

    class Centered(Layer):
        """x minus a running mean of x (the buffer); backward passes dy through."""

        scope = "center"

        def build(self, in_shape):
            return [Param("mean", tuple(in_shape), trainable=False)], tuple(in_shape)

        def forward(self, p, x, ws):
            p["mean"][...] = 0.9 * p["mean"] + 0.1 * x.mean(axis=0)
            return x - p["mean"]

        def backward(self, p, g, dy, ws, need_dx):
            return dy if need_dx else None

    return [towers.Flatten(), Centered(), towers.Dense("layer1", 16), towers.ReLU(), towers.Dense("layer2", 10)]


@pytest.mark.parametrize("sync", ["weights", "ps"])
def test_model_buffers_are_averaged_across_hosts(local_ray, sync):
    """Weights mode averages buffers with the weights; the server averages the hosts' buffers.

    With plain SGD a server that averages the hosts' gradients and buffers every
    update is one host in weights mode averaging every step (up to rounding).
    """
    kw = {"sync": "weights", "average_every": 2}
    with towers.ClusterTrainer(towers.Config(**{**SMALL, "hosts": 2, "n_gpu": 1, "steps": 4, **kw, "sync": sync,
                                                 "average_every": 2 if sync == "weights" else 1}),
                               model=buffered_model()) as tr:
        got = weights_after(tr, 4)
        assert "center/mean" in got[0]
        assert tr.check_replicas()
        state = tr.state_dict()
    want = one_host(4, model=buffered_model(), **{**kw, "average_every": 2 if sync == "weights" else 1})[:2]
    assert numpy.abs(got[0]["center/mean"]).max() > 0  # the buffer moved
    assert_same(got, want, rtol=1e-5)
    numpy.testing.assert_array_equal(state["buffers/center/mean"], got[0]["center/mean"])


def test_async_converges_and_reports_staleness(local_ray, tmp_path, capsys):
    # An async update is one host's gradient (100 examples), half of the synchronous run's global batch, so
    # half its learning rate (0.4, not the mlp's 0.8): at 0.8 the run ends at 0.93-0.96 EMA accuracy but now
    # and then, with the same staleness, at 0.65 (the order in which the server meets the hosts' gradients is
    # the machine's timing); at 0.4 twelve runs gave 0.942-0.947.
    with cluster(hosts=2, n_gpu=1, sync="async", steps=300, hidden=64, lr=0.4, logdir=str(tmp_path)) as t:
        result = t.fit()
    assert result["step"] == 300 and result["test_accuracy_ema"] > 0.9
    assert result["staleness_max"] >= 1 and 0 < result["staleness_mean"] <= result["staleness_max"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("done: 300 steps") and "gradient staleness mean" in last
    # What ran: both hosts' towers (an update is one of them), the server applying one host's gradient each; no
    # all-reduce (it said "on 1 tower ... 1.00 all-reduces/step").
    assert " on 2 towers (2 hosts x 1 tower: cpu | cpu;" in last, last
    assert "async sync, 1.00 host gradients/update to the parameter server;" in last and "all-reduce" not in last
    assert checkpoint.list_checkpoints(str(tmp_path))[0][0] == 300
    # sync ps's line (every update the mean of both hosts' gradients): the run of the test of the server's
    # evaluation says it.


def test_killed_host_stops_run_and_resume_continues(local_ray, tmp_path):
    logdir = str(tmp_path / "run")
    t = cluster(hosts=2, n_gpu=1, steps=10**6, checkpoint_every=20, keep_checkpoints=50, logdir=logdir)
    errors = []

    def fit():
        try:
            t.fit()
        except Exception as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    thread = threading.Thread(target=fit)
    thread.start()
    deadline = time.time() + 60
    while not checkpoint.list_checkpoints(logdir) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(t.executor.host_pids()[1], signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive()
    t.close()
    assert len(errors) == 1 and isinstance(errors[0], towers.TrainingError), errors
    message = str(errors[0])
    assert "\n" not in message and message.startswith("host 1 (") and "died at step" in message
    last = checkpoint.list_checkpoints(logdir)[0][0]
    with cluster(hosts=2, n_gpu=1, steps=last + 5, checkpoint_every=20, logdir=logdir, resume=True) as t2:
        result = t2.fit()
    assert result["step"] == last + 5


def test_resume_is_exact_and_a_checkpoint_resumes_on_one_host(local_ray, tmp_path, notices):
    """4 steps, then 4 more from the checkpoint == 8 steps at once; then one host continues it.

    The 8 steps at once are one host's with both towers (2 hosts x 1 tower give its bits: the equivalence
    tests above), which needs no host actors."""
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    with towers.Trainer(towers.Config(**SMALL, n_gpu=2, steps=8, logdir=whole)) as t:
        t.fit()
    with cluster(hosts=2, n_gpu=1, steps=4, logdir=parts) as t:
        t.fit()
    with cluster(hosts=2, n_gpu=1, steps=8, logdir=parts, resume=True) as t:
        t.fit()
    a, b = numpy.load(os.path.join(whole, "final.npz")), numpy.load(os.path.join(parts, "final.npz"))
    for k in a.files:
        numpy.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # `hosts` 1 given: a setting not given would be the checkpoint's (2 hosts).
    with towers.Trainer(towers.Config(**{**SMALL, "n_gpu": 1, "hosts": 1, "steps": 10, "logdir": parts,
                                         "resume": True})) as t1:
        assert t1.fit()["step"] == 10
    assert any("written by 2 tower(s)" in line for line in notices)  # the note about another tower count (a notice)


@pytest.fixture(scope="module")
def three_hosts(local_ray) -> dict:
    """One cluster of 3 hosts x 2 towers on the host-memory NCCL stand-in, with `blas_threads` 3 (each test
    reads what it needs, one start of 3 host actors): each host's NCCL ranks and BLAS threads.  Closed before
    any test reads it (its hosts would hold 3 of the session Ray's 4 CPUs)."""
    cfg = towers.Config(**{**SMALL, "hosts": 3, "n_gpu": 2, "blas_threads": 3})
    with towers.ClusterTrainer(cfg, nccl="tests.nccl_standin") as t:
        return {"ranks": local_ray.get([h.nccl_ranks.remote() for h in t.executor.hosts]),
                "blas_threads": t.executor.host_blas_threads()}


def test_nccl_id_and_ranks_through_ray(three_hosts):
    """The GPU path's id exchange and rank layout, against the host-memory stand-in."""
    ranks = three_hosts["ranks"]
    # 3 hosts, each 2 CPU towers on one device (one group, one rank): ranks numbered host by host.
    assert [[r for _, r, _ in host] for host in ranks] == [[0], [1], [2]]
    assert {size for host in ranks for size, _, _ in host} == {3}
    ids = {uid for host in ranks for _, _, uid in host}
    assert len(ids) == 1 and ids != {bytes(128)}


# Each schedule, warm-up on top of the exponential one (a run of 2 hosts apiece: the seconds of 4 host starts).
SCHEDULES = {"exponential after warm-up": {"lr_decay": 0.5, "warmup_steps": 3},
             "piecewise": {"lr_boundaries": "2,4", "lr_values": "0.5,0.2,0.1"}, "cosine": {"lr_schedule": "cosine"}}


def logged(logdir, capsys) -> tuple[list[float], list[str]]:
    """The learning rates ``metrics.jsonl`` recorded, and the settings and log lines printed."""
    import json

    with open(os.path.join(logdir, "metrics.jsonl")) as f:
        rates = [r["lr"] for r in map(json.loads, f) if "lr" in r]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("step ", "settings"))]
    return rates, [line.split(" (")[0] for line in lines]  # the figures after the loss are timings


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_clusters_logged_learning_rate_is_one_hosts_under_each_schedule(local_ray, tmp_path, capsys, schedule):
    """The rate a cluster logs (log lines, metrics.jsonl) comes from the same schedule as one host's."""
    kw = dict(SMALL, steps=6, log_every=1, quiet=False, **SCHEDULES[schedule])
    with towers.Trainer(towers.Config(**kw, n_gpu=2, logdir=str(tmp_path / "one"))) as t:
        t.fit()
    want = logged(tmp_path / "one", capsys)
    with towers.Trainer(towers.Config(**kw, hosts=2, n_gpu=1, logdir=str(tmp_path / "two"))) as t:
        t.fit()
        assert [t.lr_at(k) for k in range(6)] == want[0]
    got = logged(tmp_path / "two", capsys)
    assert len(want[0]) == 6 and len(set(want[0])) > 1  # every step logged; the rate moved
    assert got == want


def api_calls(tmp_path, **kw) -> dict:
    """The same public calls on any Trainer: fit, weights, state, a step on a given batch, load, evaluate,
    predict."""
    with towers.Trainer(towers.Config(**{**SMALL, "steps": 4, "logdir": str(tmp_path), **kw})) as t:
        out = {"fit": t.fit()["step"], "weights": t.get_weights(), "ema": t.get_weights(ema=True),
               "state": t.state_dict(), "evaluate": t.evaluate(), "lr": t.lr(), "predict": t.predict(),
               "predict_given": t.predict(t.dataset.x[:50], ema=False, batch_size=7)}
        x, y = t.dataset.x[:t.global_batch], t.dataset.y[:t.global_batch]
        losses = t.train_step(x, y, want_loss=True)
        out.update(stepped=t.get_weights(), step=t.step, losses=[float(v) for v in losses])
        t.load_state_dict(out["state"])
        out.update(loaded=t.get_weights(), loaded_step=t.step,
                   evaluate_given=t.evaluate(ema=False, x=t.dataset.x[:50], y=t.dataset.y[:50]))
    return out


def test_one_trainer_api_over_both_executors(local_ray, tmp_path):
    one = api_calls(tmp_path / "one", n_gpu=2)
    two = api_calls(tmp_path / "two", hosts=2, n_gpu=1)
    assert one["fit"] == two["fit"] == 4 and one["step"] == two["step"] == 5
    assert one["loaded_step"] == two["loaded_step"] == 4
    for key in ("evaluate", "evaluate_given", "losses", "lr"):
        assert one[key] == two[key], key
    for key in ("predict", "predict_given"):
        numpy.testing.assert_array_equal(one[key], two[key], err_msg=key)
    assert two["predict"].shape == (359, 10) and two["predict_given"].dtype == numpy.float32
    assert_same([two[k] for k in ("weights", "ema", "stepped", "loaded")],
                [one[k] for k in ("weights", "ema", "stepped", "loaded")])
    assert_same([two["loaded"]], [two["weights"]])
    assert one["state"].keys() == two["state"].keys()
    for k in one["state"]:
        if k != "config":  # the settings recorded differ in `hosts` and `n_gpu`
            numpy.testing.assert_array_equal(one["state"][k], two["state"][k], err_msg=k)


def every_k_across_hosts(k: int):
    """A sync mode of the test's own (local SGD across hosts): each host's towers average their gradients every
    step among themselves; every ``k`` steps the hosts average their weights through a shared-memory board.

    Made here, as a ``HostKeeping`` subclass: Ray ships it to the hosts by value.
    """
    from towers.cluster.keeping import HostKeeping

    class EveryK(HostKeeping):
        host_sync = "grads"  # each host's own towers
        mean = None  # on a host: its side of the cross-host mean

        def wire(self, cluster):
            from towers.cluster.reduce import board_spec

            self.board = cluster.board(*board_spec(len(self.towers), cluster.model.size + cluster.model.buffer_size))

        def reducer(self, rank, nccl):
            from towers.cluster.board import Board
            from towers.cluster.reduce import BoardMean

            self.mean = BoardMean(Board.attach(self.board), rank, self.towers)
            return None  # the host's own mean among its towers

        def host_steps(self, executor, n, want_loss, *segment):
            losses, done = None, 0
            while done < n:
                m = min(n - done, k - executor.step % k)  # up to the next average
                losses = executor.run_steps(m, want_loss and done + m == n)[0]
                done += m
                if executor.step % k == 0:
                    weights = executor.get_weights()
                    flat = numpy.concatenate([numpy.ravel(v) for v in weights.values()])
                    self.mean.average([flat])  # every host gets the same bytes
                    offsets = numpy.cumsum([0] + [v.size for v in weights.values()])
                    executor.set_weights({name: flat[lo:hi].reshape(v.shape) for (name, v), lo, hi
                                          in zip(weights.items(), offsets, offsets[1:])})
            return losses

        def check(self, cluster):
            return cluster.step % k == 0 and super().check(cluster)  # hosts agree right after an average

        def close_host(self):
            self.mean.close()

    return EveryK


def test_a_sync_mode_of_ones_own_is_one_registry_entry(local_ray, monkeypatch):
    """A HostKeeping and one MODES entry make a sync mode the driver and the hosts run without knowing it: with
    plain SGD, hosts averaging their weights every 3 steps are one host's towers in weights mode (K=3)."""
    from towers.parallel.sync import MODES, Mode

    monkeypatch.setitem(MODES, "every-3", Mode(every_k_across_hosts(3), several="averages hosts' weights"))
    with pytest.raises(towers.UserError, match="sync every-3 averages hosts' weights: set hosts 2 or more"):
        cluster(sync="every-3")
    with cluster(hosts=2, n_gpu=1, sync="every-3", steps=6) as t:
        t.run_steps(4)
        assert t.check_replicas() is False  # between averages the hosts differ
        got = weights_after(t, 2)
        assert t.check_replicas()
    want = one_host(6, sync="weights", average_every=3)
    assert_same(got[:1], want[:1], rtol=1e-6)
    differ = one_host(6)[0]
    assert not numpy.allclose(got[0]["layer1/weights"], differ["layer1/weights"], rtol=1e-4, atol=0)


def test_two_hosts_average_gradient_buckets_during_backward_with_the_same_bits(local_ray):
    """Each host's side of the cross-host mean runs bucket by bucket on a thread of its own while backward goes
    on (``towers.parallel.overlap``); the hosts meet on every bucket in the same order and end with the bits of
    one call."""
    want = one_host(3)
    with cluster(hosts=2, n_gpu=1, steps=3, allreduce_bucket_mib=1e-9) as t:
        got = weights_after(t, 3) + (t.get_gradients(),)
        assert t.check_replicas()
        assert t.all_reduces == 3 * 4  # two buckets (a layer each) of two ranges (weights, biases), 3 steps
    assert_same(got, want)


def test_the_parameter_server_trains_one_hosts_weights_and_evaluates_with_the_runs_input_scale(local_ray, capsys):
    """sync ps: the server applies the mean of both hosts' gradients every update, which gives one host's two
    towers' weights, EMA and gradient (up to rounding); it holds the run's weights and evaluates and predicts
    with them, scaling uint8 examples by the run's `input_scale` as a host does (it took the default 1/255,
    whatever the run said: `1` here, at a rate that keeps 0..255 inputs finite); its summary says what ran
    (every update the mean of both hosts' gradients, against async's one)."""
    kw = dict(input_scale="1", lr=0.001)
    want = one_host(3, **kw)
    with cluster(hosts=2, n_gpu=1, sync="ps", steps=3, **kw) as t:
        assert t.global_batch == 200 and t.n_towers == 2 and type(t.executor).__name__ == "ClusterExecutor"
        t.fit()
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert " on 2 towers (2 hosts x 1 tower: cpu | cpu)" in last and "ps sync, 2.00 host gradients/update" in last
        got = t.get_weights(), t.get_weights(ema=True), t.get_gradients()  # the last mean gradient, host 0's
        assert t.check_replicas()
        with pytest.raises(towers.UserError, match="use run_steps"):  # no step on a batch given by the driver
            t.train_step(t.dataset.x[:200], t.dataset.y[:200])
        x = t.dataset.x[:20]
        scored = t.evaluate(ema=False), t.predict(x, ema=False)
    assert all(numpy.isfinite(v).all() for v in got[0].values())
    assert_same(got, want, rtol=1e-6)
    with towers.Trainer(towers.Config(**{**SMALL, "n_gpu": 1, "steps": 3, **kw})) as one:
        one.set_weights(got[0])
        expected = one.evaluate(ema=False), one.predict(x, ema=False)
    assert scored[0] == expected[0]
    numpy.testing.assert_array_equal(scored[1], expected[1])
