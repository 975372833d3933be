"""The `input_scale` setting: uint8 pixels become float32 x 1/255 (the default) or x 1 (0..255, as TensorFlow's
multi-GPU example feeds them), in training, evaluation, prediction, ``normalize`` and a loaded run.

Before: uint8 was always divided by 255, with no way to turn it off.
"""
from __future__ import annotations

import numpy as np
import pytest

import towers
from tests.conftest import DIGITS
from towers import Config, Dataset, Trainer, UserError

SMALL = dict(n_gpu=2, devices="cpu", hidden=16, batch_size=50, quiet=True, summary_every=0, steps=8)


def digits():
    with np.load(DIGITS) as z:
        return {k: z[k] for k in z.files}


def test_input_scale_1_trains_on_uint8_pixels_as_the_same_values_in_float32(tmp_path):
    d = digits()
    as_floats = Dataset.from_arrays(d["x"].astype(np.float32), d["y"], d["x_test"].astype(np.float32), d["y_test"])
    with Trainer(Config(**SMALL, lr=0.001), dataset=as_floats) as tr:
        tr.run_steps(8)
        want = (tr.get_weights(ema=True), tr.evaluate(), tr.predict(d["x_test"].astype(np.float32)))
    pixels = Dataset.from_arrays(d["x"], d["y"], d["x_test"], d["y_test"])
    with Trainer(Config(**SMALL, lr=0.001, input_scale="1"), dataset=pixels) as tr:
        tr.run_steps(8)
        weights, evaluated, logits = tr.get_weights(ema=True), tr.evaluate(), tr.predict(d["x_test"])
    assert all(np.array_equal(weights[k], want[0][k]) for k in want[0])
    assert evaluated == want[1] and np.array_equal(logits, want[2])
    # The default divides by 255: another trajectory.
    with Trainer(Config(**SMALL, lr=0.001), dataset=pixels) as tr:
        tr.run_steps(8)
        assert not np.array_equal(tr.get_weights(ema=True)["layer1/weights"], weights["layer1/weights"])


def test_a_loaded_run_applies_its_input_scale_and_normalize_scales_by_it(tmp_path):
    # normalize "8,4" on the 0..255 scale is (x - 8) / 4: the model's inputs are those of normalize "8/255,4/255"
    # on the default scale.
    d = digits()
    logits = {}
    for name, settings in (("raw", dict(input_scale="1", normalize="8,4")),
                           ("unit", dict(normalize=f"{8 / 255},{4 / 255}"))):
        cfg = Config(**dict(SMALL, n_gpu=1), logdir=str(tmp_path / name), **settings)
        with Trainer(cfg) as tr:
            tr.fit()
            logits[name] = tr.predict()
        with towers.load(tmp_path / name) as model:
            assert np.array_equal(model.predict(d["x_test"]), logits[name])
    assert np.allclose(logits["raw"], logits["unit"], rtol=1e-4, atol=1e-4)
    with towers.load(tmp_path / "raw") as model:
        with pytest.raises(UserError, match=r"^predict: x is float32, but this run takes uint8 pixels \(0..255\) and "
                                            r"scales \(input_scale 1\), normalizes \(normalize 8,4\) and fits itself"):
            model.predict(d["x_test"].astype(np.float32))


def test_input_scale_is_one_of_its_values():
    with pytest.raises(UserError, match=r"input_scale '255' is unknown: use one of 1/255, 1"):
        Config(input_scale="255").resolved()
