"""Reliability: one live run per logdir, failing disks, logs across crashes, non-finite runs, small truths.

Runs the real command line in subprocesses (real processes holding locks, real
small filesystems, a real SIGKILL) on the digits data with a tiny MLP.  The disk
tests mount a tmpfs of a few kilobytes, which needs root; elsewhere they skip.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import numpy
import pytest

from tests import commands
from tests.conftest import DIGITS, REPO, cuda_count
from towers import Config, Dataset, Trainer, TrainingError, UserError
from towers.data.batches import BatchSource
from towers.data.loading import load_dataset
from towers.devices.placement import cupy_installed
from towers.files import atomic_save_npz
from towers.output.checkpoint import list_checkpoints, load_checkpoint

SMALL = ["--devices", "cpu", "--hidden", "16", "--batch-size", "50", "--quiet"]


def cli(*args, module="towers.train", env=None, timeout=60):
    return commands.run(module, *args, env=env, timeout=timeout)


def train(logdir, *args, **kw):
    return cli("--logdir", logdir, *SMALL, *args, **kw)


def only_line(p, code: int) -> str:
    """stderr is exactly one line, the error, and the exit status is ``code``."""
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("towers.train: error: "), p.stderr
    return lines[0]


def logged_steps(logdir) -> list[int]:
    return [json.loads(line)["step"] for line in (logdir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


# -- 1. one live run per logdir ------------------------------------------------------------


def test_a_second_run_on_a_live_logdir_fails_at_once_and_a_dead_runs_lock_does_not_block(tmp_path):
    logdir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "towers.train", "--logdir", str(logdir), *SMALL,
                              "--steps", "10000000", "--checkpoint-every", "0", "--summary-every", "0",
                              "--log-every", "100000"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (logdir / "metrics.jsonl").exists():  # the first run is past its start
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.02)
        before = sorted(os.listdir(logdir))
        second = train(logdir, "--steps", 5)  # summaries on: it would add an event file
        err = only_line(second, 2)
        assert f"(pid {first.pid}" in err and str(logdir) in err, err
        assert sorted(os.listdir(logdir)) == before  # it wrote nothing there
        assert first.poll() is None  # and the first run goes on
    finally:
        first.kill()
        first.wait()
    # The killed run's lock file is still there, but the kernel released its lock.
    p = train(logdir, "--steps", 5)
    assert p.returncode == 0, p.stderr


# -- 2. failing disks -----------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(path, size_kb: int):
    """A tmpfs of ``size_kb`` KiB mounted at ``path`` (skips where mounting is refused)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir()
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                           capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command")
    if p.returncode != 0:
        pytest.skip(f"mounting a tmpfs was refused: {p.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


def no_temporaries(logdir):
    assert not [n for n in os.listdir(logdir) if n.endswith(".tmp")]


def test_disk_full_at_a_checkpoint_is_one_line_and_keeps_the_last_complete_checkpoint(tmp_path):
    # 4 KiB pages: lock, metrics, index and its temporary, and 20 or 24 KiB per checkpoint (its
    # config holds the paths; its data fingerprint about 0.6 KiB) make 36-40 KiB at the first
    # checkpoint, 56-64 at the second.
    with tmpfs(tmp_path / "disk", 48) as disk:
        p = train(disk, "--steps", 40, "--checkpoint-every", 10, "--log-every", 5, "--summary-every", 0,
                  "--keep-checkpoints", 5)
        err = only_line(p, 1)
        assert "No space left on device" in err and "ckpt-00000020.npz" in err, err
        assert f"the last complete checkpoint is {disk / 'ckpt-00000010.npz'}" in err, err
        assert [s for s, _ in list_checkpoints(str(disk))] == [10]
        assert int(load_checkpoint(str(disk / "ckpt-00000010.npz"))["step"]) == 10
        no_temporaries(disk)


def test_disk_full_in_tensorboard_events_is_one_line(tmp_path):
    # Histograms every step fill the event file long before the end.
    with tmpfs(tmp_path / "disk", 64) as disk:
        p = train(disk, "--steps", 400, "--checkpoint-every", 0, "--summary-every", 1, "--log-every", 100)
        err = only_line(p, 1)
        assert "No space left on device" in err and "events.out.tfevents" in err, err
        assert "no checkpoint was written" in err, err


def test_disk_full_in_metrics_is_one_line(tmp_path):
    with tmpfs(tmp_path / "disk", 12) as disk:  # the lock and 8 KB of log lines
        p = train(disk, "--steps", 3000, "--checkpoint-every", 0, "--summary-every", 0, "--log-every", 1)
        err = only_line(p, 1)
        assert "No space left on device" in err and "metrics.jsonl" in err, err


def test_read_only_logdir_at_start_is_one_line_and_changes_nothing(tmp_path):
    with tmpfs(tmp_path / "disk", 256) as disk:
        assert train(disk, "--steps", 10, "--checkpoint-every", 5).returncode == 0
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        before = {n: (disk / n).read_bytes() for n in os.listdir(disk)}
        err = only_line(train(disk, "--steps", 20, "--checkpoint-every", 5, "--resume"), 1)
        assert "Read-only file system" in err and str(disk) in err, err
        assert {n: (disk / n).read_bytes() for n in os.listdir(disk)} == before
        # A logdir that cannot be created there: the same one line.
        err = only_line(train(disk / "new", "--steps", 5), 1)
        assert "Read-only file system" in err and str(disk / "new") in err, err


# -- 3. logs across a crash -----------------------------------------------------------------


KILLED = """
import os, signal, sys
from towers import Config, Trainer
from towers.run.extensions import Extension

class KillAt(Extension):  # SIGKILL the process at a chosen step: a crash, deterministically placed
    def due(self, step, last_step):
        return step == {kill}
    def __call__(self, run):
        os.kill(os.getpid(), signal.SIGKILL)

cfg = Config(devices="cpu", hidden=16, batch_size=50, quiet=True, steps=40, logdir=sys.argv[1],
             checkpoint_every=10, log_every=1, summary_every=1)
with Trainer(cfg) as t:
    t.fit(extensions=[KillAt()])
"""


def test_after_kill_9_and_resume_each_step_is_logged_once_and_tensorboard_keeps_the_checkpoint_step(tmp_path):
    logdir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", KILLED.format(kill=27), str(logdir)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert logged_steps(logdir)[-1] == 27 and list_checkpoints(str(logdir))[0][0] == 20
    p = train(logdir, "--steps", 30, "--resume", "--checkpoint-every", 10, "--log-every", 1, "--summary-every", 1)
    assert p.returncode == 0, p.stderr
    assert logged_steps(logdir) == list(range(1, 31))
    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    assert "test_accuracy" in records[-1] and records[-1]["step"] == 30

    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("loss")] == list(range(1, 31))
    # The checkpoint step's points survive the resume (the purge starts after it) ...
    assert [e.step for e in ea.Scalars("test_accuracy")] == [10, 20, 30]
    assert 20 in [e.step for e in ea.Histograms("layer1/weights")]
    # ... and every loss point is the one metrics.jsonl holds for that step.
    logged = {r["step"]: r["loss"] for r in records if "loss" in r}
    for e in ea.Scalars("loss"):
        assert e.value == pytest.approx(logged[e.step], rel=1e-6)


# -- 4. non-finite runs -----------------------------------------------------------------------


def float_digits():
    ds = load_dataset(str(DIGITS))
    return Dataset.from_arrays(ds.x.astype(numpy.float32) / 255, ds.y, ds.x_test.astype(numpy.float32) / 255,
                               ds.y_test)


def fit_with_nan_at(tmp_path, batch_step: int, log_every: int) -> str:
    """Train on data whose example in the batch of step ``batch_step`` is NaN; the error message."""
    cfg = Config(devices="cpu", hidden=16, batch_size=50, quiet=True, steps=20, log_every=log_every,
                 checkpoint_every=0, summary_every=0, logdir=str(tmp_path / "run"))
    with Trainer(cfg, dataset=float_digits()) as t:
        src = BatchSource(t.dataset, t.global_batch, cfg.seed)
        for _ in range(batch_step):
            idx = src.next_indices()
        # Poisoned after loading (the loader may refuse NaN): the run meets it mid-training.
        t.dataset.x[idx[3]] = numpy.nan
        with pytest.raises(TrainingError) as e:
            t.fit()
    return str(e.value)


def test_a_nan_in_the_input_batch_is_named_instead_of_blaming_the_learning_rate(tmp_path):
    err = fit_with_nan_at(tmp_path, batch_step=3, log_every=1)
    assert "step 3: the loss is nan" in err and "the input batch at step 3 holds NaN/inf" in err, err
    assert "Lower" not in err, err


def test_a_nan_met_between_loss_checks_is_traced_to_the_data(tmp_path):
    err = fit_with_nan_at(tmp_path, batch_step=2, log_every=5)
    assert "step 5: the loss is nan" in err and "data holds NaN/inf (example " in err, err
    assert "Lower" not in err, err


def test_an_input_too_large_for_float32_is_named_instead_of_blaming_the_learning_rate(tmp_path):
    # An example holding 3e38 made the loss inf, and the line said "Lower --lr".
    ds = float_digits()
    ds.x[7, 3, 3] = 3e38
    cfg = Config(devices="cpu", hidden=16, batch_size=50, quiet=True, steps=100, log_every=10, checkpoint_every=0,
                 summary_every=0, logdir=str(tmp_path / "run"))
    with Trainer(cfg, dataset=ds) as t:
        with pytest.raises(TrainingError) as e:
            t.fit()
    err = str(e.value)
    assert "the loss is " in err and "data ranges from 0 to 3e+38; training stopped" in err, err
    assert "scale data to a small range" in err and "Lower" not in err, err


def test_the_named_last_good_checkpoint_has_finite_weights(tmp_path):
    """A checkpoint with non-finite weights on disk is never resumed from, nor named as good."""
    assert train(tmp_path, "--steps", 10, "--checkpoint-every", 5).returncode == 0
    path = tmp_path / "ckpt-00000010.npz"
    arrays = dict(numpy.load(path))
    arrays["ema/layer1/weights"] = numpy.full_like(arrays["ema/layer1/weights"], numpy.nan)
    atomic_save_npz(str(path), arrays)  # e.g. written by another tool, or damaged
    p = train(tmp_path, "--steps", 40, "--resume", "--checkpoint-every", 5, "--lr", "1e30", "--log-every", 1)
    assert p.returncode == 1, p.stderr
    err = next(line for line in p.stderr.splitlines() if line.startswith("towers.train: error: "))
    assert "ckpt-00000010.npz holds non-finite values (ema/layer1/weights)" in p.stdout + p.stderr, p.stderr
    named = err.split("the last good checkpoint is ")[1].split(")")[0]
    assert named.endswith("ckpt-00000005.npz"), err
    ck = load_checkpoint(named)
    assert all(numpy.isfinite(v).all() for k, v in ck.items() if k.startswith(("params/", "ema/")))


# -- 5. small truths ------------------------------------------------------------------------


@pytest.mark.skipif(cuda_count() > 9, reason="needs fewer than 10 GPUs")
def test_a_gpu_id_that_does_not_exist_is_an_error_even_without_gpus(tmp_path):
    p = cli("--devices", "9", "--quiet", "--steps", 2, "--logdir", tmp_path / "out")
    err = only_line(p, 2)
    count = cuda_count()
    if count == 0 and not cupy_installed():  # a plain `pip install .`: the GPU extras are what is missing
        assert "--devices 9 names a GPU, but CuPy is not installed" in err and "towers[cuda12]" in err, err
    else:
        assert "GPU 9 does not exist" in err, err
        assert ("no CUDA device" in err if count == 0 else f"only {count}" in err), err
    assert not (tmp_path / "out").exists()


def test_weights_sync_with_the_default_checkpoint_interval(tmp_path):
    p = train(tmp_path, "--n-gpu", 2, "--sync", "weights", "--average-every", 7, "--steps", 14, "--summary-every", 0)
    assert p.returncode == 0, p.stderr
    ck = load_checkpoint(str(tmp_path / "ckpt-00000014.npz"))
    assert ck["config"]["checkpoint_every"] == 1001  # 1000 rounded up to a multiple of 7


def test_a_model_function_returning_no_layers_is_one_line(tmp_path):
    (tmp_path / "user_models.py").write_text(textwrap.dedent("""
        def as_dict(input_shape, num_classes):
            return {"hidden": 128}
    """))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    p = cli("--model", "user_models:as_dict", "--devices", "cpu", "--logdir", tmp_path / "out", env=env)
    err = only_line(p, 2)
    assert "--model user_models:as_dict" in err and "gave dict" in err and "Sequential" in err, err
    assert not (tmp_path / "out").exists()


# -- found by probing the command line as a user ----------------------------------------------


def test_sigterm_stops_training_with_one_line_and_status_143(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "towers.train", "--logdir", str(tmp_path), *SMALL,
                          "--steps", "100000", "--checkpoint-every", "20", "--log-every", "20"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list_checkpoints(str(tmp_path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143, err
    assert err.strip().splitlines() == ["towers.train: terminated (SIGTERM); the last checkpoint is kept"]
    assert load_checkpoint(list_checkpoints(str(tmp_path))[0][1])["step"] >= 20


def test_resume_past_steps_is_refused(tmp_path):
    assert train(tmp_path, "--steps", 10).returncode == 0
    err = only_line(train(tmp_path, "--steps", 5, "--resume"), 2)
    assert "is at step 10, past --steps 5" in err


def test_a_logdir_inside_a_file_and_a_module_that_is_no_function_are_user_mistakes(tmp_path):
    (tmp_path / "f").write_text("x")
    assert "is inside a file" in only_line(train(tmp_path / "f" / "sub", "--steps", 2), 2)
    assert "is a module, not a function" in only_line(train(tmp_path / "r", "--steps", 2, "--model", "os:path"), 2)


def test_a_model_too_big_for_memory_is_one_line():
    with pytest.raises(UserError, match="not enough memory for 1 replicas"):
        Trainer(Config(devices="cpu", hidden=10 ** 9, quiet=True))


def test_nan_loss_from_tfrecord_float_features_stops_and_names_the_example(tmp_path):
    """The NaN scan reads TFRecord data in chunks (it once looped forever on such data)."""
    from towers.data.tfrecord.framing import TFRecordWriter
    from towers.data.tfrecord.proto import SequenceExample

    with numpy.load(DIGITS) as z:
        x, y = z["x"][:300].reshape(300, -1).astype(numpy.float32), z["y"][:300]
    x[123, 5] = numpy.nan
    with open(tmp_path / "d.tfrecords", "wb") as f, TFRecordWriter(f) as w:  # x: a float feature of 64 values
        for xi, yi in zip(x, y):
            ex = SequenceExample()
            ex.context.feature["x"].float_list.value.extend(xi.tolist())
            ex.context.feature["y"].int64_list.value.append(int(yi))
            w.write(ex.SerializeToString())
    p = train(tmp_path / "run", "--data", tmp_path / "d.tfrecords", "--x-key", "x", "--y-key", "y",
              "--steps", "20", "--log-every", "20", "--summary-every", "0", "--input-workers", "0", timeout=120)
    assert p.returncode == 1, p.stderr
    err = p.stderr.strip().splitlines()[-1]  # (after the "indexing" note)
    assert "NaN/inf" in err and ("example 123" in err or "input batch" in err), err
    assert "Traceback" not in p.stderr


def test_keep_one_checkpoint_on_a_nearly_full_disk_replaces_it(tmp_path):
    # The disk of the test above takes one checkpoint but not two: with
    # --keep-checkpoints 1 the second write must make room by pruning the
    # first (it would be pruned right after anyway), not fail.
    with tmpfs(tmp_path / "disk", 48) as disk:
        p = train(disk, "--steps", 30, "--checkpoint-every", 10, "--log-every", 5, "--summary-every", 0,
                  "--keep-checkpoints", 1)
        assert p.returncode == 0, p.stderr
        assert [s for s, _ in list_checkpoints(str(disk))] == [30]
        assert int(load_checkpoint(str(disk / "ckpt-00000030.npz"))["step"]) == 30
        no_temporaries(disk)
