"""Predictions: ``Trainer.predict`` and ``towers.softmax``.

Before: the logits were reachable only through ``tr.replicas[0].forward(...)`` (a tower's raw weights, no
EMA, no uint8 scaling, one batch at a time).
"""
from __future__ import annotations

import numpy as np
import pytest

import towers
from conftest import DIGITS
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
