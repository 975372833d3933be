"""``python -m towers.eval`` and the TensorBoard event files, read back with TensorBoard's own reader."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy
import pytest

from tests import commands

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--hidden", "16", "--batch-size", "50", "--quiet"]


def cli(module, *args, ok=True):
    p = commands.run(module, *args, cwd=ROOT)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One trained run: 20 steps, checkpoints every 10, summaries and log lines every 5."""
    d = tmp_path_factory.mktemp("run")
    cli("towers.train", "--logdir", d, *SMALL, "--steps", 20, "--checkpoint-every", 10,
        "--summary-every", 5, "--log-every", 5, "--n-gpu", 2)
    return d


def metrics(d) -> list[dict]:
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_events_hold_scalars_and_histograms(run_dir):
    # Use TensorBoard's TF-free code path (its own stub), as it runs without TensorFlow installed.
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    tags = ea.Tags()
    assert {"loss", "learning_rate", "examples_per_sec", "test_accuracy", "test_accuracy_ema"} <= set(tags["scalars"])
    names = ["layer1/weights", "layer1/biases", "layer2/weights", "layer2/biases"]
    assert set(tags["histograms"]) == set(names) | {n + "/gradients" for n in names}
    assert [e.step for e in ea.Scalars("loss")] == [5, 10, 15, 20]
    # The same values as the log lines and the final test accuracy (float32 in the events).
    logged = {m["step"]: m for m in metrics(run_dir) if "loss" in m}
    for e in ea.Scalars("loss"):
        assert e.value == pytest.approx(logged[e.step]["loss"], rel=1e-6)
    for e in ea.Scalars("learning_rate"):  # the rate of the update that made step e.step
        assert e.value == pytest.approx(0.8 * 0.99 ** ((e.step - 1) * 100 / 1438), rel=1e-6)
    final = metrics(run_dir)[-1]
    assert ea.Scalars("test_accuracy_ema")[-1].value == pytest.approx(final["test_accuracy_ema"], rel=1e-6)
    assert ea.Scalars("test_accuracy")[-1].value == pytest.approx(final["test_accuracy"], rel=1e-6)
    assert all(e.value > 0 for e in ea.Scalars("examples_per_sec"))
    # The last weight histogram describes the final weights.
    with numpy.load(run_dir / "final.npz") as z:
        w = z["params/layer1/weights"].astype(numpy.float64)
    h = ea.Histograms("layer1/weights")[-1]
    assert h.step == 20 and h.histogram_value.num == w.size
    assert h.histogram_value.sum == pytest.approx(w.sum(), rel=1e-9, abs=1e-9)
    assert h.histogram_value.max == pytest.approx(w.max())
    assert sum(h.histogram_value.bucket) == w.size
    g = ea.Histograms("layer2/biases/gradients")[-1].histogram_value
    assert g.num == 10 and g.sum_squares > 0


def test_eval_matches_the_trainers_accuracy(run_dir):
    final = metrics(run_dir)[-1]
    out = cli("towers.eval", "--logdir", run_dir).stdout
    assert "ckpt-00000020.npz (step 20)" in out and "EMA weights" in out
    assert f"accuracy = {final['test_accuracy_ema']:.4f}" in out
    out = cli("towers.eval", "--logdir", run_dir, "--no-ema").stdout
    assert f"accuracy = {final['test_accuracy']:.4f}" in out and "raw weights" in out
    out = cli("towers.eval", "--checkpoint", run_dir / "ckpt-00000010.npz").stdout
    assert "(step 10)" in out


def test_eval_takes_a_runs_final_npz(run_dir, tmp_path):
    """Before: `final.npz is not a readable checkpoint (not a towers checkpoint (no format, config, ...))`."""
    final = metrics(run_dir)[-1]
    for flags, key in (((), "test_accuracy_ema"), (("--no-ema",), "test_accuracy")):
        out = cli("towers.eval", "--checkpoint", run_dir / "final.npz", *flags).stdout
        assert out.startswith("final.npz (step 20): ") and f"accuracy = {final[key]:.4f}" in out, out
    alone = tmp_path / "final.npz"  # away from its run: nothing says which model or data it is
    alone.write_bytes((run_dir / "final.npz").read_bytes())
    p = cli("towers.eval", "--checkpoint", alone, ok=False)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert f"is not beside it ({tmp_path / 'ckpt-00000020.npz'}): give one of the run's ckpt-*.npz" in p.stderr


@pytest.mark.slow
def test_eval_of_a_batch_norm_model_uses_its_moving_statistics(tmp_path):
    # Before: towers.eval left the moving mean and variance at 0 and 1, and disagreed with the run.
    cli("towers.train", "--logdir", tmp_path, "--model", "resnet20", "--batch-size", "16", "--quiet", "--steps", 8,
        "--n-gpu", 2)
    final = metrics(tmp_path)[-1]
    for flags, key in (((), "test_accuracy_ema"), (("--no-ema",), "test_accuracy")):
        out = cli("towers.eval", "--logdir", tmp_path, *flags).stdout
        assert f"accuracy = {final[key]:.4f}" in out, (out, final)
        out = cli("towers.eval", "--checkpoint", tmp_path / "final.npz", *flags).stdout  # its buffers too
        assert f"accuracy = {final[key]:.4f}" in out, (out, final)


def test_eval_errors_are_one_line(run_dir, tmp_path):
    def error(*args):
        p = cli("towers.eval", *args, ok=False)
        assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
        return p.stderr
    assert "no checkpoint" in error("--logdir", tmp_path)
    bad = tmp_path / "ckpt-00000001.npz"
    bad.write_bytes(b"not a zip")
    assert "not a readable checkpoint" in error("--checkpoint", bad)
    other = tmp_path / "other.npz"
    numpy.savez(other, x=numpy.zeros((20, 5), numpy.uint8), y=numpy.arange(20) % 10,
                x_test=numpy.zeros((20, 5), numpy.uint8), y_test=numpy.arange(20) % 10)
    assert "shape" in error("--logdir", run_dir, "--data", other)
    assert "--watch needs --logdir" in error("--checkpoint", run_dir / "ckpt-00000010.npz", "--watch")
    assert "set --test-data to" in error("--logdir", run_dir, "--test-data", tmp_path / "missing.npz")


@pytest.mark.parametrize("interval", ["nan", "inf", "1e300", "0", "-1"])
def test_eval_interval_must_be_finite_and_positive(interval, tmp_path):
    p = cli("towers.eval", "--logdir", tmp_path, "--watch", "--interval", interval, ok=False)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert "--interval must be a finite number of seconds > 0" in p.stderr and p.stdout == ""


def test_eval_on_a_logdir_of_corrupt_checkpoints_says_nothing_to_evaluate(tmp_path):
    for step in (10, 20):
        (tmp_path / f"ckpt-{step:08d}.npz").write_bytes(b"not a zip")
    p = cli("towers.eval", "--logdir", tmp_path, ok=False)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert f"none of the 2 checkpoints in {tmp_path} can be read" in p.stderr
    assert str(tmp_path / "ckpt-00000020.npz") in p.stderr and "nothing to evaluate" in p.stderr
    assert "start fresh" not in p.stderr  # that is advice for training, not for eval


def test_eval_watch_evaluates_each_new_checkpoint(tmp_path):
    cli("towers.train", "--logdir", tmp_path, *SMALL, "--steps", 4, "--summary-every", 0)
    watch = subprocess.Popen([sys.executable, "-m", "towers.eval", "--logdir", str(tmp_path), "--watch",
                              "--interval", "0.05", "--max-evals", "2"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert watch.stdout.readline().startswith("watching")
        assert "(step 4)" in watch.stdout.readline()  # the checkpoint already there
        cli("towers.train", "--logdir", tmp_path, *SMALL, "--steps", 8, "--summary-every", 0, "--resume")
        out, err = watch.communicate(timeout=30)
    finally:
        watch.kill()
    assert watch.returncode == 0, err
    assert "(step 8)" in out


def test_summaries_do_not_import_torch(tmp_path):
    """tensorboardX imports torch when installed (seconds of start-up); the writer keeps it out."""
    fake = tmp_path / "fake"
    fake.mkdir()
    marker = tmp_path / "torch-was-imported"
    (fake / "torch.py").write_text(f"open({str(marker)!r}, 'w').close()\nTensor = object\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from towers.train import main; "
            "sys.exit(main(['--devices', 'cpu', '--steps', '3', '--summary-every', '1', '--quiet', "
            "'--hidden', '8', '--logdir', sys.argv[2]]))")
    res = subprocess.run([sys.executable, "-c", code, str(fake), str(tmp_path / "run")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))
    assert not marker.exists()


def test_a_user_models_shape_mismatch_cites_only_the_settings_it_reads(tmp_path):
    """Before: `(the checkpoint was trained with --model usernet:small --hidden 500)`; a user model reads no --hidden."""
    (tmp_path / "usernet.py").write_text(
        "import os\nfrom towers import Dense, Flatten, ReLU\n\n"
        "def small(input_shape, num_classes):\n"
        "    return [Flatten(), Dense('hidden', int(os.environ['UNITS'])), ReLU(), Dense('logits', num_classes)]\n")

    def run(module, units, *args):
        env = dict(os.environ, PYTHONPATH=str(tmp_path), UNITS=str(units))
        return commands.run(module, *args, cwd=ROOT, env=env)
    p = run("towers.train", 32, "--logdir", tmp_path / "run", "--model", "usernet:small", "--steps", 2, "--quiet",
            "--summary-every", 0)
    assert p.returncode == 0, p.stderr
    p = run("towers.eval", 16, "--logdir", tmp_path / "run")  # the function builds other shapes now
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert "(the checkpoint was trained with --model usernet:small);" in p.stderr, p.stderr
    assert "--hidden" not in p.stderr


def test_eval_labels_a_test_folder_by_the_checkpoints_class_names_and_needs_no_training_data(tmp_path):
    """Before: `--data T --test-data T`, T without the class folder 0, numbered every class one lower (accuracy
    0.11 instead of 0.26); and with the training folder gone eval refused to run."""
    from tests.data.image.test_image_checks import _numbered_folder
    from tests.data.image.test_images import _images

    x, y = _images(60)
    train = _numbered_folder(tmp_path / "train", x, y)  # classes 0, 1, 2
    test = _numbered_folder(tmp_path / "test", x, y, skip=[0])  # 1, 2
    cli("towers.train", "--logdir", tmp_path / "run", "--data", train, "--test-data", test, "--steps", 6,
        "--batch-size", 20, "--quiet", "--summary-every", 0, "--input-workers", 0)
    # The same pixels and labels as an npz, in the folder's order (class by class, by file name).
    order = numpy.lexsort((numpy.arange(len(y)), y))
    order = order[y[order] != 0]
    numpy.savez(tmp_path / "test.npz", x_test=x[order], y_test=y[order])

    def line(*args):
        out = cli("towers.eval", "--logdir", tmp_path / "run", *args).stdout.strip()
        return out.split(": ", 1)[1]
    truth = line("--test-data", tmp_path / "test.npz")
    assert f"on {len(order)} test examples" in truth and truth.endswith("; classes 0 0, 1 1, 2 2")
    assert line("--data", test, "--test-data", test) == truth
    os.rename(train, tmp_path / "gone")  # the checkpoint holds all eval needs; its --test-data is the folder
    assert line() == truth
    p = cli("towers.eval", "--logdir", tmp_path / "run", "--data", test, ok=False)  # a folder has no test split
    assert p.returncode == 2 and f"{test} has no x_test/y_test: give test data (--test-data)" in p.stderr, p.stderr
