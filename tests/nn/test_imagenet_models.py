"""The ImageNet-class models (``resnet50``, ``resnet101``, ``resnet152``, ``vgg16``): torchvision's parameter
counts and names, their gradients, and a few CPU steps in which the loss falls (small images, reduced widths
where the full model is too slow for the suite)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.nn.test_model import numeric_grad_check
from towers import Config, Dataset, Trainer
from towers.nn.models import bottleneck_resnet, build_model, vgg16

# torchvision 0.2x: sum(p.numel() for p in torchvision.models.NAME().parameters()) at 1000 classes.
TORCHVISION_COUNTS = {"resnet50": 25_557_032, "resnet101": 44_549_160, "resnet152": 60_192_808,
                      "vgg16": 138_357_544}


@pytest.mark.parametrize("name", sorted(TORCHVISION_COUNTS))
def test_parameter_counts_are_torchvisions_at_224(name):
    model = build_model(name, (224, 224, 3), 1000)
    assert model.size == TORCHVISION_COUNTS[name]


def test_names_are_torchvisions_state_dict_keys():
    names = {n for _, n, _ in build_model("resnet50", (64, 64, 3), 10).params}
    for key in ("conv1/weights", "bn1/gamma", "bn1/moving_variance", "layer1/0/conv1/weights",
                "layer1/0/downsample/0/weights", "layer1/0/downsample/1/beta", "layer2/3/bn3/gamma",
                "layer4/2/conv3/weights", "fc/weights", "fc/biases"):
        assert key in names, key
    assert "layer1/1/downsample/0/weights" not in names  # the identity where the shape holds
    shapes = {n: p.shape for _, n, p in build_model("resnet50", (64, 64, 3), 10).params}
    assert shapes["layer2/0/conv2/weights"] == (3, 3, 128, 128)  # v1.5: the stride is on this 3x3
    vgg = {n for _, n, _ in build_model("vgg16", (32, 32, 3), 10).params}
    assert {"features/0/weights", "features/28/biases", "classifier/0/weights", "classifier/6/biases"} <= vgg


@pytest.mark.parametrize("shape", [(64, 64, 3), (37, 45, 1), (20, 20)])
def test_any_image_size_the_layers_allow_and_any_class_count(shape):
    for name in ("resnet50", "vgg16"):
        assert build_model(name, shape, 7).output_shape == (7,)


def test_v1_5_strides_the_3x3_and_the_blocks_are_torchvisions():
    model = build_model("resnet50", (64, 64, 3), 10)
    block = next(layer for layer in model.layers if getattr(layer, "scope", None) == "layer2/0")
    assert [getattr(l, "stride", None) for l in block.body if hasattr(l, "k")] == [1, 2, 1]
    assert [l.stride for l in block.short_layers if hasattr(l, "k")] == [2]
    assert block.body[1].epsilon == 1e-5 and block.body[1].momentum == 0.9


def test_zero_init_residual_starts_each_blocks_last_gamma_at_zero():
    plain = bottleneck_resnet((1, 1, 1, 1), width=4)((32, 32, 3), 3).build((32, 32, 3))
    zeroed = bottleneck_resnet((1, 1, 1, 1), width=4, zero_init_residual=True)((32, 32, 3), 3).build((32, 32, 3))
    flat, layout = zeroed.init_params(0), {n: (o, s) for n, _, o, s in zeroed.layout()}
    for name, (off, size) in layout.items():
        values = flat[off: off + size]
        if name.endswith("bn3/gamma"):
            assert not values.any(), name
        elif name.endswith("gamma"):
            assert (values == 1).all(), name
    assert zeroed.size == plain.size


def test_gradients_match_finite_differences_at_a_reduced_width():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, 3)
    resnet = bottleneck_resnet((1, 1, 1, 1), width=2)((16, 16, 3), 3).build((16, 16, 3))
    assert numeric_grad_check(resnet, rng.normal(size=(3, 16, 16, 3)), y, l2=0.01, probes=20)[1] < 1e-4
    vgg = vgg16((8, 8, 3), 3, width=4, hidden=6).build((8, 8, 3))
    for layer in vgg.layers:  # dropout draws a new mask per call: off for the finite differences
        if hasattr(layer, "rate"):
            layer.rate = 0.0
    assert numeric_grad_check(vgg, rng.normal(size=(3, 8, 8, 3)), y, l2=0.01, probes=20)[1] < 1e-3


def _images(n=4, size=32):
    """``n`` 3-channel images whose class (0 or 1) is their brightness."""
    rng = np.random.default_rng(0)
    y = np.arange(n) % 2
    return (rng.integers(0, 128, (n, size, size, 3)) + 100 * y[:, None, None, None]).astype(np.uint8), y


@pytest.mark.parametrize("name, model", [
    ("resnet50", None),
    ("resnet101", lambda: bottleneck_resnet((3, 4, 23, 3), width=8, zero_init_residual=True)((32, 32, 3), 2)),
    ("resnet152", lambda: bottleneck_resnet((3, 8, 36, 3), width=8, zero_init_residual=True)((32, 32, 3), 2)),
])
def test_each_resnet_trains_on_the_cpu_and_its_loss_falls(name, model):
    """ResNet-50 itself (23.5M parameters at 2 classes) on 32x32 images; 101 and 152 at 1/8 of the width, their
    blocks started as the identity (``zero_init_residual``: at batch 4 the plain start is too noisy to judge)."""
    x, y = _images()
    lr, steps = (0.002, 4) if model is None else (0.005, 6)
    cfg = Config(devices="cpu", n_gpu=1, model=name, batch_size=4, steps=steps, lr=lr, quiet=True, summary_every=0)
    with Trainer(cfg, dataset=Dataset.from_arrays(x, y), model=model() if model else None) as tr:
        losses = [float(np.asarray(tr.train_step(x, y, want_loss=True)[0])) for _ in range(steps)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_vgg16_trains_on_the_cpu_and_its_loss_falls():
    x, y = _images()
    cfg = Config(devices="cpu", n_gpu=1, model="vgg16", batch_size=4, steps=20, lr=0.01, quiet=True, summary_every=0)
    with Trainer(cfg, dataset=Dataset.from_arrays(x, y), model=vgg16((32, 32, 3), 2, width=32, hidden=256)) as tr:
        before = tr.evaluate(ema=False, x=x, y=y)["loss"]
        tr.run_steps(20)
        after = tr.evaluate(ema=False, x=x, y=y)["loss"]
    assert after < 0.9 * before, (before, after)


def test_zero_init_residual_is_refused_for_models_without_bottleneck_blocks():
    from towers.errors import UserError

    for spec in ("resnet20", "vgg16", [bottleneck_resnet((1, 1, 1, 1), width=2)((16, 16, 3), 2)]):
        with pytest.raises(UserError, match="zero_init_residual applies to resnet50, resnet101, resnet152"):
            build_model(spec if isinstance(spec, str) else spec[0], (16, 16, 3), 2, zero_init_residual=True)
    assert build_model("resnet101", (16, 16, 3), 2, zero_init_residual=True).output_shape == (2,)
