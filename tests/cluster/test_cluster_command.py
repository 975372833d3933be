"""``python -m towers.train --hosts 2`` as a user runs it: each test starts the command (with its own Ray, or
joined to the tests' running one).

The cluster's failure cases: an address where no Ray listens, SIGTERM, a dead
host, a killed driver; and the command and the library giving the same weights.
"""
from __future__ import annotations

import os
import re
import signal
import socketserver
import subprocess
import sys
import threading
import time

import numpy
import pytest

from tests.conftest import REPO, run_cli
from towers.cluster.watchdog import children_of

pytest.importorskip("ray")
SMALL = ["--devices", "cpu", "--hidden", "16", "--quiet", "--summary-every", "0"]


def start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "towers.train", "--hosts", "2", *SMALL, *args],
                            cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def alive(pids) -> set[int]:
    return {p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in _state(p)}


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except OSError:
        return "zombie"


def host_actors(pid: int) -> list[int]:
    """The host actors' processes among ``pid``'s descendants (Ray names them after the class)."""
    found = []
    for p in sorted(children_of({pid})):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"ray::Host" in f.read():
                    found.append(p)
        except OSError:
            continue
    return found


def test_command_and_library_give_the_same_weights(tmp_path, local_ray):
    """``towers.Trainer(Config(hosts=2))`` runs on Ray and trains what ``--hosts 2 --ray-address`` trains,
    the command joining a running Ray (the other tests here start their own)."""
    import towers

    address = local_ray.get_runtime_context().gcs_address
    p = run_cli("--hosts", "2", *SMALL, "--steps", "12", "--ray-address", address, "--logdir", str(tmp_path / "cli"))
    assert p.returncode == 0, p.stderr
    assert "blas" not in p.stderr.lower(), p.stderr  # each host's BLAS takes its share by default: no notice
    cfg = towers.Config(hosts=2, devices="cpu", hidden=16, quiet=True, summary_every=0, steps=12,
                        logdir=str(tmp_path / "api"))
    with towers.Trainer(cfg) as t:
        t.fit()
    a, b = numpy.load(tmp_path / "cli" / "final.npz"), numpy.load(tmp_path / "api" / "final.npz")
    assert a.files == b.files
    for k in a.files:
        numpy.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow
def test_an_address_without_ray_is_one_line_within_seconds(tmp_path):
    """A closed port, and a port where some other TCP server listens (Ray would hang there for good)."""

    class Silent(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(1024)  # reads the handshake, answers nothing, closes
            time.sleep(0.5)

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Silent) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        for address in ("127.0.0.1:1", f"127.0.0.1:{server.server_address[1]}"):
            logdir = tmp_path / address.replace(":", "_")
            t0 = time.monotonic()
            p = run_cli("--hosts", "2", *SMALL, "--ray-address", address, "--logdir", str(logdir), timeout=60)
            assert p.returncode == 2, p.stderr
            assert p.stderr.count("\n") == 1 and f"--ray-address {address}" in p.stderr, p.stderr
            assert time.monotonic() - t0 < 30 and not logdir.exists()
        server.shutdown()


def test_a_real_ray_passes_the_address_probe(local_ray):
    """The probe must not refuse Ray itself: its GCS answers the HTTP/2 handshake."""
    from towers.cluster.session import check_ray_address

    check_ray_address(local_ray.get_runtime_context().gcs_address)


def test_sigterm_ends_a_run_of_two_hosts_with_one_line(tmp_path, local_ray):
    """On a Ray the command joined (the tests' own, which saves a Ray start): its hosts end with the driver."""
    address = local_ray.get_runtime_context().gcs_address
    proc = start("--steps", "1000000", "--checkpoint-every", "50", "--logdir", str(tmp_path), "--ray-address", address)
    wait_for(str(tmp_path / "checkpoint"), proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["towers.train: terminated (SIGTERM); the last checkpoint is kept"], err


def test_a_dead_host_is_one_line(tmp_path, local_ray):
    """A host dies: on a Ray the command joined (the tests' own: its actors are this process's descendants)."""
    address = local_ray.get_runtime_context().gcs_address
    before = set(host_actors(os.getpid()))
    proc = start("--steps", "1000000", "--checkpoint-every", "50", "--logdir", str(tmp_path / "a"),
                 "--ray-address", address)
    wait_for(str(tmp_path / "a" / "checkpoint"), proc)
    hosts = [p for p in host_actors(os.getpid()) if p not in before]
    assert len(hosts) == 2
    os.kill(hosts[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("towers.train: error: host ") and "died at step" in lines[0], err
    assert f"pid {hosts[1]})" in lines[0]  # the host killed, by its process
    # Ray's "(raylet) A worker died or was killed ..." (in colour) came on stdout before: stdout keeps towers' lines
    assert "\x1b" not in err + out and "(raylet)" not in out and "worker died" not in out, out


@pytest.mark.slow
def test_a_killed_driver_takes_the_ray_it_started_with_it(tmp_path):
    """The driver is killed: a Ray it started itself goes with it (no ``local_ray``: it runs beside the Ray group)."""
    proc = start("--steps", "1000000", "--checkpoint-every", "50", "--logdir", str(tmp_path / "b"))
    wait_for(str(tmp_path / "b" / "checkpoint"), proc)
    ray_processes = children_of({proc.pid})
    assert host_actors(proc.pid)
    proc.kill()
    proc.communicate()
    deadline = time.time() + 20
    while alive(ray_processes) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive(ray_processes), [open(f"/proc/{p}/cmdline", "rb").read()[:80] for p in alive(ray_processes)]


def test_one_host_never_imports_ray(tmp_path):
    code = ("import sys, towers, towers.train as t; t.main(['--devices', 'cpu', '--steps', '2', '--quiet', "
            f"'--hidden', '8', '--logdir', {str(tmp_path)!r}]); assert 'ray' not in sys.modules, 'ray imported'; "
            "assert towers.ClusterTrainer is towers.Trainer")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr


SCRIPT = """
import sys
sys.path.insert(0, {repo!r})  # towers from the checkout, not installed
import ray
import towers

def towers_file():
    try:
        return __import__("towers").__file__
    except ImportError as e:
        return repr(e)

def run(logdir):
    cfg = towers.Config(hosts=2, devices="cpu", hidden=16, steps=4, quiet=True, summary_every=0, data={data!r},
                        logdir=logdir)
    with towers.Trainer(cfg) as t:
        t.fit()
        print("workers import", ray.get(ray.remote(towers_file).remote()))

if __name__ == "__main__":
    run({logdir!r} + "/a")  # the Trainer starts Ray
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    run({logdir!r} + "/b")  # on the script's own Ray
"""


# What a process outside the checkout imports as towers, as the script's towers_file says it.
PLAIN = "try:\n    print(__import__('towers').__file__)\nexcept ImportError as e:\n    print(repr(e))"


@pytest.mark.slow
def test_a_script_outside_the_checkout_runs_hosts_that_import_its_towers(tmp_path):
    """A script in another folder that puts the checkout on sys.path: the host actors import the same towers
    (they could not import it at all: "host 0 died at step 0", no checkpoint behind it).  The script starts its
    own Rays (no ``local_ray``: it runs beside the Ray group)."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    script = folder / "two_hosts.py"
    script.write_text(SCRIPT.format(repo=str(REPO), data=str(REPO / "data" / "digits.npz"),
                                    logdir=str(tmp_path / "run")))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, str(script)], cwd=folder, env=env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr
    # The run's own Ray imports the driver's towers in every worker; on the script's Ray the job's workers
    # import what any process there does: no towers, or an installed one (the quick start installs the checkout,
    # editable); the hosts import the driver's either way (their own runtime_env).
    plain = subprocess.run([sys.executable, "-c", PLAIN], cwd=folder, env=env, capture_output=True, text=True,
                           timeout=60).stdout.strip()
    assert [line for line in p.stdout.splitlines() if line.startswith("workers")] == [
        f"workers import {REPO / 'towers' / '__init__.py'}", f"workers import {plain}"], p.stdout
    assert (tmp_path / "run" / "a" / "final.npz").exists() and (tmp_path / "run" / "b" / "final.npz").exists()


def test_a_host_that_cannot_start_says_why(local_ray):
    """An actor that cannot start says why, in its exception's own words: a host whose __init__ fails (here: an
    NCCL stand-in module it cannot import) did not die mid-run."""
    import towers
    from towers.errors import TrainingError

    cfg = towers.Config(hosts=2, devices="cpu", hidden=16, steps=4, quiet=True, summary_every=0)
    with pytest.raises(TrainingError) as failed:
        towers.Trainer(cfg, nccl="no_such_nccl_module")
    assert re.fullmatch(r"host [01] could not start: ModuleNotFoundError: No module named 'no_such_nccl_module'",
                        str(failed.value)), str(failed.value)
