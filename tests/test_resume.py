"""Resume and the run's lifecycle: a resume remembers the run (``towers.config.resume_settings``), a Trainer
built with ``resume`` holds its checkpoint's state, and what a continuation that differs says."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

import towers
from towers import Config, Trainer, UserError
from towers.config import resume_settings
from towers.output.checkpoint import list_checkpoints, load_checkpoint
from towers.train import main, parse_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--hidden", "16", "--batch-size", "50", "--quiet", "--summary-every", "0"]


def rgb(path: Path, n: int = 96) -> str:
    """Small 8x8x3 images (so ResNet-20 and --augment cifar apply) as an npz with test data."""
    rng = numpy.random.default_rng(0)
    x = rng.integers(0, 256, size=(n, 8, 8, 3), dtype=numpy.uint8)
    y = (x[:, :4].mean(axis=(1, 2, 3)) > x[:, 4:].mean(axis=(1, 2, 3))).astype(numpy.int64)
    numpy.savez(path, x=x, y=y, x_test=x[:32], y_test=y[:32])
    return str(path)


def interrupted_at(logdir: Path, step: int) -> None:
    """The logdir as a run killed right after its checkpoint of ``step`` leaves it."""
    for s, p in list_checkpoints(str(logdir)):
        if s > step:
            os.unlink(p)
    (logdir / "final.npz").unlink()


def test_a_resume_with_no_flags_continues_a_resnet_run_to_its_own_target_bit_for_bit(tmp_path, capsys):
    """Before: `--resume` alone refused the missing --model, then the data, then --augment; without --steps it
    trained to 2,000 steps; a forgotten --n-gpu or --batch-size was a note."""
    data = rgb(tmp_path / "rgb.npz")
    run = tmp_path / "run"
    flags = ["--model", "resnet20", "--data", data, "--augment", "cifar", "--n-gpu", "2", "--batch-size", "4",
             "--momentum", "0.9", "--lr-schedule", "cosine", "--steps", "6", "--checkpoint-every", "3",
             "--quiet", "--summary-every", "0", "--input-workers", "0"]
    assert main([*flags, "--logdir", str(run)]) == 0
    whole = (run / "final.npz").read_bytes()
    interrupted_at(run, 3)
    capsys.readouterr()
    assert main(["--logdir", str(run), "--resume"]) == 0
    out, err = capsys.readouterr()
    assert "ckpt-00000003.npz: step 3" in out and "done: 3 steps (to step 6)" in out, out
    assert "note:" not in err, err
    assert (run / "final.npz").read_bytes() == whole
    # The checkpoint of the resumed run holds the same settings as the uninterrupted run's did.
    assert load_checkpoint(str(run / "ckpt-00000006.npz"))["config"]["augment"] == "cifar"


def test_a_resume_takes_what_is_given_and_derives_again_what_follows_it(tmp_path, capsys):
    """A flag given overrides the checkpoint's setting, with the notes of a change; a setting derived from it
    (the learning rate from the optimizer) is derived again, not kept; `--steps` extends the run."""
    run = tmp_path / "run"
    assert main([*SMALL, "--n-gpu", "2", "--steps", "4", "--lr", "0.3", "--logdir", str(run)]) == 0
    capsys.readouterr()
    assert main(["--logdir", str(run), "--resume", "--steps", "6", "--optimizer", "adam"]) == 0
    out, err = capsys.readouterr()
    assert "done: 2 steps (to step 6)" in out, out
    config = load_checkpoint(str(run / "ckpt-00000006.npz"))["config"]
    assert (config["n_gpu"], config["hidden"], config["batch_size"]) == (2, 16, 50)  # the checkpoint's
    assert (config["optimizer"], config["lr"], config["momentum"]) == ("adam", 0.001, None)  # adam's own
    assert "--optimizer sgd -> adam" in err and "written by" not in err, err
    # Given the checkpoint's own value, a setting changes nothing, and is no note.
    assert main(["--logdir", str(run), "--resume", "--steps", "7", "--batch-size", "50"]) == 0
    assert "note:" not in capsys.readouterr().err
    # The same in Python: the fields passed are given, the others the checkpoint's.
    cfg = Config(logdir=str(run), resume=True, steps=8)
    assert cfg.given == {"logdir", "resume", "steps"}
    assert parse_config(["--logdir", "x", "--quiet"]).given == {"logdir", "quiet"}
    with Trainer(cfg) as t:
        assert (t.cfg.n_gpu, t.cfg.hidden, t.cfg.optimizer, t.cfg.steps) == (2, 16, "adam", 8)


def test_a_setting_given_derives_again_only_what_follows_it_directly(tmp_path):
    """Before: `--lr 0.5` on a run of `--lr-schedule piecewise --lr-boundaries 2,4` derived `lr_values` again,
    then (in turn) `lr_schedule` and `lr_boundaries`: the run went on with the model's exponential decay; and
    `--lr-schedule cosine` on a run of `--lr 0.3` took the model's 0.8 (lr follows lr_values, derived again)."""
    run = tmp_path / "run"
    assert main([*SMALL, "--steps", "2", "--lr", "0.3", "--lr-schedule", "piecewise", "--lr-boundaries", "2,4",
                 "--logdir", str(run)]) == 0
    with Trainer(Config(logdir=str(run), resume=True, lr=0.5)) as t:
        assert (t.cfg.lr, t.cfg.lr_schedule, t.cfg.lr_boundaries) == (0.5, "piecewise", "2,4")
    with Trainer(Config(logdir=str(run), resume=True, lr_schedule="cosine")) as t:
        assert (t.cfg.lr, t.cfg.lr_schedule, t.cfg.lr_boundaries) == (0.3, "cosine", None)


def test_a_setting_assigned_after_config_is_given_too(tmp_path):
    """Before: `cfg = Config(logdir=..., resume=True); cfg.steps = 30; cfg.lr = 0.1` resumed to the checkpoint's
    steps with its learning rate, silently: only the fields passed to Config(...) counted as given."""
    cfg = Config(logdir=str(tmp_path), resume=True)
    cfg.steps, cfg.lr, cfg.optimizer = 30, 0.1, None  # None where None is the default: not given
    assert cfg.given == {"logdir", "resume", "steps", "lr"}
    saved = dataclasses.asdict(Config(steps=12, lr=0.8).resolved())
    merged = resume_settings(cfg, saved)
    assert (merged.steps, merged.lr, merged.optimizer) == (30, 0.1, "sgd")


def test_a_trainer_built_with_resume_holds_the_checkpoints_state_before_fit(tmp_path):
    """Before: get_weights, evaluate and predict of Trainer(Config(logdir=..., resume=True)) saw freshly
    initialised weights until fit()."""
    common = dict(devices="cpu", n_gpu=2, hidden=16, batch_size=50, summary_every=0, quiet=True)
    with Trainer(Config(**common, steps=5, logdir=str(tmp_path))) as t:
        t.fit()
        expect = t.evaluate(), t.predict(t.dataset.x_test[:7])
    ck = load_checkpoint(str(tmp_path / "ckpt-00000005.npz"))
    with Trainer(Config(logdir=str(tmp_path), resume=True)) as t:
        assert t.step == 5 and t.resumed.step == 5
        for name, w in t.get_weights().items():
            numpy.testing.assert_array_equal(w, ck[f"params/{name}"])
        for name, w in t.get_weights(ema=True).items():
            numpy.testing.assert_array_equal(w, ck[f"ema/{name}"])
        assert t.evaluate() == expect[0]
        numpy.testing.assert_array_equal(t.predict(t.dataset.x_test[:7]), expect[1])


def test_a_resume_with_another_length_of_a_cosine_schedule_says_the_continuation_differs(tmp_path, capsys):
    """Before: `--lr-schedule cosine --steps 20`, then `--resume --steps 40`: the rate jumped back up and the
    result differed from a 40-step run, with no note (the docs called it exact)."""
    run = tmp_path / "run"
    flags = [*SMALL, "--lr-schedule", "cosine", "--logdir", str(run)]
    assert main([*flags, "--steps", "4"]) == 0
    capsys.readouterr()
    assert main([*flags, "--resume", "--steps", "6"]) == 0
    err = capsys.readouterr().err
    assert ("note: settings changed since the checkpoint (--steps 4 -> 6; --lr-schedule cosine ends at --steps): "
            "the continuation differs from an uninterrupted run") in err, err
    # Another schedule's length is no note: it continues exactly.
    other = tmp_path / "other"
    assert main([*SMALL, "--steps", "4", "--logdir", str(other)]) == 0
    assert main(["--logdir", str(other), "--resume", "--steps", "6"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_a_resume_after_weights_modes_extra_end_of_run_average_says_the_continuation_differs(tmp_path, capsys):
    """Before: `--sync weights --average-every 3 --steps 8`, then `--resume --steps 16` differed from an
    uninterrupted run (the extra average at step 8), with no note."""
    run = tmp_path / "run"
    flags = [*SMALL, "--n-gpu", "2", "--sync", "weights", "--average-every", "3"]
    assert main([*flags, "--steps", "8", "--logdir", str(run)]) == 0
    capsys.readouterr()
    assert main([*flags, "--logdir", str(run), "--resume", "--steps", "10"]) == 0
    err = capsys.readouterr().err
    assert (f"note: {run / 'ckpt-00000008.npz'} was written at the end of its run, after an extra average of the "
            "weights (step 8 is not a multiple of --average-every 3): the continuation differs from an "
            "uninterrupted run") in err, err
    # A checkpoint at an average continues exactly: no note.
    assert main(["--logdir", str(run), "--resume", "--steps", "12", "--average-every", "2"]) == 0
    capsys.readouterr()
    assert main(["--logdir", str(run), "--resume", "--steps", "14"]) == 0
    assert "extra average" not in capsys.readouterr().err


def test_a_resume_past_its_epochs_says_so_in_epochs(tmp_path, capsys):
    """Before: `--resume --epochs 1` after 15 steps said "past --steps 8 ... set --steps above 15"."""
    run = tmp_path / "run"
    # The digits' 1,438 examples, 200 a step: one epoch is 8 steps, two 15, three 22.
    flags = ["--hidden", "8", "--batch-size", "200", "--quiet", "--summary-every", "0", "--logdir", str(run)]
    assert main([*flags, "--steps", "15"]) == 0
    capsys.readouterr()
    assert main([*flags, "--resume", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == (f"towers.train: error: {run / 'ckpt-00000015.npz'} is at step 15, past --epochs 1 (8 steps of 200 "
                   "examples; the total, not more epochs): set --epochs 3 or more to train on, or evaluate it with "
                   "towers.eval"), err


def test_a_shard_gone_before_a_resume_is_said_as_fewer_examples(tmp_path, capsys, monkeypatch):
    """Before: a relative --data glob with a shard gone was "a changed --data (/abs/sh/train-* -> sh/train-*)"."""
    from tests.data.tfrecord.test_records import FEATURES, write_examples

    monkeypatch.chdir(tmp_path)
    with numpy.load(ROOT / "data" / "digits.npz") as z:
        x, y = z["x"], z["y"]
    (tmp_path / "sh").mkdir()
    for k, cut in enumerate(([0, 500], [500, 1000], [1000, len(y)])):
        write_examples(tmp_path / "sh" / f"train-{k:05d}-of-00003", x[slice(*cut)], y[slice(*cut)])
    common = [*SMALL, "--data", "sh/train-*", *FEATURES, "--test-data", str(ROOT / "data" / "digits.npz"),
              "--input-workers", "0", "--logdir", "run"]
    assert main([*common, "--steps", "2"]) == 0
    (tmp_path / "sh" / "train-00002-of-00003").unlink()
    capsys.readouterr()
    assert main([*common, "--steps", "3", "--resume"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("towers.train: error: run/ckpt-00000002.npz was trained on 1,438 "
                          f"examples of --data {tmp_path / 'sh' / 'train-*'}, which now gives 1,000 (fewer: a file "
                          "or shard it read is gone or shorter)"), err


def test_gpu_only_settings_on_cpu_towers_are_said_and_a_resume_that_turns_them_on_is_no_note(tmp_path, capsys):
    """Before: --tf32, --gpu-conv cudnn, --cuda-graphs on CPU towers passed silently, and a resume that turned
    them on said "the continuation differs" while the result was bit-identical."""
    common = [*SMALL, "--devices", "cpu", "--checkpoint-every", "2"]
    assert main([*common, "--steps", "4", "--logdir", str(tmp_path / "whole")]) == 0
    assert main([*common, "--steps", "2", "--tf32", "--gpu-conv", "cudnn", "--logdir", str(tmp_path / "split")]) == 0
    err = capsys.readouterr().err
    assert ("--tf32, --gpu-conv cudnn are for GPU towers only: these towers run on the CPU and compute as without "
            "them") in err, err
    assert main(["--logdir", str(tmp_path / "split"), "--resume", "--steps", "4", "--cuda-graphs"]) == 0
    err = capsys.readouterr().err
    assert "settings changed" not in err and "--cuda-graphs" in err, err
    whole, split = (tmp_path / d / "final.npz" for d in ("whole", "split"))
    assert whole.read_bytes() == split.read_bytes()


def test_fit_twice_without_a_logdir_keeps_one_run_that_loads(tmp_path, monkeypatch):
    """Before: the second fit() made runs/<stamp>-2 with only final.npz, which towers.load could not read."""
    monkeypatch.chdir(tmp_path)
    with Trainer(Config(devices="cpu", hidden=8, batch_size=50, steps=3, quiet=True, summary_every=0)) as t:
        t.fit()
        t.run_steps(2)  # past its steps, by hand
        t.fit()
        assert len(os.listdir(tmp_path / "runs")) == 1
        first = t.logdir
        assert os.listdir(tmp_path / "runs") == [os.path.basename(first)]
        weights = t.get_weights(ema=True)
    loaded = towers.load(first)
    for name, w in weights.items():
        numpy.testing.assert_array_equal(loaded.get_weights(ema=True)[name], w)
    # With a logdir given, a second fit() of the same trainer continues its own run too.
    with Trainer(Config(devices="cpu", hidden=8, batch_size=50, steps=3, quiet=True, summary_every=0,
                        logdir=str(tmp_path / "mine"))) as t:
        t.fit()
        t.fit()


def test_a_resumed_trainers_second_fit_continues_its_own_run(tmp_path):
    """Before: the second fit() of a Trainer built with `resume` refused the checkpoint its own first fit() wrote,
    as "written after this Trainer was built with resume (another run on logdir ...)"."""
    common = dict(devices="cpu", hidden=8, batch_size=50, quiet=True, summary_every=0, logdir=str(tmp_path))
    with Trainer(Config(**common, steps=2)) as t:
        t.fit()
    with Trainer(Config(logdir=str(tmp_path), resume=True, steps=4)) as t:
        t.fit()
        t.run_steps(1)  # past its steps, by hand
        t.fit()
        assert t.step == 5 and list_checkpoints(str(tmp_path))[0][0] == 5
        # Another run's checkpoint written since is still refused.
        with Trainer(Config(logdir=str(tmp_path), resume=True, steps=7)) as other:
            other.fit()
        with pytest.raises(UserError, match="was written after this Trainer was built with resume"):
            t.fit()


def test_a_cluster_trainer_stays_usable_after_a_refused_call(local_ray):
    """Before: after a refused set_weights or load_state_dict (a missing key, NaN) every later step of a
    hosts=2 Trainer said "the Ray cluster failed at step 0"."""
    cfg = Config(hosts=2, n_gpu=1, devices="cpu", hidden=8, batch_size=20, steps=4, quiet=True)
    with Trainer(cfg) as t:
        t.run_steps(1)
        good = t.get_weights()
        bad = {k: numpy.full_like(v, numpy.nan) for k, v in good.items()}
        with pytest.raises(UserError):
            t.set_weights(bad)
        state = t.state_dict()
        with pytest.raises(UserError):
            t.load_state_dict({k: v for k, v in state.items() if not k.startswith("ema/")})
        t.run_steps(1)
        assert t.step == 2


def test_eval_watch_stopped_by_sigterm_says_so(tmp_path):
    """Before: `towers.eval --watch` stopped by SIGTERM exited 143 with no line."""
    p = subprocess.Popen([sys.executable, "-m", "towers.eval", "--logdir", str(tmp_path), "--watch", "--interval",
                          "0.1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert p.stdout.readline().startswith("watching ")
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143
    assert err == "towers.eval: terminated (SIGTERM): stopped watching\n", err


def test_a_script_from_standard_input_that_needs_input_workers_is_told_they_need_a_file():
    """Before: worker tracebacks, then "an input worker process died (out of memory? killed?)"."""
    script = ("from towers.data.spawning import spawn_context\n"
              "try:\n    spawn_context()\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    p = subprocess.run([sys.executable, "-"], input=script, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.startswith("UserError input workers start with spawn, which runs the main script again in each "
                               "worker from its file, but this one has none (<stdin>: read from standard input"), \
        (p.stdout, p.stderr)


def test_what_belongs_to_one_launch_is_never_taken_from_the_checkpoint(tmp_path):
    """A run launched quiet, profiled, with placement logged and a Ray address: its resume without those
    flags prints as it is launched now, and looks for no cluster at the old address."""
    run = tmp_path / "run"
    assert main(["--hidden", "16", "--batch-size", "50", "--summary-every", "0", "--steps", "4", "--quiet",
                 "--profile", "--log-placement", "--logdir", str(run)]) == 0
    saved = load_checkpoint(str(run / "ckpt-00000004.npz"))["config"]
    saved = {**saved, "ray_address": "10.0.0.9:6379", "measure_scaling": True}  # as a cluster run's would hold
    cfg = resume_settings(parse_config(["--logdir", str(run), "--resume", "--steps", "6"]), saved)
    assert (cfg.quiet, cfg.profile, cfg.log_placement, cfg.measure_scaling, cfg.ray_address) == (
        False, False, False, False, None)
    assert (cfg.hidden, cfg.batch_size, cfg.steps) == (16, 50, 6)  # the run's own settings are still taken
