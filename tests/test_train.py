"""The trainer end to end, on the CPU (and through the NCCL stand-in)."""
import json
import re

import numpy as np
import pytest

from tests.conftest import DIGITS, cuda_count, run_cli
from towers.data.batches import BatchSource
from towers.data.loading import load_dataset
from towers.devices.placement import cupy_installed
from towers import Config, Trainer
from towers.train import run


def final(logdir):
    with np.load(logdir / "final.npz") as z:
        return {k: z[k] for k in z.files}


def rel_diff(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def test_n_towers_times_b_equals_one_tower_times_n_b(tmp_path):
    """N x B and 1 x N*B see the same examples, so after 20 steps they agree to rounding."""
    common = dict(devices="cpu", steps=20, hidden=64, quiet=True, log_every=10)
    runs = {}
    for n, b in [(1, 120), (2, 60), (4, 30)]:
        logdir = tmp_path / f"n{n}"
        run(Config(n_gpu=n, batch_size=b, logdir=str(logdir), **common))
        runs[n] = final(logdir)
    ref = runs[1]
    assert int(ref["step"]) == 20
    for n in (2, 4):
        for key in ref:
            if key.startswith(("params/", "ema/")):
                assert rel_diff(runs[n][key], ref[key]) < 1e-5, (n, key)
    # ... and training moved the weights (the comparison is not vacuous).
    assert rel_diff(ref["params/layer1/weights"], ref["ema/layer1/weights"]) > 1e-4


def trainer(n, reducer=None, hidden=32, batch=50):
    cfg = Config(n_gpu=n, devices="cpu", hidden=hidden, batch_size=batch, momentum=0.9)
    ds = load_dataset(str(DIGITS))
    return cfg, ds, Trainer(cfg, dataset=ds, reducer=reducer)


def drive(cfg, ds, tr, steps):
    src = BatchSource(ds, cfg.batch_size * len(tr.executor.replicas), cfg.seed)
    for _ in range(steps):
        tr.train_step(*src.next_batch())
    tr.synchronize()  # concurrent CPU towers may still be finishing the last update


def test_nccl_path_through_the_standin_matches_the_on_device_mean(standin):
    cfg, ds, tr = trainer(2, reducer=standin.reducer(2))
    for r in tr.executor.replicas:
        standin.register(r.grads)
    assert not tr.executor.engine.threaded  # NCCL ranks are driven by one thread
    drive(cfg, ds, tr, 15)
    assert sum(c[0] == "groupEnd" for c in standin.calls) == 15  # one all-reduce per step
    cfg2, ds2, ref = trainer(2)
    drive(cfg2, ds2, ref, 15)
    for a, b in zip(tr.executor.replicas, ref.executor.replicas):
        np.testing.assert_allclose(a.params, b.params, rtol=1e-6, atol=1e-7)
    assert np.array_equal(tr.executor.replicas[0].params, tr.executor.replicas[1].params)


def test_replicas_stay_bit_identical_and_the_ema_follows(standin):
    # Through the NCCL stand-in the towers keep their own weights (plain CPU towers share one buffer).
    cfg, ds, tr = trainer(3, reducer=standin.reducer(3), batch=40)
    for r in tr.executor.replicas:
        standin.register(r.grads)
    drive(cfg, ds, tr, 30)
    p = [r.params for r in tr.executor.replicas]
    assert all(np.array_equal(p[0], q) for q in p[1:])
    v = [o.velocity for o in tr.executor.optimizers]
    assert all(np.array_equal(v[0], w) for w in v[1:])
    opts = tr.executor.optimizers
    assert opts[0].ema is tr.executor.ema and all(o.ema is None for o in opts[1:])
    assert 0 < rel_diff(tr.executor.ema.shadow, p[0]) < 0.5


@pytest.mark.slow
def test_default_command_trains_on_embedded_data(tmp_path):
    """`python -m towers.train --n-gpu 2` as in the quick start (plus a logdir)."""
    res = run_cli("--n-gpu", "2", "--logdir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    if cuda_count() == 0:
        why = ("no CUDA device found" if cupy_installed() else
               "CuPy is not installed (towers[cuda12] or towers[cuda13] for GPUs)")
        assert f"soft placement: {why}, running 2 towers on the CPU with NumPy" in res.stderr
    assert "step 100, loss = " in res.stdout and "examples/sec, " in res.stdout
    per_tower = re.search(r"\(([\d.]+) examples/sec, ([\d.]+) per tower; ", res.stdout)  # images/s per GPU
    assert per_tower and float(per_tower[2]) == pytest.approx(float(per_tower[1]) / 2, abs=0.06)
    done = re.search(r"training ([\d.]+) examples/sec, ([\d.]+) per tower on 2 towers", res.stdout)
    assert done and float(done[2]) == pytest.approx(float(done[1]) / 2, abs=0.06)
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "loss" in m] == list(range(100, 2001, 100))
    assert set(lines[0]) == {"step", "loss", "train_accuracy", "lr", "examples_per_sec"}
    assert [m["step"] for m in lines if "test_accuracy" in m] == [1000, 2000]  # at the checkpoint, and the end
    assert lines[-1]["test_accuracy_ema"] >= 0.95, lines[-1]
    assert f"{lines[-1]['test_accuracy_ema']:.4f} (EMA weights)" in res.stdout
    f = final(tmp_path)
    assert set(f) == {"step"} | {f"{p}/layer{i}/{w}" for p in ("params", "ema") for i in (1, 2)
                                 for w in ("weights", "biases")}
    assert f["params/layer1/weights"].dtype == np.float32 and f["step"].dtype == np.int64
    assert f["params/layer1/weights"].shape == (64, 500)


def one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.skipif(cuda_count() >= 4, reason="needs fewer than 4 GPUs")
def test_no_soft_placement_is_a_clear_error_and_writes_nothing(tmp_path):
    res = run_cli("--n-gpu", "4", "--no-soft-placement", "--logdir", str(tmp_path / "out"))
    one_line_error(res, "asked for", "--no-soft-placement")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--batch-size", "ten"], ["invalid int value"]),
        (["--frobnicate"], ["unrecognized arguments"]),
        (["--devices", "0,0"], ["names GPU 0 twice"]),
        (["--data", "missing.npz"], ["missing.npz does not exist"]),
        (["--batch-size", "5000"], ["larger than the dataset"]),
        (["--model", "nope"], ["--model 'nope' is unknown"]),
        (["--steps", "0"], ["--steps must be an integer >= 1"]),
        # Per-image standardization, then (x/255 - mean) / std on top: mean -2, std 0.016.
        (["--augment", "tf-cifar10", "--normalize", "0.5,0.25"], ["--augment tf-cifar10", "drop --normalize"]),
    ],
)
def test_user_mistakes_get_one_line_errors(tmp_path, args, needles):
    placement = [] if "--devices" in args else ["--devices", "cpu"]
    res = run_cli(*args, *placement, "--quiet", "--logdir", str(tmp_path / "out"))
    one_line_error(res, *needles)
    assert not (tmp_path / "out").exists()


def test_logdir_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "out").write_text("not a directory")
    res = run_cli("--devices", "cpu", "--steps", "3", "--quiet", "--logdir", str(tmp_path / "out"))
    one_line_error(res, "exists and is not a directory")
    assert (tmp_path / "out").read_text() == "not a directory"


def test_log_placement_table(tmp_path):
    res = run_cli("--devices", "cpu", "--n-gpu", "2", "--steps", "5", "--log-placement", "--quiet",
                  "--logdir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    for text in ("tower 0", "tower 1", "EMA", "input parsing", "reducer", "on-device mean on cpu (2 towers)"):
        assert text in res.stdout


def test_a_loss_that_does_not_move_is_said_on_the_log_line(tmp_path):
    common = ["--devices", "cpu", "--hidden", "8", "--steps", "400", "--summary-every", "0"]
    res = run_cli(*common, "--lr", "1e-9", "--logdir", str(tmp_path / "stuck"))
    assert res.returncode == 0, res.stderr
    lines = {ln.split(",")[0]: ln for ln in res.stdout.splitlines() if ln.startswith("step ")}
    assert "still at chance level" in lines["step 400"] and "--lr" in lines["step 400"]
    assert "chance level" not in lines["step 200"]  # not before STUCK_STEPS
    res = run_cli(*common, "--logdir", str(tmp_path / "moving"))
    assert res.returncode == 0 and "chance level" not in res.stdout


@pytest.mark.slow
def test_a_converged_run_is_not_told_its_loss_has_stopped_moving(tmp_path):
    # Logged every 1000 steps, the digits MLP's loss barely changes between its
    # two lines (it has converged, ~97%): that is no reason to lower the rate;
    # nor is a resumed run's first line.
    common = ["--devices", "cpu", "--n-gpu", "2", "--log-every", "1000", "--summary-every", "0",
              "--logdir", str(tmp_path / "a")]
    res = run_cli(*common, "--steps", "2000")
    assert res.returncode == 0, res.stderr
    assert "chance level" not in res.stdout and "lower --lr" not in res.stdout
    res = run_cli(*common, "--steps", "3000", "--resume")
    assert res.returncode == 0, res.stderr
    assert "chance level" not in res.stdout and "lower --lr" not in res.stdout


def test_help_says_what_no_soft_placement_does():
    res = run_cli("--help")
    assert res.returncode == 0
    text = " ".join(res.stdout.split())  # argparse wraps lines
    assert "--no-soft-placement fail instead of bending an impossible placement" in text


def test_a_run_without_test_data_says_which_flags_give_it(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.random((60, 4), dtype=np.float32), y=rng.integers(0, 3, 60))
    res = run_cli("--data", str(tmp_path / "d.npz"), "--devices", "cpu", "--batch-size", "10", "--steps", "2",
                  "--quiet", "--logdir", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    assert "no test data (x_test/y_test in --data, or --test-data): test accuracy skipped" in res.stdout
