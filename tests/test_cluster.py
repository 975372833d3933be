"""Several hosts on a real local Ray (no mocks): equivalences, async, a killed host, a bad address.

One Ray instance (4 logical CPUs, quiet) serves every test of this module.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy
import pytest

import towers
from towers.output import checkpoint
from towers.parallel.allreduce import TowerAllReduce, world_layout
from towers.devices.placement import CPU, Placement

ray = pytest.importorskip("ray")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(devices="cpu", hidden=32, log_every=10, quiet=True, summary_every=0)


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def cluster(**kw):
    from towers.cluster.driver import ClusterTrainer

    return ClusterTrainer(towers.Config(**{**SMALL, **kw}))


def run_steps(trainer, n):
    for _ in range(n):
        trainer.train_step(*trainer.source.next_batch())
    return trainer.get_weights(), trainer.get_weights(ema=True)


def one_host(n, **kw):
    with towers.Trainer(towers.Config(**{**SMALL, "n_gpu": 2, **kw})) as t:
        return run_steps(t, n)


def assert_close(a, b, rtol=1e-5):
    for k in a:
        numpy.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("sync", ["grads", "ps"])
def test_two_hosts_match_one_host_two_towers(local_ray, sync):
    want = one_host(3)
    with cluster(hosts=2, n_gpu=1, sync=sync) as t:
        assert t.global_batch == 200 and t.n_towers == 2
        got = run_steps(t, 3)
        assert t.check_replicas()
    for a, b in zip(got, want):
        assert_close(a, b)


def test_weights_mode_across_hosts_matches_one_host(local_ray):
    want = one_host(4, sync="weights", average_every=2)
    with cluster(hosts=2, n_gpu=1, sync="weights", average_every=2) as t:
        got = run_steps(t, 4)
    for a, b in zip(got, want):
        assert_close(a, b)


def test_async_converges_and_reports_staleness(local_ray, tmp_path, capsys):
    with cluster(hosts=2, n_gpu=1, sync="async", steps=300, hidden=64, logdir=str(tmp_path)) as t:
        result = t.fit()
    assert result["step"] == 300
    assert result["test_accuracy_ema"] > 0.9
    assert result["staleness_max"] >= 1 and 0 < result["staleness_mean"] <= result["staleness_max"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("done: 300 steps") and "gradient staleness mean" in last


def test_two_hosts_read_tfrecords_with_the_runs_decode(local_ray, tmp_path):
    """`decode`, `on_error` and `input_workers` reach the driver's loader as they reach one host's."""
    from towers.data.tfrecord import from_npz

    rng = numpy.random.default_rng(0)
    x, y = rng.integers(0, 255, (120, 4, 4), dtype=numpy.uint8), rng.integers(0, 3, 120)
    from_npz.write_examples(tmp_path / "d.tfrecords", x, y, "none")
    data = dict(data=str(tmp_path / "d.tfrecords"), x_key="image_raw", y_key="label", decode="image_raw:uint8:4,4",
                input_workers=0, batch_size=10)
    want = one_host(2, **data)
    with cluster(hosts=2, n_gpu=1, **data) as t:
        assert t.dataset.example_shape == (4, 4) and t.dataset.x.workers == 0
        got = run_steps(t, 2)
    for a, b in zip(got, want):
        assert_close(a, b)


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
    os.kill(t.host_pids()[1], signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive()
    t.close()
    assert len(errors) == 1 and isinstance(errors[0], towers.TrainingError)
    message = str(errors[0])
    assert "\n" not in message and message.startswith("host 1 (") and "died at step" in message
    last = checkpoint.list_checkpoints(logdir)[0][0]
    with cluster(hosts=2, n_gpu=1, steps=last + 5, checkpoint_every=20, logdir=logdir, resume=True) as t2:
        result = t2.fit()
    assert result["step"] == last + 5


def test_checkpoint_of_two_hosts_resumes_on_one(local_ray, tmp_path, capsys):
    logdir = str(tmp_path)
    with cluster(hosts=2, n_gpu=1, steps=4, logdir=logdir) as t:
        t.fit()
    with towers.Trainer(towers.Config(**{**SMALL, "n_gpu": 1, "steps": 6, "logdir": logdir, "resume": True})) as t1:
        assert t1.fit()["step"] == 6
    assert "written by 2 tower(s)" in capsys.readouterr().err  # the note about another tower count


def test_nccl_id_and_ranks_through_ray(local_ray):
    """The GPU path's id exchange and rank layout, against the host-memory stand-in."""
    from towers.cluster.driver import ClusterTrainer

    cfg = towers.Config(**{**SMALL, "hosts": 2, "n_gpu": 2})
    with ClusterTrainer(cfg, nccl="tests.nccl_standin") as t:
        ranks = ray.get([h.nccl_ranks.remote() for h in t._hosts])
    assert [[r for _, r, _ in host] for host in ranks] == [[0, 1], [2, 3]]
    assert {size for host in ranks for size, _, _ in host} == {4}
    ids = {uid for host in ranks for _, _, uid in host}
    assert len(ids) == 1 and ids != {bytes(128)}


def test_world_all_reduce_is_the_mean_over_every_hosts_towers(standin):
    nccl = standin
    """Two 'hosts' (2 and 1 towers) in one process: NCCL's average over 3 ranks gives the 3-tower mean."""
    layout = world_layout([2, 1], [2, 1], nccl.get_unique_id())
    hosts = [TowerAllReduce(Placement(towers=[CPU] * n), nccl=nccl, world=w) for n, w in zip([2, 1], layout)]
    rng = numpy.random.default_rng(0)
    bufs = [[rng.standard_normal(7).astype(numpy.float32) for _ in range(n)] for n in (2, 1)]
    nccl.register(*[b for host in bufs for b in host])
    want = numpy.mean([b for host in bufs for b in host], axis=0)
    nccl.groupStart()  # one process plays both hosts: their collectives in one group
    for ar, b in zip(hosts, bufs):
        ar.average(b)
    nccl.groupEnd()
    for b in [b for host in bufs for b in host]:
        numpy.testing.assert_allclose(b, want, rtol=1e-6)


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "towers.train", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def test_unreachable_ray_address_is_one_line(tmp_path):
    logdir = tmp_path / "out"
    p = run_cli("--hosts", "2", "--devices", "cpu", "--ray-address", "127.0.0.1:1", "--logdir", str(logdir),
                timeout=60)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "cannot reach a Ray cluster at --ray-address 127.0.0.1:1" in p.stderr
    assert not logdir.exists()


def test_one_host_never_imports_ray(tmp_path):
    code = ("import sys, towers.train as t; t.main(['--devices', 'cpu', '--steps', '2', '--quiet', "
            f"'--hidden', '8', '--logdir', {str(tmp_path)!r}]); assert 'ray' not in sys.modules, 'ray imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
