"""What a run reports as it trains: validation every N steps or epoch, the training accuracy beside the loss,
top-5 accuracy, a held-out split, fp16's skipped steps, the settings line; log lines that make a curve."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from tests.conftest import DIGITS
from towers import Config, Dataset, Trainer, UserError
from towers.data.batches import BatchSource
from towers.run.extensions import default_interval, settings_line
from towers.nn.replica import Replica

SMALL = dict(n_gpu=2, devices="cpu", hidden=16, batch_size=50, quiet=True, summary_every=0)


def records(logdir) -> list[dict]:
    return [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]


def scalars(logdir, tag: str) -> dict[int, float]:
    """{step: value} of a TensorBoard scalar, read with TensorBoard's own reader."""
    pytest.importorskip("tensorboard", reason="tensorboard reads the event files (pip install -e '.[test]')")
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    return {e.step: e.value for e in ea.Scalars(tag)} if tag in ea.Tags()["scalars"] else {}


def digits_without_test_split(tmp_path):
    with np.load(DIGITS) as d:
        x, y = d["x"], d["y"]
    path = tmp_path / "train.npz"
    np.savez(path, x=x, y=y)
    return path, x, y


# -- training accuracy ---------------------------------------------------------------------------------


def test_training_accuracy_is_the_steps_own_forward():
    """The accuracy of the logits the step computed before its update (training mode), not a second pass."""
    with Trainer(Config(**SMALL)) as tr:
        x, y = BatchSource(tr.dataset, tr.global_batch, 0).next_batch()
        before = tr.get_weights()
        r = Replica(tr.model, np)
        r.set_params(np.concatenate([before[name].ravel() for name, *_ in tr.model.layout()]))
        right = sum(int((r.forward(x[k:k + 50] / np.float32(255) if x.dtype == np.uint8 else x[k:k + 50],
                                   training=True).argmax(1) == y[k:k + 50]).sum()) for k in (0, 50))
        tr.train_step(x, y, want_loss=True)
        assert tr.train_accuracy() == right / 100
        tr.train_step(x, y)  # no loss asked for: not counted
        assert tr.train_accuracy() is None


def test_log_records_and_summaries_carry_the_training_accuracy(tmp_path):
    with Trainer(Config(**{**SMALL, "summary_every": 5}, steps=10, log_every=5, logdir=str(tmp_path))) as tr:
        tr.fit()
    logged = [r for r in records(tmp_path) if "loss" in r]
    assert [r["step"] for r in logged] == [5, 10]
    assert all(0 <= r["train_accuracy"] <= 1 for r in logged)
    assert sorted(scalars(tmp_path, "train_accuracy")) == [5, 10]


def test_log_line_shows_the_training_accuracy(tmp_path, capsys):
    with Trainer(Config(**{**SMALL, "quiet": False}, steps=4, log_every=2, logdir=str(tmp_path))) as tr:
        tr.fit()
    out = capsys.readouterr().out
    accuracy = records(tmp_path)[0]["train_accuracy"]
    assert f"step 2, loss = {records(tmp_path)[0]['loss']:.4f}, accuracy = {accuracy:.4f} (" in out


# -- intervals that give a curve ----------------------------------------------------------------------


def test_a_short_run_logs_a_curve_by_default(tmp_path):
    assert default_interval(2000) == 100 and default_interval(300) == 15 and default_interval(7) == 1
    with Trainer(Config(**{**SMALL, "summary_every": None}, steps=40, logdir=str(tmp_path))) as tr:
        tr.fit()
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == list(range(2, 41, 2))
    assert sorted(scalars(tmp_path, "loss")) == list(range(2, 41, 2))


# -- validation ----------------------------------------------------------------------------------------


def test_eval_every_n_steps_logs_records_and_summarizes_test_figures(tmp_path, capsys):
    with Trainer(Config(**{**SMALL, "summary_every": 100, "quiet": False}, steps=12, eval_every=4,
                        logdir=str(tmp_path))) as tr:
        tr.fit()
        final = tr.test_accuracy()
    evals = [r for r in records(tmp_path) if "test_accuracy" in r]
    assert [r["step"] for r in evals] == [4, 8, 12]  # 12: the final evaluation
    assert set(evals[0]) == {"step", "test_loss", "test_accuracy", "test_loss_ema", "test_accuracy_ema"}
    assert evals[-1]["test_accuracy_ema"] == final["test_accuracy_ema"]
    assert sorted(scalars(tmp_path, "test_accuracy")) == [4, 8, 12]
    assert sorted(scalars(tmp_path, "test_loss_ema")) == [4, 8, 12]
    out = capsys.readouterr().out
    assert f"step 8, test loss = {evals[1]['test_loss']:.4f}, accuracy = {evals[1]['test_accuracy']:.4f} (raw)" in out


def test_eval_every_epoch_evaluates_where_each_epoch_ends(tmp_path):
    with Trainer(Config(**SMALL, steps=40, eval_every="epoch", logdir=str(tmp_path))) as tr:
        n, per_step = len(tr.dataset.x), tr.examples_per_step
        tr.fit()
    ends = [-(-k * n // per_step) for k in range(1, 40 * per_step // n + 1)]
    assert len(ends) >= 2
    evals = [r["step"] for r in records(tmp_path) if "test_accuracy" in r]
    assert evals == [s for s in ends if s < 40] + [40]


def test_eval_every_is_checked_and_parsed_from_the_flag():
    from towers.train import parse_config

    assert Config(eval_every="7").resolved().eval_every == 7
    assert parse_config(["--eval-every", "epoch"]).eval_every == "epoch"
    with pytest.raises(UserError, match="eval_every must be a number of steps >= 0 or epoch, got 'often'"):
        Config(eval_every="often").resolved()


def test_evaluation_during_training_leaves_the_result_unchanged(tmp_path):
    for every in (0, 1):
        with Trainer(Config(**SMALL, steps=6, eval_every=every, logdir=str(tmp_path / str(every)))) as tr:
            tr.fit()
    assert (tmp_path / "0" / "final.npz").read_bytes() == (tmp_path / "1" / "final.npz").read_bytes()


def test_top5_accuracy_with_more_than_10_classes():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 8)).astype(np.float32)
    y = rng.integers(0, 12, 300).astype(np.int32)
    with Trainer(Config(**SMALL), dataset=Dataset.from_arrays(x[:200], y[:200], x[200:], y[200:])) as tr:
        tr.run_steps(3)
        scores = tr.evaluate()
        logits = tr.predict()
    top5 = np.argsort(-logits, axis=1)[:, :5]
    assert scores["top5_accuracy"] == pytest.approx((top5 == y[200:, None]).any(axis=1).mean())
    assert scores["top5_accuracy"] >= scores["accuracy"]
    with Trainer(Config(**SMALL)) as ten:  # the digits: 10 classes, no top-5
        assert "top5_accuracy" not in ten.evaluate()


# -- a held-out split ----------------------------------------------------------------------------------


def test_validation_split_holds_out_the_same_seeded_examples_never_trained_on(tmp_path, capsys):
    path, x, y = digits_without_test_split(tmp_path)
    with Trainer(Config(**SMALL, data=str(path), validation_split=0.2, seed=3)) as tr:
        train, held = tr.dataset.x, tr.dataset.x_test
    order = np.random.default_rng(3).permutation(len(x))
    k = round(0.2 * len(x))
    assert np.array_equal(held, x[np.sort(order[:k])]) and np.array_equal(train, x[np.sort(order[k:])])
    with Trainer(Config(**SMALL, data=str(path), validation_split=0.2, seed=3)) as again:
        assert np.array_equal(again.dataset.x_test, held)
    with Trainer(Config(**SMALL, data=str(path), validation_split=0.2, seed=4)) as other:
        assert not np.array_equal(other.dataset.x_test, held)
    # Training draws its batches from the rest only; the final evaluation says what it evaluated.
    with Trainer(Config(**{**SMALL, "quiet": False}, data=str(path), validation_split=0.2, seed=3, steps=2,
                        logdir=str(tmp_path / "run"))) as tr:
        assert len(tr.dataset.x) == len(x) - k
        tr.fit()
    assert f"on {k} held-out training examples (validation_split 0.2)" in capsys.readouterr().out
    assert "test_accuracy_ema" in records(tmp_path / "run")[-1]


def test_a_resume_with_another_seed_says_its_held_out_examples_were_trained_on(tmp_path, notices):
    """Before: `--validation-split 0.2`, then `--resume --seed 1` held out other examples, some of them trained on
    before, with only the notes of a seed and of "other examples" in the data."""
    path, _, _ = digits_without_test_split(tmp_path)
    with Trainer(Config(**SMALL, data=str(path), validation_split=0.2, steps=2, logdir=str(tmp_path / "run"))) as tr:
        tr.fit()
    notices.clear()
    with Trainer(Config(logdir=str(tmp_path / "run"), resume=True, steps=3, seed=1)):
        pass
    assert any("seed 0 -> 1; validation_split holds out other examples with another seed: some of them were "
               "trained on" in n for n in notices), notices
    notices.clear()
    with Trainer(Config(logdir=str(tmp_path / "run"), resume=True, steps=3, seed=0)):
        pass
    assert not any("holds out other examples" in n for n in notices), notices


def test_validation_split_is_refused_beside_test_data():
    with pytest.raises(UserError, match="validation_split holds out training examples as the test data, but the "
                                        "data has test data of its own"):
        Trainer(Config(**SMALL, validation_split=0.1))  # the digits have x_test/y_test
    with pytest.raises(UserError, match="validation_split must be a finite number in"):
        Trainer(Config(**SMALL, validation_split=1.0))


# -- fp16's skipped steps --------------------------------------------------------------------------------


def test_fp16_steps_skipped_for_overflow_are_reported(tmp_path, capsys):
    """--loss-scale-growth 1 doubles the scale after every clean step: overflows skip steps, and the run says so."""
    cfg = Config(**{**SMALL, "summary_every": 5}, precision="fp16", loss_scale_growth=1, steps=40, log_every=5,
                 logdir=str(tmp_path))
    with Trainer(cfg) as tr:
        result = tr.fit()
        skipped = int(tr.state_dict()["loss_scale/skipped"])
    assert skipped > 0
    assert result["skipped_steps"] == skipped and records(tmp_path)[-1]["skipped_steps"] == skipped
    logged = [r for r in records(tmp_path) if "loss" in r]
    assert logged[-1]["skipped_steps"] == skipped and "loss_scale" in logged[-1]
    assert scalars(tmp_path, "skipped_steps")[40] == skipped
    assert f"; {skipped} of 40 steps skipped for fp16 overflow (loss scale now" in capsys.readouterr().out


def test_an_fp32_run_reports_no_loss_scaling(tmp_path):
    with Trainer(Config(**SMALL, steps=2, logdir=str(tmp_path))) as tr:
        assert tr.loss_scaling() == {}
        assert "skipped_steps" not in tr.fit()


# -- the settings line and the reducer line --------------------------------------------------------------


def test_the_settings_line_and_the_reducer_line_name_precision_gradient_format_and_buckets():
    default = settings_line(Config().resolved())
    assert "precision" not in default and "allreduce" not in default
    line = settings_line(Config(precision="fp16", allreduce_dtype="bf16", allreduce_bucket_mib=4).resolved())
    assert line.endswith("precision fp16 (loss_scale_growth 2000), allreduce_dtype bf16, allreduce_bucket_mib 4")
    with Trainer(Config(**SMALL, precision="bf16", allreduce_dtype="bf16", allreduce_bucket_mib=0.5)) as tr:
        table = tr.executor.placement_text()
    assert "cpu (computes in bf16)" in table
    assert "on-device mean on cpu (2 towers), gradients rounded to bfloat16 first, in buckets of about 0.5 MiB" in table
