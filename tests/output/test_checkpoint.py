"""Checkpoints and --resume: exact continuation, crash safety, refusals.

Everything runs the real command line in a subprocess on the small digits data
with a tiny MLP, so it tests what a user runs (including exit codes and the
one-line errors) in a few seconds.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

from tests import commands
from towers.output.checkpoint import list_checkpoints, load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--hidden", "16", "--batch-size", "50", "--quiet", "--summary-every", "0"]


def train(logdir, *args, ok=True):
    p = commands.run("towers.train", "--logdir", logdir, *SMALL, *args, cwd=ROOT)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def one_line_error(p, code: int = 2) -> str:
    """The error a user sees: one line, no traceback; exit 2 for a user mistake, 1 for a failed run."""
    assert p.returncode == code, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("towers.train: error:")]
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_resume_is_byte_identical(tmp_path):
    # --steps is the total: 20 steps, then --resume --steps 40 runs steps 21..40.
    # Momentum exercises the optimizer state; 2 towers x 50 crosses an epoch
    # boundary (1438 examples) before step 20, so the pipeline position matters.
    common = ["--n-gpu", 2, "--momentum", 0.9, "--checkpoint-every", 7, "--log-every", 5]
    train(tmp_path / "whole", "--steps", 40, *common)
    train(tmp_path / "split", "--steps", 20, *common)
    p = train(tmp_path / "split", "--steps", 40, "--resume", *common)
    assert "resuming from" in p.stdout and "ckpt-00000020.npz" in p.stdout
    whole, split = (tmp_path / d / "final.npz" for d in ("whole", "split"))
    assert whole.read_bytes() == split.read_bytes()
    with numpy.load(split) as z:
        assert int(z["step"]) == 40


def test_resume_is_a_library_call_that_prints_nothing(tmp_path, capsys, notices, monkeypatch):
    """A Trainer built with ``resume`` loads the checkpoint and holds its line and notes (each note a notice too);
    a skipped one is a notice."""
    import logging

    import towers
    from towers.cli import _Stderr

    # A command line run earlier in this process (towers.cli.show_notices) prints the logger's notices:
    # that is the command line's doing, not the library's.
    log = logging.getLogger("towers")
    monkeypatch.setattr(log, "handlers", [h for h in log.handlers if not isinstance(h, _Stderr)])
    train(tmp_path, "--steps", 4, "--n-gpu", 2)
    (tmp_path / "ckpt-00000009.npz").write_bytes(b"torn")  # newer and unreadable: skipped, with a notice
    cfg = towers.Config(devices="cpu", n_gpu=1, hidden=16, batch_size=50, steps=6, logdir=str(tmp_path), resume=True)
    with towers.Trainer(cfg) as trainer:
        found = trainer.resumed
        assert trainer.step == 4
    assert capsys.readouterr() == ("", "")
    assert found.line.startswith(f"resuming from {tmp_path / 'ckpt-00000004.npz'}: step 4, input at epoch 0")
    assert len(found.notes) == 1 and "written by 2 tower(s)" in found.notes[0]
    assert [line for line in notices if "ckpt-00000009.npz is unreadable" in line] != []
    assert found.notes[0] in notices


@pytest.mark.parametrize("optimizer, slots", [
    (["--optimizer", "adamw", "--weight-decay", "0.1"], ("adam_m", "adam_v")),
    (["--optimizer", "rmsprop", "--momentum", "0.9", "--rmsprop-centered"],
     ("rmsprop_ms", "rmsprop_mom", "rmsprop_mg")),
])
def test_a_new_optimizers_state_is_checkpointed_and_resumes_exactly(tmp_path, optimizer, slots):
    common = ["--n-gpu", 2, *optimizer, "--checkpoint-every", 5, "--log-every", 5]
    train(tmp_path / "whole", "--steps", 16, *common)
    train(tmp_path / "split", "--steps", 10, *common)
    ck = load_checkpoint(str(tmp_path / "split" / "ckpt-00000010.npz"))
    assert {k.split("/", 1)[0] for k in ck} >= set(slots)
    p = train(tmp_path / "split", "--steps", 16, "--resume", *common)
    assert "settings changed" not in p.stderr
    whole, split = (tmp_path / d / "final.npz" for d in ("whole", "split"))
    assert whole.read_bytes() == split.read_bytes()


def test_checkpoint_contents_index_and_keep(tmp_path):
    train(tmp_path / "a", "--steps", 12, "--checkpoint-every", 2, "--keep-checkpoints", 3, "--momentum", 0.5)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert [n for n in names if n.startswith("ckpt-")] == ["ckpt-00000008.npz", "ckpt-00000010.npz", "ckpt-00000012.npz"]
    assert not [n for n in names if ".tmp" in n]  # no leftovers of the atomic writes
    index = (tmp_path / "a" / "checkpoint").read_text()
    assert index.splitlines()[0] == 'model_checkpoint_path: "ckpt-00000012.npz"'
    assert index.count("all_model_checkpoint_paths") == 3
    ck = load_checkpoint(str(tmp_path / "a" / "ckpt-00000012.npz"))
    assert int(ck["step"]) == 12
    # 12 steps x 50 examples: epoch 0, index 600.
    assert (int(ck["data/epoch"]), int(ck["data/index"])) == (0, 600)
    assert ck["config"]["hidden"] == 16 and ck["config"]["momentum"] == 0.5
    for kind in ("params", "ema", "momentum"):
        assert ck[f"{kind}/layer1/weights"].shape == (64, 16)
        assert ck[f"{kind}/layer2/biases"].dtype == numpy.float32
    with numpy.load(tmp_path / "a" / "final.npz") as z:
        numpy.testing.assert_array_equal(z["ema/layer1/weights"], ck["ema/layer1/weights"])
    # The format does not depend on the tower count: same keys and shapes with 2 towers.
    train(tmp_path / "b", "--steps", 2, "--n-gpu", 2, "--momentum", 0.5)
    ck2 = load_checkpoint(str(tmp_path / "b" / "ckpt-00000002.npz"))
    assert {k: numpy.shape(v) for k, v in ck2.items() if "/" in k and not k.startswith("data/")} == \
           {k: numpy.shape(v) for k, v in ck.items() if "/" in k and not k.startswith("data/")}
    assert int(ck2["n_towers"]) == 2


def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path):
    train(tmp_path, "--steps", 10, "--checkpoint-every", 5)
    latest = tmp_path / "ckpt-00000010.npz"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # truncated
    p = train(tmp_path, "--steps", 12, "--checkpoint-every", 5, "--resume")
    assert "ckpt-00000010.npz is unreadable" in p.stderr
    assert "resuming from" in p.stdout and "ckpt-00000005.npz: step 5" in p.stdout
    assert load_checkpoint(str(tmp_path / "ckpt-00000012.npz"))["step"] == 12
    # Bytes flipped mid-file (CRC mismatch) are caught too; all unreadable is an error, not a fresh start.
    for _, path in list_checkpoints(str(tmp_path)):
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
        Path(path).write_bytes(bytes(data))
    err = one_line_error(train(tmp_path, "--steps", 14, "--resume", ok=False))
    assert "none of the" in err and "can be read" in err


@pytest.mark.slow
def test_resume_refusals_and_notes(tmp_path):
    train(tmp_path, "--steps", 4, "--n-gpu", 2)
    # A fresh run never overwrites a run's checkpoints.
    assert "--resume" in one_line_error(train(tmp_path, "--steps", 4, ok=False))
    # Another model shape: the changed setting is named, with the checkpoint's value.
    err = one_line_error(train(tmp_path, "--steps", 6, "--resume", "--hidden", 32, ok=False))
    assert "trained with --hidden 16, this run has --hidden 32" in err
    # Another dataset shape.
    other = tmp_path / "other.npz"
    numpy.savez(other, x=numpy.zeros((300, 5), numpy.uint8), y=numpy.arange(300) % 10)
    assert "shape" in one_line_error(train(tmp_path, "--steps", 6, "--resume", "--data", other, ok=False))
    # Another tower count is allowed, with a note; the run continues to --steps.
    p = train(tmp_path, "--steps", 6, "--resume", "--n-gpu", 1, "--batch-size", 100)
    assert "written by 2 tower(s)" in p.stderr and "same global batch" in p.stderr
    assert load_checkpoint(str(tmp_path / "ckpt-00000006.npz"))["step"] == 6
    # --resume without --logdir, and in an empty logdir.
    p = commands.run("towers.train", "--resume", cwd=ROOT)
    assert "--resume needs --logdir" in one_line_error(p)
    p = train(tmp_path / "empty", "--steps", 2, "--resume")
    assert "no checkpoint" in p.stderr and "starting fresh" in p.stderr


def test_a_resume_whose_class_names_changed_is_refused_naming_both_lists(tmp_path):
    """Before: `train/emu` renamed `ant` resumed with exit 0 and no note, and every label meant another class."""
    import towers
    from tests.data.image.test_images import _folder, _images

    x, y = _images(60)
    data = tmp_path / "photos"
    _folder(data, x, y)  # cat, dog, emu
    train(tmp_path / "run", "--data", data, "--steps", 2, "--input-workers", 0)
    moved = tmp_path / "moved"  # the same folders elsewhere: the same classes
    data.rename(moved)
    train(tmp_path / "run", "--data", moved, "--steps", 3, "--resume", "--input-workers", 0)
    (moved / "emu").rename(moved / "ant")  # ant, cat, dog: labels 0 and 1 change their meaning
    err = one_line_error(train(tmp_path / "run", "--data", moved, "--steps", 4, "--resume", "--input-workers", 0,
                               ok=False))
    assert ('ckpt-00000003.npz was trained on the classes ["cat", "dog", "emu"], but the data\'s are '
            '["ant", "cat", "dog"] (label 0 meant \'cat\' and would mean \'ant\')') in err, err
    assert err.endswith("resume with the class folders it was trained on (the same names), or use another --logdir")
    # The same names in another order (a data set handed over in Python), or numbered labels, are refused too.
    state = load_checkpoint(str(tmp_path / "run" / "ckpt-00000003.npz"))
    for names in (["emu", "dog", "cat"], None):
        ds = towers.Dataset(x.reshape(60, 12, 12, 1), y.astype(numpy.int32), 3, class_names=names)
        cfg = towers.Config(devices="cpu", hidden=16, batch_size=10, steps=4)
        with towers.Trainer(cfg, dataset=ds) as t, pytest.raises(towers.UserError, match="was trained on the "
                                                                 "(classes|class folders)") as e:
            t.load_state_dict(state, where="ckpt")
        assert str(e.value).endswith("give the data with the classes it was trained on")


def test_a_resume_on_other_data_of_the_same_shape_says_so_and_a_moved_copy_does_not(tmp_path):
    """Before: permuted labels, or float32 pixels in place of uint8 ones, resumed without a word."""
    import towers

    with numpy.load(ROOT / "data" / "digits.npz") as z:
        digits = {k: z[k] for k in z.files}
    perm = numpy.random.default_rng(0).permutation(10)
    files = {"permuted.npz": dict(digits, y=perm[digits["y"]], y_test=perm[digits["y_test"]]),
             "float.npz": dict(digits, x=digits["x"].astype(numpy.float32),
                               x_test=digits["x_test"].astype(numpy.float32))}
    for name, arrays in files.items():
        numpy.savez(tmp_path / name, **arrays)
    numpy.savez_compressed(tmp_path / "copy.npz", **digits)  # the same arrays, elsewhere, stored otherwise
    train(tmp_path / "run", "--steps", 2)
    expected = {"permuted.npz": "other labels", "float.npz": "examples stored as uint8 -> float32", "copy.npz": None}
    for name, differs in expected.items():
        shutil.copytree(tmp_path / "run", tmp_path / name[:-4])
        p = train(tmp_path / name[:-4], "--steps", 3, "--resume", "--data", tmp_path / name)
        notes = [ln for ln in p.stderr.splitlines() if "training data changed" in ln]
        if differs is None:
            assert notes == [], p.stderr
        else:
            assert notes == [f"note: the training data changed since the checkpoint (--data {tmp_path / name}: "
                             f"{differs}): the continuation differs from an uninterrupted run"], p.stderr
    # A checkpoint written before fingerprints were recorded resumes on any data of its shape without the note.
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(ROOT / "tests" / "files" / "ckpt-format1-step10.npz", old / "ckpt-00000010.npz")
    cfg = towers.Config(devices="cpu", n_gpu=2, hidden=8, batch_size=20, steps=12, logdir=str(old), resume=True,
                        data=str(tmp_path / "permuted.npz"))
    with towers.Trainer(cfg) as t:
        found = t.resumed
    assert found.step == 10 and not [n for n in found.notes if "training data" in n], found.notes


@pytest.fixture(scope="module")
def rgb_run(tmp_path_factory):
    """A 4-step run on 8x8x3 images (so --augment and --normalize apply), to resume with changed settings."""
    root = tmp_path_factory.mktemp("rgb")
    rng = numpy.random.default_rng(0)
    x = rng.integers(0, 256, size=(300, 8, 8, 3), dtype=numpy.uint8)
    numpy.savez(root / "rgb.npz", x=x, y=(x[:, 0, 0, 0] > 127).astype(numpy.int64))
    data = ["--data", str(root / "rgb.npz")]
    train(root / "run", *data, "--steps", 4)
    return root, data


@pytest.mark.parametrize("args, outcome, named", [
    # Another model shape: refused, naming the setting (before: a layer's name, or nothing).
    (["--model", "lenet5"], "refused", "trained with --model mlp, this run has --model lenet5"),
    (["--image-size", "6,6,3"], "refused", "--image-size unset -> 6,6,3"),
    # Another trajectory: a note (before: --augment, --normalize, --lr-schedule, --warmup-steps,
    # --label-smoothing passed silently).
    (["--normalize", "0.5,0.25"], "note", "--normalize unset -> 0.5,0.25"),
    (["--augment", "cifar"], "note", "--augment none -> cifar"),
    (["--warmup-steps", "3"], "note", "--warmup-steps 0 -> 3"),
    (["--label-smoothing", "0.1"], "note", "--label-smoothing 0.0 -> 0.1"),
    (["--optimizer", "rmsprop"], "note", "--optimizer sgd -> rmsprop"),
    # Neither: silent.
    (["--log-every", "1", "--input-workers", "0", "--check-replicas", "2"], "silent", None),
])
def test_a_changed_setting_on_resume_is_refused_noted_or_silent_as_declared(rgb_run, tmp_path, args, outcome,
                                                                            named):
    root, data = rgb_run
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    p = train(run, *data, "--steps", 6, "--resume", *args, ok=outcome != "refused")
    if outcome == "refused":
        err = one_line_error(p)
        assert named in err, err
        return
    notes = [ln for ln in p.stderr.splitlines() if "settings changed since the checkpoint" in ln]
    if outcome == "note":
        assert len(notes) == 1 and named in notes[0] and "differs from an uninterrupted run" in notes[0], p.stderr
    else:
        assert notes == [], p.stderr
    assert load_checkpoint(str(run / "ckpt-00000006.npz"))["step"] == 6


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    train(tmp_path, "--steps", 10, "--checkpoint-every", 5)
    p = train(tmp_path, "--steps", 40, "--resume", "--lr", "1e30", "--log-every", 1, ok=False)
    err = one_line_error(p, code=1)
    m = re.search(r"step (\d+): the loss is (nan|inf)", err)
    assert m and int(m.group(1)) > 10, err
    assert "ckpt-00000010.npz" in err
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [10, 5]
    ck = load_checkpoint(str(tmp_path / "ckpt-00000010.npz"))
    assert all(numpy.isfinite(v).all() for k, v in ck.items() if k.startswith(("params/", "ema/")))
    with numpy.load(tmp_path / "final.npz") as z:  # still the good run's, step 10
        assert int(z["step"]) == 10


def _step(line: str) -> int:
    try:
        return json.loads(line)["step"]
    except ValueError:  # a line the kill cut short
        return -1


def _newest_step(logdir) -> int:
    found = list_checkpoints(str(logdir))
    return found[0][0] if found else -1


@pytest.mark.slow
def test_sigkill_at_any_moment_loses_nothing_beyond_the_last_checkpoint(tmp_path):
    args = ["--checkpoint-every", 1, "--log-every", 1, "--batch-size", 20, "--keep-checkpoints", 3]
    run = tmp_path / "crashy"
    # 600 steps, ~2 ms a step with a checkpoint each step: long enough to be killed mid-run four times.
    cmd = [sys.executable, "-m", "towers.train", "--logdir", str(run), *SMALL, "--steps", "600", *map(str, args)]
    done = runs = 0
    # Kill the moment a new checkpoint appears, and at several delays after.
    for delay in (0.0, 0.01, 0.05, 0.2):
        p = subprocess.Popen(cmd + (["--resume"] if done else []), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while _newest_step(run) <= done and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
        os.kill(p.pid, signal.SIGKILL)
        runs += 1
        assert p.wait() == -signal.SIGKILL, "the run finished before it could be killed"
        # Every checkpoint file on disk is complete, and the index names a loadable one.
        on_disk = list_checkpoints(str(run))
        for _, path in on_disk:
            load_checkpoint(path)
        index = run / "checkpoint"
        if index.exists():
            load_checkpoint(str(run / re.match(r'model_checkpoint_path: "(.+)"', index.read_text()).group(1)))
        else:
            # Every run so far was killed between its first checkpoint and its
            # first index write (likely with delay 0): each left one checkpoint
            # more, none an index.  Resuming scans the files, not the index.
            assert len(on_disk) <= runs
        # Nothing lost beyond the steps since the newest checkpoint: every step the
        # run reported as done is in it.
        logged = [_step(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert on_disk[0][0] >= max(logged, default=0) and on_disk[0][0] > done
        done = on_disk[0][0]
    # The last resume runs on for 80 steps, across an epoch's end (72 steps of 20 of the 1438 examples), to a
    # total --steps may change on resume (it changes neither model nor trajectory): an uninterrupted run's bytes.
    total = done + 80
    train(run, *args, "--steps", total, "--resume")
    train(tmp_path / "ref", *args, "--steps", total)
    assert (run / "final.npz").read_bytes() == (tmp_path / "ref" / "final.npz").read_bytes()
