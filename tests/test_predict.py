"""Predictions: ``Trainer.predict``, ``towers.softmax``, ``towers.load`` of a finished run, ``towers.eval --predict``.

Before: the logits were reachable only through ``tr.replicas[0].forward(...)`` (a tower's raw weights, no
EMA, no uint8 scaling, one batch at a time), and a finished run was loaded only by ``towers.eval``.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import towers
from tests.conftest import DIGITS, run_cli
from towers import BatchNorm, Config, Dataset, Dense, Flatten, ReLU, Trainer, TrainingError, UserError

SMALL = dict(n_gpu=2, devices="cpu", hidden=16, batch_size=50, quiet=True, summary_every=0)


def digits():
    with np.load(DIGITS) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 30-step run on the digits (its checkpoints, final.npz), and the live Trainer's logits of the
    test data with both weights, taken before it closed."""
    logdir = tmp_path_factory.mktemp("run") / "a"
    d = digits()
    with Trainer(Config(**SMALL, steps=30, checkpoint_every=10, logdir=str(logdir))) as tr:
        tr.fit()
        logits = {ema: tr.predict(d["x_test"], ema=ema) for ema in (True, False)}
        weights = tr.get_weights(ema=True)
    return logdir, logits, weights


def test_predict_gives_host_float32_logits_whose_argmax_accuracy_is_evaluates(run):
    d = digits()
    with Trainer(Config(**SMALL, steps=30)) as tr:
        tr.run_steps(30)
        for ema in (True, False):
            logits = tr.predict(d["x_test"], ema=ema)
            assert type(logits) is np.ndarray and logits.dtype == np.float32 and logits.shape == (359, 10)
            accuracy = float(np.mean(logits.argmax(axis=1) == d["y_test"]))
            assert accuracy == tr.evaluate(ema=ema)["accuracy"] > 0.5
            assert np.array_equal(tr.predict(ema=ema), logits)  # no x: the test data
        # Any count, in chunks of any size: 7 examples a chunk give the same logits (to float32 rounding).
        chunked = tr.predict(d["x_test"], batch_size=7)
        assert np.allclose(chunked, tr.predict(d["x_test"]), rtol=1e-6, atol=1e-6)
        assert tr.predict(d["x_test"][:1]).shape == (1, 10) and tr.predict(d["x_test"][:0]).shape == (0, 10)
        assert tr.predict(list(d["x_test"][:3])).shape == (3, 10)  # a list of examples, as evaluate takes
        # EMA and raw weights differ: each is the one asked for.
        assert not np.array_equal(tr.predict(d["x_test"]), tr.predict(d["x_test"], ema=False))


def test_predict_of_a_batch_norm_model_uses_its_moving_statistics_and_matches_evaluate():
    d = digits()
    layers = [Flatten(), Dense("fc1", 32), BatchNorm("bn"), ReLU(), Dense("fc2", 10)]
    with Trainer(Config(**SMALL, steps=20), model=layers) as tr:
        tr.run_steps(20)
        logits = tr.predict(d["x_test"])
        assert float(np.mean(logits.argmax(axis=1) == d["y_test"])) == tr.evaluate()["accuracy"]
        # Evaluation mode: one example alone gets the logits it gets among the others (batch statistics would not).
        assert np.allclose(tr.predict(d["x_test"][5:6]), logits[5:6], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x, message", [
    (lambda d: d["x_test"][:5].reshape(5, -1)[:, :10], r"predict: examples are uint8 \(10,\), the data set's are "
                                                       r"uint8 \(8, 8\)"),
    (lambda d: d["x_test"][0], r"predict: x is one example of shape \(8, 8\): give a batch of shape \(N, 8, 8\) "
                               r"\(x\[None\] for one example\)"),
    # float pixels for a model trained on uint8 ones would not be scaled by 1/255
    (lambda d: d["x_test"][:5].astype(np.float32), "predict: test examples are float32 but training examples uint8"),
    (lambda d: d["x_test"][:5].astype(np.int64), "predict: key 'x' is int64; give uint8 pixels or float32"),
    (lambda d: np.float32(3), r"predict: x must be an array of examples, got float32 \(\)"),
])
def test_predict_checks_its_examples_as_evaluate_does(x, message):
    with Trainer(Config(**SMALL)) as tr:
        with pytest.raises(UserError, match=message):
            tr.predict(x(digits()))


def test_predict_refuses_non_finite_examples_a_bad_batch_size_and_names_diverged_weights():
    d = digits()
    scaled = {k: d[k].astype(np.float32) / 255 if k.startswith("x") else d[k] for k in d}
    ds = Dataset.from_arrays(scaled["x"], scaled["y"])  # no test data
    with Trainer(Config(**SMALL), dataset=ds) as tr:
        x = scaled["x_test"][:10].copy()
        x[3, 2, 1] = np.nan
        with pytest.raises(UserError, match=r"predict: key 'x' has 1 non-finite value \(NaN or inf\); the first in "
                                            r"example 3"):
            tr.predict(x)
        for bad in (0, 2.5, "10", None):
            with pytest.raises(UserError, match="predict: batch_size must be an integer >= 1, got "):
                tr.predict(scaled["x_test"], batch_size=bad)
        with pytest.raises(UserError, match="predict: no test data to predict: give x"):
            tr.predict()
    with Trainer(Config(**SMALL, lr=1e6), dataset=ds) as tr:
        tr.run_steps(20)  # diverges: the weights hold NaN, so would every logit
        with pytest.raises(TrainingError, match=r"predict: the EMA weights hold NaN or inf \('layer1/weights'\): "
                                                "training diverged"):
            tr.predict(scaled["x_test"])


def test_softmax_gives_probabilities_without_overflow_and_keeps_the_argmax():
    logits = np.array([[1000.0, 0.0, -1000.0], [1.0, 2.0, 3.0], [-50.0, -50.0, -50.0]], np.float64)
    p = towers.softmax(logits)
    assert p.dtype == np.float32 and np.all(np.isfinite(p))
    assert np.allclose(p.sum(axis=1), 1.0, atol=1e-6)
    assert np.array_equal(p.argmax(axis=1), logits.argmax(axis=1))
    assert np.allclose(p[0], [1, 0, 0]) and np.allclose(p[2], 1 / 3)
    e = np.exp(logits[1] - 3)
    assert np.allclose(p[1], e / e.sum(), rtol=1e-6)
    assert np.allclose(towers.softmax(logits.T, axis=0), p.T)


def test_load_of_a_finished_run_predicts_the_live_trainers_logits(run):
    logdir, logits, weights = run
    x = digits()["x_test"]
    for source in (logdir, logdir / "final.npz", logdir / "ckpt-00000030.npz", str(logdir)):
        with towers.load(source) as model:
            assert isinstance(model, towers.Predictor) and model.step == 30
            assert repr(model) == (f"<towers.Predictor {os.path.basename(model.path)} (step 30): mlp, examples (8, 8) "
                                   f"uint8 -> 10 classes, on {model.device}>")
            assert model.example_shape == (8, 8) and model.example_dtype == np.uint8 and model.num_classes == 10
            for ema in (True, False):
                assert np.array_equal(model.predict(x, ema=ema), logits[ema]), (source, ema)
            assert np.array_equal(model.predict(), logits[True])  # no x: the run's test data
            got = model.evaluate()
            assert got["accuracy"] == float(np.mean(logits[True].argmax(axis=1) == digits()["y_test"]))
            assert model.get_weights(ema=True).keys() == weights.keys()
            assert all(np.array_equal(model.get_weights(ema=True)[k], weights[k]) for k in weights)
    with towers.load(logdir / "ckpt-00000010.npz") as early:  # an earlier checkpoint: its own weights
        assert early.step == 10 and not np.array_equal(early.predict(x), logits[True])


def test_load_needs_no_training_data_and_checks_inputs_against_the_checkpoint(tmp_path):
    d = digits()
    scaled = {k: d[k].astype(np.float32) / 16 if k.startswith("x") else d[k] for k in d}
    np.savez(tmp_path / "train.npz", x=scaled["x"], y=scaled["y"])
    np.savez(tmp_path / "test.npz", x=scaled["x_test"], y=scaled["y_test"])
    cfg = Config(**SMALL, steps=20, data=str(tmp_path / "train.npz"), test_data=str(tmp_path / "test.npz"),
                 logdir=str(tmp_path / "run"))
    with Trainer(cfg) as tr:
        tr.fit()
        want, evaluated = tr.predict(scaled["x_test"]), tr.evaluate()
    os.unlink(tmp_path / "train.npz")  # gone: the checkpoint describes the data
    with towers.load(tmp_path / "run") as model:
        assert model.example_dtype == np.float32
        assert np.array_equal(model.predict(scaled["x_test"].astype(np.float64)), want)  # float64: taken as float32
        assert model.evaluate() == evaluated  # the run's --test-data, read alone
        assert model.evaluate(x=scaled["x_test"], y=scaled["y_test"]) == evaluated
        for call, message in [
            (lambda: model.predict(d["x_test"]), "predict: test examples are uint8 but training examples float32"),
            (lambda: model.evaluate(x=scaled["x_test"][:5], y=np.full(5, 10)), "evaluate: labels must be integers "
                                                                              "0..9"),
            (lambda: model.evaluate(x=scaled["x_test"][:5]), "evaluate: give both x and y"),
            (lambda: model.predict(scaled["x_test"][:, :4]), r"examples are float32 \(4, 8\), the data set's are "
                                                             r"float32 \(8, 8\)"),
        ]:
            with pytest.raises(UserError, match=message):
                call()


def test_load_of_a_validation_split_run_evaluates_the_examples_it_held_out(tmp_path):
    """Before: `train.npz has no x_test/y_test: give test data`, from towers.load and towers.eval alike."""
    d = digits()
    np.savez(tmp_path / "train.npz", x=d["x"], y=d["y"])  # no test split of its own
    cfg = Config(**SMALL, steps=10, data=str(tmp_path / "train.npz"), validation_split=0.2,
                 logdir=str(tmp_path / "run"))
    with Trainer(cfg) as tr:
        tr.fit()
        evaluated = {ema: tr.evaluate(ema=ema) for ema in (True, False)}
        n = len(tr.dataset.y_test)
    assert n == round(0.2 * len(d["y"]))
    with towers.load(tmp_path / "run") as model:
        assert len(model.test_data().y) == n
        for ema in (True, False):  # one tower here, two there: equal up to the sum's rounding
            got = model.evaluate(ema=ema)
            assert got["accuracy"] == evaluated[ema]["accuracy"]
            assert got["loss"] == pytest.approx(evaluated[ema]["loss"], rel=1e-5)
    p = run_cli("--logdir", str(tmp_path / "run"), module="towers.eval")
    assert p.returncode == 0, p.stderr
    assert f"accuracy = {evaluated[True]['accuracy']:.4f} on {n} test examples (EMA weights)" in p.stdout
    x = d["x"].copy()
    x[0] = 15 - x[0]  # one example changed: the split no longer finds the same examples to hold out
    np.savez(tmp_path / "train.npz", x=x, y=d["y"])
    p = run_cli("--logdir", str(tmp_path / "run"), module="towers.eval")
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert "changed since (other examples)" in p.stderr and "give test data" in p.stderr
    os.unlink(tmp_path / "train.npz")
    with pytest.raises(UserError, match=r"held out .?validation_split.? 0.2 of .?data.? .*train.npz as its test "
                                        r"data, which cannot be read again \(.*does not exist"):
        towers.load(tmp_path / "run").evaluate()


def test_load_of_a_model_object_run_takes_the_model_again(tmp_path):
    d = digits()

    def layers():
        return [Flatten(), Dense("fc1", 32), BatchNorm("bn"), ReLU(), Dense("fc2", 10)]
    with Trainer(Config(**SMALL, steps=20, logdir=str(tmp_path / "run")), model=layers()) as tr:
        tr.fit()
        want = tr.predict(d["x_test"])
    with pytest.raises(UserError, match=r"was trained with a model object handed to the Trainer, which a checkpoint "
                                        r"does not hold: give it again in Python, towers.load\(.*, model=\.\.\.\)"):
        towers.load(tmp_path / "run")
    with towers.load(tmp_path / "run", model=layers()) as model:  # buffers too: the moving statistics
        assert np.array_equal(model.predict(d["x_test"]), want)


def test_load_errors_are_one_line(run, tmp_path):
    logdir = run[0]

    def error(source):
        with pytest.raises(UserError) as e:
            towers.load(source)
        assert "\n" not in str(e.value)
        return str(e.value)
    assert error(tmp_path / "missing") == (f"towers.load: {tmp_path / 'missing'} does not exist: give a run's logdir, "
                                           "one of its ckpt-*.npz, or its final.npz")
    (tmp_path / "empty").mkdir()
    assert error(tmp_path / "empty").startswith(f"towers.load: no checkpoint in {tmp_path / 'empty'}: give a run's")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "ckpt-00000005.npz").write_bytes(b"not a zip")
    assert error(bad) == (f"none of the 1 checkpoints in {bad} can be read (newest: {bad / 'ckpt-00000005.npz'}): "
                          f"nothing to load; towers.load('{bad / 'ckpt-00000005.npz'}') says why it fails")
    assert "is not a readable checkpoint" in error(bad / "ckpt-00000005.npz")
    alone = tmp_path / "final.npz"  # away from its run: nothing says which model or data it is
    shutil.copy(logdir / "final.npz", alone)
    assert "the checkpoint of its step, which has the run's settings, is not beside it" in error(alone)


def test_load_of_a_logdir_skips_an_unreadable_newest_checkpoint_with_a_notice(run, tmp_path, notices):
    logdir = tmp_path / "run"
    shutil.copytree(run[0], logdir)
    (logdir / "ckpt-00000040.npz").write_bytes(b"cut short")
    with towers.load(logdir) as model:
        assert model.step == 30 and np.array_equal(model.predict(digits()["x_test"]), run[1][True])
    assert any("ckpt-00000040.npz is unreadable" in line for line in notices), notices


@pytest.mark.parametrize("settings", [dict(normalize="0.5,0.25"),
                                      dict(normalize="8,4", input_scale="1", augment="imagenet")])
def test_load_of_an_image_run_predicts_from_raw_pixels_as_the_trainer_does(tmp_path, settings):
    # Before: a --normalize run's loaded model refused the raw uint8 pixels and took x / 255 floats (unnormalized:
    # wrong logits, silently).  Now it takes the pixels and applies the run's transform: scale, normalize, and the
    # evaluation crop of its augmentation (imagenet: resize to H / 0.875, center crop), the Trainer's logits.
    d = digits()
    cfg = Config(**dict(SMALL, n_gpu=1), steps=10, logdir=str(tmp_path / "run"), **settings)
    with Trainer(cfg) as tr:
        tr.fit()
        want, evaluated = tr.predict(), tr.evaluate()  # its test data, made by its own loader
    with towers.load(tmp_path / "run") as model:
        assert model.example_dtype == np.uint8
        assert np.array_equal(model.predict(d["x_test"]), want)
        assert np.array_equal(model.predict(d["x_test"][..., None]), want)  # (N, H, W, 1) alike
        assert model.evaluate(x=d["x_test"], y=d["y_test"]) == evaluated
        for x in (d["x_test"] / 255, d["x_test"].astype(np.float32)):  # another scale: one line
            with pytest.raises(UserError, match=r"^predict: x is float\S+, but this run takes uint8 pixels \(0..255\) "
                                                r"and scales \(input_scale .*\)(, normalizes \(normalize 0.5,0.25\))? and fits "
                                                r"(\(augment imagenet\) )?"
                                                r"itself: give the raw uint8 pixels \(not scaled to 0..1, not "
                                                r"normalized\)$"):
                model.predict(x)
        with pytest.raises(UserError, match=r"^predict: x must be images \(N, H, W, 1\) or \(N, H, W\) of uint8 "
                                            r"pixels .*, got uint8 \(359, 8, 8, 3\)$"):
            model.predict(np.repeat(d["x_test"][..., None], 3, axis=3))


def test_eval_predict_writes_what_predict_gives(run, tmp_path):
    logdir, logits, _ = run
    y = digits()["y_test"]
    for flags, ema in (((), True), (("--no-ema",), False)):
        out = tmp_path / f"pred-{ema}.npz"
        p = run_cli("--logdir", str(logdir), "--predict", str(out), *flags, module="towers.eval")
        assert p.returncode == 0, p.stderr
        assert p.stdout.splitlines()[1] == (f"wrote {out}: logits and predicted classes of the 359 test examples "
                                            f"({'EMA' if ema else 'raw'} weights)")
        with np.load(out) as z:
            assert sorted(z.files) == ["classes", "labels", "logits", "predicted", "probabilities"]
            assert list(z["classes"]) == [str(k) for k in range(10)]
            assert np.array_equal(z["probabilities"], towers.softmax(logits[ema]))
            assert z["logits"].dtype == np.float32 and np.array_equal(z["logits"], logits[ema])
            assert z["predicted"].dtype == np.int64 and np.array_equal(z["predicted"], logits[ema].argmax(axis=1))
            assert np.array_equal(z["labels"], y)
        assert f"accuracy = {np.mean(logits[ema].argmax(axis=1) == y):.4f}" in p.stdout
    assert sorted(os.listdir(tmp_path)) == ["pred-False.npz", "pred-True.npz"]  # no temporary left


def test_eval_predict_errors_are_one_line_and_write_nothing(run, tmp_path):
    logdir = run[0]

    def error(*args):
        p = run_cli(*map(str, args), module="towers.eval")
        assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
        return p.stderr.strip()
    taken = tmp_path / "taken.npz"
    taken.write_bytes(b"mine")
    assert error("--logdir", logdir, "--predict", taken) == (
        f"towers.eval: error: {taken} exists: towers.eval writes no file over another; remove it or choose another "
        "--predict")
    assert taken.read_bytes() == b"mine"
    assert error("--logdir", logdir, "--predict", tmp_path / "no" / "p.npz") == (
        f"towers.eval: error: cannot write {tmp_path / 'no' / 'p.npz'}: {tmp_path / 'no'} does not exist; choose "
        "another --predict")
    assert "--predict writes one file, of one checkpoint: not with --watch" in error(
        "--logdir", logdir, "--predict", tmp_path / "w.npz", "--watch")
    # Before: `--predict ''` evaluated, wrote nothing and exited 0.
    assert error("--logdir", logdir, "--predict", "") == (
        "towers.eval: error: --predict is empty: give the output file's path")
    assert sorted(os.listdir(tmp_path)) == ["taken.npz"]


def test_a_text_file_as_a_checkpoint_is_said_to_be_no_npz_without_pickle_advice(tmp_path):
    # Before: NumPy's "contains pickled (object) data ... allow_pickle=" (it is no pickle; the advice is unsafe).
    text = tmp_path / "notes.txt"
    text.write_text("step 100: looks good\n")
    with pytest.raises(UserError) as e:
        towers.load(text)
    assert str(e.value) == (f"{text} is not a readable checkpoint (not an npz file: no zip header; give a run's "
                            "ckpt-*.npz or final.npz)")
    for module, args in (("towers.eval", ("--checkpoint", text)), ("towers.export", (text, "-o", tmp_path / "o"))):
        p = run_cli(*map(str, args), module=module)
        assert p.returncode == 2 and "pickle" not in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
        assert "not an npz file: no zip header" in p.stderr
    with pytest.raises(UserError, match=r"^towers.load: 5 \(int\) is not a path: give a run.s logdir"):
        towers.load(5)  # before: TypeError


def blas_limits() -> list[int]:
    from threadpoolctl import threadpool_info

    return [d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas"]


def test_a_loaded_run_chooses_its_kernels_and_blas_threads_as_a_trainer_of_one_tower(tmp_path):
    # Before: a loaded run kept whatever BLAS threads (every core: 2.3-2.5x slower beside a busy process) and
    # CPU kernels the process had; now it chooses them as the Trainer does (one code: choose_forms, limit_blas),
    # holds them while open and gives the BLAS threads back when closed.  Batch norm: `auto` takes numba.
    from towers.ops import forms

    pytest.importorskip("numba")
    d = digits()

    def layers():
        return [Flatten(), Dense("fc1", 32), BatchNorm("bn"), ReLU(), Dense("fc2", 10)]
    before = blas_limits()
    with Trainer(Config(**dict(SMALL, n_gpu=1), steps=10, logdir=str(tmp_path / "run")), model=layers()) as tr:
        tr.fit()
        want = (tr.cpu_kernels, tr.executor.blas_threads, blas_limits())
        logits = tr.predict(d["x_test"])
    assert want[0] == "numba" and set(want[2]) == {want[1]}
    with forms.host("numpy").active():  # a caller inside other forms (or none: a fresh thread)
        with towers.load(tmp_path / "run", model=layers()) as model:
            assert (model.cpu_kernels, model.blas_threads, blas_limits()) == want
            assert np.array_equal(model.predict(d["x_test"]), logits)  # batch norm: numba's bits
            assert model.forms.compiled and not forms.current().compiled  # its own, current only in its calls
        assert blas_limits()[:len(before)] == before  # (numba may have loaded a BLAS of its own since)


def test_eval_predict_of_unlabelled_data_writes_classes_probabilities_and_file_names(run, tmp_path):
    # Before: --predict took labelled test data only ("has no key 'y'", "holds no class folders", no label feature).
    from PIL import Image

    from tests.data.tfrecord.test_convert import example, write_records

    logdir, logits, _ = run
    d = digits()
    np.savez(tmp_path / "x.npz", x=d["x_test"])  # examples alone
    write_records(tmp_path / "x.tfrecords", [example(x=row.tobytes()) for row in d["x_test"]])
    for data, flags in (("x.npz", ()), ("x.tfrecords", ("--decode", "x:uint8:8,8"))):
        out = tmp_path / f"{data}.pred.npz"
        p = run_cli("--logdir", str(logdir), "--test-data", str(tmp_path / data), "--predict", str(out), *flags,
                    module="towers.eval")
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == (f"ckpt-00000030.npz (step 30): wrote {out}: predicted classes and probabilities "
                                    "of 359 unlabelled examples (EMA weights)")
        with np.load(out) as z:
            assert sorted(z.files) == ["classes", "logits", "predicted", "probabilities"]
            assert np.array_equal(z["logits"], logits[True]) and list(z["classes"]) == [str(k) for k in range(10)]
            assert np.array_equal(z["probabilities"], towers.softmax(logits[True]))
    # A run trained from images predicts a folder of its own images (beside folders of more: all of them), named
    # by their paths below it.
    cfg = Config(**dict(SMALL, n_gpu=1), steps=10, normalize="0.5,0.25", logdir=str(tmp_path / "images"))
    with Trainer(cfg) as tr:
        tr.fit()
    folder = tmp_path / "unlabelled"
    (folder / "more").mkdir(parents=True)
    names = [f"{k:03d}.png" for k in range(5)] + ["more/a.png"]
    for name, pixels in zip(names, d["x_test"][:6]):
        Image.fromarray(pixels).save(folder / name)
    out = tmp_path / "folder.pred.npz"
    p = run_cli("--logdir", str(tmp_path / "images"), "--test-data", str(folder), "--predict", str(out),
                module="towers.eval")
    assert p.returncode == 0, p.stderr
    with np.load(out) as z, towers.load(tmp_path / "images") as model:
        assert list(z["files"]) == names
        assert np.array_equal(z["logits"], model.predict(d["x_test"][:6]))


def test_a_loaded_tf_cifar10_run_takes_the_center_crop_of_its_images_as_the_run_did(tmp_path):
    # Before: the test images were resized to the model's 24 x 24 and then cropped (nothing): towers.eval and
    # towers.load evaluated other images than the run's own evaluation (the center 24 x 24 of the 32 x 32).
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (60, 32, 32, 3), dtype=np.uint8), rng.integers(0, 3, 60)
    np.savez(tmp_path / "d.npz", x=x[:40], y=y[:40], x_test=x[40:], y_test=y[40:])
    cfg = Config(n_gpu=1, devices="cpu", hidden=8, batch_size=8, steps=3, quiet=True, summary_every=0,
                 augment="tf-cifar10", data=str(tmp_path / "d.npz"), logdir=str(tmp_path / "run"))
    with Trainer(cfg) as tr:
        tr.fit()
        want, evaluated = tr.predict(), tr.evaluate()
    with towers.load(tmp_path / "run") as model:
        assert model.evaluate() == evaluated
        assert np.array_equal(model.predict(x[40:]), want)


def test_eval_predict_of_a_folder_without_images_says_so(run, tmp_path):
    # Before: for a run trained on stored arrays, "D is a folder of images, but the model was trained on stored
    # arrays ...": it holds no image (and a folder of images is predicted, fitted to the model's examples).
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("no images here\n")
    p = run_cli("--logdir", str(run[0]), "--test-data", str(tmp_path / "notes"), "--predict",
                str(tmp_path / "p.npz"), module="towers.eval")
    assert p.returncode == 2 and p.stderr.strip() == (
        f"towers.eval: error: --test-data {tmp_path / 'notes'} holds no .jpg, .jpeg or .png images"), p.stderr
    assert not (tmp_path / "p.npz").exists()


def test_eval_predict_of_records_whose_labels_are_ambiguous_asks_for_them_as_evaluation_does(run, tmp_path):
    # Before: records with two int64 features (label, id) and no `y` were "unlabelled" to --predict (exit 0,
    # no evaluation, no labels written), while the same command without --predict asked which is the labels.
    from tests.data.tfrecord.test_convert import example, write_records

    logdir, logits, _ = run
    d = digits()
    records = tmp_path / "t.tfrecords"
    write_records(records, [example(x=row.tobytes(), label=int(k), id=i)
                            for i, (row, k) in enumerate(zip(d["x_test"], d["y_test"]))])
    common = ("--logdir", str(logdir), "--test-data", str(records), "--decode", "x:uint8:8,8")
    out = tmp_path / "p.npz"
    for predict in ((), ("--predict", str(out))):
        p = run_cli(*common, *predict, module="towers.eval")
        last = (p.stderr.strip().splitlines() or [""])[-1]  # (after the index's notice)
        assert p.returncode == 2 and "Traceback" not in p.stderr and last.startswith("towers.eval: error: ") and \
            "no feature 'y' and 2 candidates (id, label) for the labels; pick one with --y-key" in last, p.stderr
    assert not out.exists()
    p = run_cli(*common, "--y-key", "label", "--predict", str(out), module="towers.eval")
    assert p.returncode == 0, p.stderr
    with np.load(out) as z:
        assert np.array_equal(z["labels"], d["y_test"]) and np.array_equal(z["logits"], logits[True])


def test_a_loaded_image_run_refuses_one_image_without_its_batch_axis(tmp_path):
    # Before: one grey image (H, W, 1) was taken as H images (W, 1), fitted to the run's size: H rows of logits,
    # exit 0; one colour image (H, W, 3) as H grey images 3 pixels wide (a broadcast ValueError).
    d = digits()
    x = d["x_test"][:20]
    for name, pixels in (("grey", x[..., None]), ("colour", np.repeat(x[..., None], 3, axis=3))):
        data = tmp_path / f"{name}.npz"
        np.savez(data, x=np.concatenate([pixels] * 10), y=np.tile(d["y_test"][:20], 10))
        cfg = Config(n_gpu=1, devices="cpu", hidden=8, batch_size=20, steps=2, quiet=True, summary_every=0,
                     normalize="0.5,0.25", data=str(data), logdir=str(tmp_path / name))
        with Trainer(cfg) as tr:
            tr.fit()
        c = pixels.shape[-1]
        with towers.load(tmp_path / name) as model:
            assert model.predict(pixels).shape == (20, 10)
            assert np.allclose(model.predict(pixels[:1]), model.predict(pixels)[:1], rtol=1e-5, atol=1e-5)
            with pytest.raises(UserError, match=rf"^predict: x must be images \(N, H, W, {c}\)" + (
                    r" or \(N, H, W\)" if c == 1 else "") + rf" of uint8 pixels .*, got uint8 \(8, 8, {c}\): one "
                    r"image needs its batch axis \(x\[None\]\)$"):
                model.predict(pixels[0])


def test_eval_predict_of_a_synthetic_run_says_it_has_no_test_split_as_eval_does(tmp_path):
    # Before: with --predict, "test data file synthetic:10 does not exist: set --test-data to an .npz or TFRecord
    # file" (synthetic data is no file); without it, the line below.
    cfg = Config(n_gpu=1, devices="cpu", hidden=8, batch_size=8, steps=1, quiet=True, summary_every=0,
                 data="synthetic:10", image_size="8,8,3", logdir=str(tmp_path / "run"))
    with Trainer(cfg) as tr:
        tr.fit()
    for predict in ((), ("--predict", str(tmp_path / "p.npz"))):
        p = run_cli("--logdir", str(tmp_path / "run"), *predict, module="towers.eval")
        assert p.returncode == 2 and p.stderr.strip() == (
            "towers.eval: error: synthetic:10 has no test split: give test data (--test-data)"), p.stderr
    assert not (tmp_path / "p.npz").exists()


def test_eval_predict_of_a_folder_never_puts_another_images_logits_on_a_files_row(tmp_path):
    # Before: for a run trained with on_error skip, an image of the folder that does not decode was replaced by
    # another one: its row (files: 000.png) held the other image's logits, exit 0, a notice on stderr alone.
    from PIL import Image

    d = digits()
    cfg = Config(**dict(SMALL, n_gpu=1), steps=2, normalize="0.5,0.25", on_error="skip", logdir=str(tmp_path / "run"))
    with Trainer(cfg) as tr:
        tr.fit()
    folder = tmp_path / "photos"
    folder.mkdir()
    for k in range(4):
        Image.fromarray(d["x_test"][k]).save(folder / f"{k:03d}.png")
    (folder / "000.png").write_bytes(b"not an image")
    out = tmp_path / "p.npz"
    p = run_cli("--logdir", str(tmp_path / "run"), "--test-data", str(folder), "--predict", str(out),
                module="towers.eval")
    assert p.returncode == 1 and not out.exists(), (p.returncode, p.stderr)
    assert p.stderr.strip().splitlines()[-1].startswith(f"towers.eval: error: {folder / '000.png'}: not a "
                                                        "decodable image"), p.stderr
