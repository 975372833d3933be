"""Recipes: learning-rate schedules, Nesterov momentum, the models' settings and their checks, parameter counts."""
from __future__ import annotations

import math

import numpy
import pytest

from towers.config import Config
from towers.errors import UserError
from towers.extensions import settings_line
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
