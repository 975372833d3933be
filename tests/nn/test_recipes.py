"""Recipes: learning-rate schedules, Nesterov momentum, the models' settings and their checks, parameter counts."""
from __future__ import annotations

import math

import numpy
import pytest

from towers.config import Config
from towers.errors import UserError
from towers.run.extensions import settings_line
from towers.nn.models import build_model, model_defaults
from towers.optim.ema import EMA
from towers.optim.optimizers import SGD
from towers.optim.schedule import learning_rate, make_schedule


def _lr(step, **kw):
    return make_schedule(Config(**kw).resolved(), n_examples=1000, examples_per_step=200)(step)


def test_default_schedule_is_todays_exponential_decay_exactly():
    for kw in (dict(), dict(staircase=True), dict(model="lenet5", optimizer="sgd")):
        cfg = Config(**kw).resolved()
        lr = make_schedule(cfg, 1000, 200)
        for step in (0, 1, 7, 123):
            assert lr(step) == learning_rate(cfg.lr, cfg.lr_decay, step * 200, 1000, cfg.staircase)


def test_decay_steps_counts_steps_as_tensorflow_exponential_decay():
    """TF's exponential_decay(lr, global_step, decay_steps, rate, staircase), whatever the step's size."""
    kw = dict(lr=0.5, lr_decay=0.9, decay_steps=30)
    for step in (0, 1, 29, 30, 45, 300):
        assert _lr(step, **kw) == pytest.approx(0.5 * 0.9 ** (step / 30))
        assert _lr(step, staircase=True, **kw) == pytest.approx(0.5 * 0.9 ** (step // 30))
    assert make_schedule(Config(**kw).resolved(), 60000, 50)(45) == _lr(45, **kw)  # not counted in examples
    assert "lr_decay 0.9 per 30 steps staircase," in settings_line(Config(staircase=True, **kw).resolved())
    with pytest.raises(UserError, match="decay_steps.? and .?staircase.? are exponential"):
        Config(lr_schedule="cosine", decay_steps=30).resolved()
    with pytest.raises(UserError, match="decay_steps"):
        Config(decay_steps=0).resolved()


def test_piecewise_cosine_and_warmup():
    kw = dict(lr_boundaries="10,20", lr_values="0.5,0.05,0.005")
    assert [_lr(s, **kw) for s in (0, 9, 10, 19, 20, 10**6)] == [0.5, 0.5, 0.05, 0.05, 0.005, 0.005]
    # Without values: lr divided by 10 at each boundary (He et al.); resnets default to 32k and 48k steps.
    assert [_lr(s, model="resnet20") for s in (0, 31999, 32000, 48000)] == pytest.approx([0.1, 0.1, 0.01, 0.001])
    cos = dict(lr=0.4, lr_schedule="cosine", steps=100)
    assert [_lr(s, **cos) for s in (0, 50, 100, 200)] == pytest.approx([0.4, 0.2, 0.0, 0.0])
    assert _lr(25, **cos) == pytest.approx(0.4 * (1 + math.cos(math.pi / 4)) / 2)
    warm = dict(lr=0.4, lr_schedule="cosine", steps=100, warmup_steps=4)
    assert [_lr(s, **warm) / _lr(s, **cos) for s in (0, 1, 3, 4, 50)] == pytest.approx([0.25, 0.5, 1, 1, 1])
    assert _lr(0, lr=0.8, warmup_steps=10) == pytest.approx(0.08)  # warm-up on exponential decay too


def test_schedule_settings_checks():
    for kw, msg in [(dict(lr_boundaries="10,5"), "increasing"), (dict(lr_boundaries="10", lr_values="1,2,3"), "2 numbers"),
                    (dict(lr_boundaries="a"), "comma-separated"), (dict(lr_schedule="cosine", lr_decay=0.9), "exponential"),
                    (dict(lr_schedule="cosine", lr_boundaries="5"), "piecewise"), (dict(lr_schedule="piecewise"), "needs"),
                    (dict(lr=0.5, lr_values="0.2,0.1", lr_boundaries="3"), "disagree"),
                    (dict(lr_schedule="linear"), "unknown"), (dict(warmup_steps=-1), "warmup_steps"),
                    (dict(label_smoothing=1.0), "label_smoothing"), (dict(nesterov=True), "momentum"),
                    (dict(sync_bn="yes"), "sync_bn")]:
        with pytest.raises(UserError, match=msg):
            Config(**kw).resolved()
    cfg = Config(lr_values="0.3,0.03", lr_boundaries="100").resolved()
    assert (cfg.lr, cfg.lr_schedule, cfg.lr_decay) == (0.3, "piecewise", 1.0)


def test_models_defaults():
    r = Config(model="resnet56").resolved()
    assert (r.optimizer, r.lr, r.momentum, r.l2, r.lr_schedule, r.lr_boundaries, r.nesterov) == (
        "sgd", 0.1, 0.9, 1e-4, "piecewise", "32000,48000", False)
    c = Config(model="cifar10").resolved()
    assert (c.optimizer, c.lr, c.l2, c.lr_schedule) == ("sgd", 0.1, 0.004, "exponential")
    assert c.lr_decay ** 350 == pytest.approx(0.1)  # the tutorial's 10x every 350 epochs
    for spec in ("mlp", "lenet5"):  # unchanged
        m = Config(model=spec).resolved()
        assert m.l2 == 1e-4 and m.lr_schedule == "exponential"
    assert model_defaults("mlp", None) == ("sgd", {"lr": 0.8, "lr_decay": 0.99, "momentum": 0.0, "l2": 1e-4})
    assert Config(model="resnet20", lr_schedule="cosine").resolved().lr_boundaries is None


@pytest.mark.parametrize("spec,count", [("resnet20", 269_722), ("resnet32", 464_154), ("resnet56", 853_018)])
def test_resnet_parameter_counts(spec, count):
    m = build_model(spec, (32, 32, 3), 10)
    assert m.size == m.n_trainable == count
    n = (int(spec[6:]) - 2) // 6
    assert m.buffer_size == 2 * (16 + sum(f * 2 * n for f in (16, 32, 64)))  # moving mean and variance per BN


def test_models_take_any_image_shape_and_class_count():
    for spec in ("cifar10", "resnet20", "mlp", "lenet5"):
        for shape in ((28, 28), (24, 24, 3), (9, 13, 2)):
            m = build_model(spec, shape, 7)
            assert m.output_shape == (7,)
    names = {n for n, *_ in build_model("cifar10", (24, 24, 3), 10).layout()}
    assert names == {f"{s}/{k}" for s in ("conv1", "conv2", "local3", "local4", "softmax_linear")
                     for k in ("weights", "biases")}
    assert build_model("cifar10", (24, 24, 3), 10).size == 1_068_298  # the tutorial's count
    reg = [n for n, *_ in build_model("cifar10", (24, 24, 3), 10).layout()][:2]
    assert reg == ["local3/weights", "local4/weights"]  # weight decay on these only, as in the tutorial


def test_resnet_l2_skips_biases_and_batch_norm():
    m = build_model("resnet20", (32, 32, 3), 10)
    reg = {n for n, *_ in m.layout()[:sum(1 for _, _, p in m.params if p.regularize)]}
    assert all(n.endswith("weights") for n in reg) and "fc/weights" in reg
    assert sum(numpy.prod(s) for n, s, *_ in m.layout() if n in reg) == m.n_regularized
    assert not any("bn" in n for n in reg)


def _hand_nesterov(p, v, g, lr, mu):
    v = mu * v + g
    return p - lr * (g + mu * v), v


def test_nesterov_matches_hand_computation_and_its_ema():
    rng = numpy.random.default_rng(0)
    p0 = rng.normal(size=50).astype(numpy.float32)
    params = p0.copy()
    ema = EMA(params, 0.99)
    opt = SGD(params, momentum=0.9, ema=ema, nesterov=True)
    p, v, e = p0.astype(numpy.float64), numpy.zeros(50), p0.astype(numpy.float64)
    for step in range(3):
        g = rng.normal(size=50).astype(numpy.float32)
        opt.step(g, 0.1, step)
        p, v = _hand_nesterov(p, v, g.astype(numpy.float64), 0.1, 0.9)
        d = min(0.99, (2 + step) / (11 + step))  # TF's global_step after the update
        e = e - (1 - d) * (e - p)
    numpy.testing.assert_allclose(params, p, rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(ema.shadow, e, rtol=1e-5, atol=1e-6)
    numpy.testing.assert_allclose(opt.velocity, v, rtol=1e-5, atol=1e-6)
    plain = SGD(p0.copy(), momentum=0.9)
    plain.step(numpy.ones(50, numpy.float32), 0.1, 0)
    assert not numpy.allclose(plain.params, p0 - 0.1 * (1 + 0.9))  # plain momentum steps by v alone
    # Every form (the GPU's kernel too) is derived from the one definition, which steps by g + mu * v_new:
    key = SGD(p0.copy(), 0.9, nesterov=True)._op.traced.key()
    assert key.startswith("p = (p - (((((momentum * mu) + g) * mu) + g) * lr))"), key


def test_the_settings_line_names_the_recipe_and_the_default_line_is_unchanged():

    assert settings_line(Config().resolved(), 397510) == (
        "settings: model mlp (397,510 trainable parameters), optimizer sgd, lr 0.8, lr_decay 0.99, momentum 0, "
        "batch 100/tower, l2 0.0001, ema_decay 0.99, steps 2000, sync grads")
    line = settings_line(Config(model="resnet20", nesterov=True, warmup_steps=5, label_smoothing=0.1, sync_bn=True,
                                lr_boundaries="100,200").resolved(), 269722)
    for part in ("model resnet20 (269,722 trainable parameters)", "lr_schedule piecewise 100,200 -> 0.1,0.01,0.001",
                 "warmup_steps 5", "nesterov", "label_smoothing 0.1", "sync_bn"):
        assert part in line, (part, line)
    assert "lr_decay" not in line
    assert "lr_schedule cosine" in settings_line(Config(model="resnet20", lr_schedule="cosine").resolved())


# -- the models' whole recipes (towers.nn.models.Recipe), in epochs -------------------------------------------


def _cifar_npz(path, n=200, shape=(32, 32, 3), dtype=numpy.uint8):
    rng = numpy.random.default_rng(0)
    numpy.savez(path, x=rng.integers(0, 256, (n,) + shape).astype(dtype), y=numpy.arange(n) % 10)
    return str(path)


def _built(**kw):
    from towers import Trainer

    with Trainer(Config(devices="cpu", quiet=True, summary_every=0, **kw)) as tr:
        return tr.cfg, tr.recipe, [tr.lr_at(s) for s in range(tr.cfg.steps + 1)], tr.global_batch


@pytest.mark.parametrize("towers", [1, 2])
def test_resnet20_on_32x32x3_images_takes_the_papers_recipe_in_epochs(tmp_path, towers):
    """Global batch 128 whatever the towers, lr 0.1 divided by 10 at epochs 91 and 136, 182 epochs, momentum 0.9,
    L2 1e-4, pad-and-crop augmentation: the step count and the drops follow the data set's size."""
    data = _cifar_npz(tmp_path / "c.npz", n=256)
    cfg, recipe, lrs, batch = _built(model="resnet20", data=data, n_gpu=towers)
    assert recipe.name.startswith("He et al.") and batch == 128 and cfg.batch_size == 128 // towers
    assert (cfg.augment, cfg.momentum, cfg.l2, cfg.epochs, cfg.steps) == ("cifar", 0.9, 1e-4, 182, 182 * 2)
    assert lrs[0] == lrs[181] == 0.1 and lrs[182] == pytest.approx(0.01)  # epoch 91 = step 182 (2 steps an epoch)
    assert lrs[271] == pytest.approx(0.01) and lrs[272] == pytest.approx(0.001)  # epoch 136


def test_the_recipe_stays_out_where_it_does_not_apply_and_given_flags_override_it(tmp_path):
    # Not 32x32x3 (the digits), a float 32x32x3 set's pixels, `recipe` none: the model's plain defaults, as before.
    for kw in (dict(), dict(data=_cifar_npz(tmp_path / "a.npz", n=128, shape=(32, 32, 1))),
               dict(data=_cifar_npz(tmp_path / "b.npz", n=128), recipe="none")):
        cfg, recipe, _, _ = _built(model="resnet20", steps=1, **kw)
        assert recipe is None and (cfg.batch_size, cfg.augment, cfg.lr_boundaries) == (100, "none", "32000,48000")
    # Flags given win: the batch, the steps, the schedule (whole), the augmentation.
    data = _cifar_npz(tmp_path / "c.npz", n=64)
    cfg, recipe, lrs, _ = _built(model="resnet20", data=data, n_gpu=2, batch_size=16, steps=8, lr_schedule="cosine")
    assert recipe is not None and (cfg.batch_size, cfg.steps, cfg.epochs, cfg.lr_schedule, cfg.lr_epochs) == (
        16, 8, None, "cosine", None)
    assert cfg.augment == "cifar" and lrs[8] == 0.0
    cfg, _, _, _ = _built(model="resnet20", data=data, steps=1, batch_size=16, augment="none", optimizer="adam")
    assert (cfg.augment, cfg.optimizer, cfg.lr, cfg.momentum) == ("none", "adam", 0.001, None)
    # Float examples of the recipe's shape: the recipe, but nothing to augment.
    cfg, recipe, _, _ = _built(model="resnet20", data=_cifar_npz(tmp_path / "f.npz", n=128, dtype=numpy.float32),
                               steps=1)
    assert recipe is not None and cfg.augment == "none" and cfg.lr_epochs == "91,136"


def test_the_imagenet_resnets_take_goyal_et_al_scaled_to_the_global_batch():
    from towers.nn.models import GOYAL, MODELS, TF_CIFAR10, model_recipe

    assert all(model_recipe(m, (64, 48, 3)) is GOYAL for m in ("resnet50", "resnet101", "resnet152"))
    assert model_recipe("resnet50", (28, 28)) is None and model_recipe("vgg16", (224, 224, 3)) is None
    assert MODELS["cifar10"].recipe is TF_CIFAR10
    cfg = Config(model="resnet50", n_gpu=2).resolved(recipe=GOYAL, towers=2)
    assert (cfg.batch_size, cfg.lr, cfg.momentum, cfg.l2, cfg.epochs, cfg.augment) == (32, 0.025, 0.9, 1e-4, 90,
                                                                                         "imagenet")
    lr = make_schedule(cfg, n_examples=6400, examples_per_step=64)  # 100 steps an epoch
    assert lr(0) == pytest.approx(0.025 / 500) and lr(499) == lr(2999) == pytest.approx(0.025)  # 5-epoch warm-up
    assert [lr(s) for s in (3000, 6000, 8000)] == pytest.approx([0.0025, 0.00025, 0.000025])  # epochs 30, 60, 80
    assert Config(model="resnet50", batch_size=64).resolved(recipe=GOYAL, towers=8).lr == pytest.approx(0.2)
    tf = Config(model="cifar10").resolved(recipe=TF_CIFAR10, towers=2)  # 128 a tower, /10 every 350 epochs
    assert (tf.batch_size, tf.momentum, tf.augment, tf.epochs) == (128, 0.0, "tf-cifar10", 2560)
    assert [make_schedule(tf, 256, 256)(s) for s in (349, 350, 700)] == pytest.approx([0.1, 0.01, 0.001])


def test_epoch_settings_are_checked():
    for kw, msg in [(dict(lr_epochs="30,20"), "increasing epochs"), (dict(lr_epochs="3", lr_boundaries="5"),
                                                                      "both given"),
                    (dict(warmup_epochs=2.0, warmup_steps=3), "both given"), (dict(warmup_epochs=-1.0), "warmup_epochs"),
                    (dict(lr_schedule="cosine", lr_epochs="5"), "piecewise"), (dict(recipe="paper"), "recipe")]:
        with pytest.raises(UserError, match=msg):
            Config(**kw).resolved()


def test_a_warm_up_given_as_none_turns_the_recipes_warm_up_off():
    """`--warmup-steps 0` or `--warmup-epochs 0` given: no warm-up, as a flag given overrides the recipe (the
    recipe's 5 epochs stayed with the first; the second was refused)."""
    from towers.nn.models import GOYAL

    for kw in (dict(warmup_steps=0), dict(warmup_epochs=0.0)):
        cfg = Config(model="resnet50", **kw).resolved(recipe=GOYAL, towers=2)
        lr = make_schedule(cfg, n_examples=6400, examples_per_step=64)
        assert not cfg.warmup_epochs and lr(0) == lr(499) == pytest.approx(0.025), kw
    assert Config(model="resnet50").resolved(recipe=GOYAL, towers=2).warmup_epochs == 5.0  # not given: the recipe's


def test_synthetic_data_keeps_the_recipes_warm_up_and_drops_only_its_augmentation():
    """The Trainer drops the recipe's augmentation for data it cannot augment, and nothing else: the settings the
    user gave stay what they were (``warmup_steps`` not given: the recipe's warm-up)."""
    cfg, recipe, lrs, _ = _built(model="resnet50", data="synthetic:2", image_size="32,32,3", steps=3)
    assert recipe is not None and (cfg.augment, cfg.warmup_epochs, cfg.lr_epochs) == ("none", 5.0, "30,60,80")
    assert lrs[0] < lrs[1] < lrs[2]  # warming up
