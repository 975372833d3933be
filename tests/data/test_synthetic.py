"""``--data synthetic``: random images and labels made once, in memory, for measuring a host without data."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import run_cli
from towers.data.loading import load_dataset
from towers.errors import UserError


def test_synthetic_data_is_random_images_of_the_size_and_classes_asked_made_from_the_seed():
    ds = load_dataset("synthetic:7", image_size="8,6,3", seed=3)
    assert ds.x.shape == (512, 8, 6, 3) and ds.x.dtype == np.uint8 and ds.num_classes == 7
    assert set(np.unique(ds.y)) == set(range(7)) and ds.x_test is None
    assert np.array_equal(ds.x, load_dataset("synthetic:7", image_size="8,6,3", seed=3).x)
    assert not np.array_equal(ds.x, load_dataset("synthetic:7", image_size="8,6,3", seed=4).x)
    big = load_dataset("synthetic", image_size="4,4,3")  # 1000 classes by default, every one present
    assert big.num_classes == 1000 and len(big.x) == 1000 and len(np.unique(big.y)) == 1000
    assert load_dataset("synthetic:2").example_shape == (224, 224, 3)  # ImageNet's training crop by default


@pytest.mark.parametrize("path, settings, needle", [
    ("synthetic:1", {}, "CLASSES a whole number from 2"),
    ("synthetic:x", {}, "give synthetic or synthetic:CLASSES"),
    ("synthetic:3", {"augment": "cifar"}, "augment or normalize does not apply"),
])
def test_synthetic_data_refuses_what_does_not_apply_in_one_line(path, settings, needle):
    with pytest.raises(UserError, match=needle):
        load_dataset(path, image_size="8,8,3", **settings)


def test_training_on_synthetic_data_logs_images_per_second_per_tower(tmp_path):
    res = run_cli("--data", "synthetic:10", "--image-size", "16,16,3", "--model", "resnet20", "--devices", "cpu",
                  "--n-gpu", "2", "--batch-size", "4", "--steps", "4", "--log-every", "2", "--summary-every", "0",
                  "--logdir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "per tower; " in res.stdout and "per tower on 2 towers" in res.stdout
    assert "no test data" in res.stdout
    with np.load(tmp_path / "final.npz") as z:
        assert z["params/fc/weights"].shape == (64, 10)



# Each built-in model at a size its layers allow (tests/nn/test_imagenet_models.py has the ImageNet ones at 224).
SIZES = {"mlp": "8,8,1", "lenet5": "28,28,1", "cifar10": "24,24,3", "resnet20": "8,8,3", "resnet32": "8,8,3",
         "resnet56": "8,8,3", "resnet50": "32,32,3", "resnet101": "32,32,3", "resnet152": "32,32,3",
         "vgg16": "32,32,3"}


def test_the_sizes_name_every_built_in_model():
    from towers.nn.models import MODELS

    assert set(SIZES) == set(MODELS)


@pytest.mark.parametrize("model", SIZES)
def test_every_built_in_model_trains_on_synthetic_data(model):
    from towers import Config, Trainer

    cfg = Config(model=model, data="synthetic:10", image_size=SIZES[model], devices="cpu", n_gpu=1, batch_size=2,
                 steps=2, quiet=True, summary_every=0, input_workers=0)
    with Trainer(cfg) as tr:
        tr.run_steps(2)
        assert tr.step == 2
        assert all(np.isfinite(w).all() for w in tr.get_weights().values())
