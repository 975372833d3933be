"""Learning-rate schedule, the optimizers (SGD, Adam, AdamW, RMSProp) and the EMA against hand computations."""
import math

import numpy as np
import pytest

from towers import Config, UserError
from towers.optim.ema import EMA, ema_decay
from towers.optim.optimizers import SGD, Adam
from towers.optim.schedule import learning_rate


def test_exponential_decay_matches_tensorflow_formula():
    assert learning_rate(0.8, 0.99, 0, 1000) == 0.8
    assert math.isclose(learning_rate(0.8, 0.99, 1500, 1000), 0.8 * 0.99 ** 1.5)
    assert math.isclose(learning_rate(0.8, 0.99, 1500, 1000, staircase=True), 0.8 * 0.99)
    assert math.isclose(learning_rate(0.8, 0.99, 2999, 1000, staircase=True), 0.8 * 0.99 ** 2)


def test_ema_decay_warms_up_like_tensorflow():
    assert ema_decay(0.99, 1) == 2 / 11
    assert ema_decay(0.99, 10) == 11 / 20
    assert ema_decay(0.99, 10**6) == 0.99


def test_first_update_reads_the_incremented_step_as_tensorflow_does():
    """TF's EMA runs after apply_gradients has made global_step 1: the first update's decay is 2/11, not 1/10."""
    p0 = np.array([1.0, -2.0, 0.5], np.float32)
    params = p0.copy()
    ema = EMA(params, 0.99)
    g = np.array([1.0, 1.0, -1.0], np.float32)
    SGD(params, ema=ema).step(g, 0.5, 0)
    d = 2 / 11
    np.testing.assert_allclose(ema.shadow, p0 - (1 - d) * (p0 - params), rtol=1e-6)
    assert not np.allclose(ema.shadow, p0 - 0.9 * (p0 - params), rtol=1e-3)


def hand_run(p0, grads, lrs, momentum, decay):
    """Plain-Python float64 reference of SGD(+momentum) and TF's EMA."""
    p = [float(v) for v in p0]
    v = [0.0] * len(p)
    e = list(p)
    for step, (g, lr) in enumerate(zip(grads, lrs)):
        d = min(decay, (2 + step) / (11 + step))  # TF's global_step after this update: step + 1
        for i in range(len(p)):
            if momentum:
                v[i] = momentum * v[i] + g[i]
                upd = v[i]
            else:
                upd = g[i]
            p[i] -= lr * upd
            e[i] -= (1 - d) * (e[i] - p[i])
    return np.array(p), np.array(e)


def run_steps(seed, size, steps, lr0, make):
    """Random float32 weights and gradients; ``make(params, ema)`` builds the optimizer; run it."""
    rng = np.random.default_rng(seed)
    p0 = rng.normal(size=size).astype(np.float32)
    grads = rng.normal(size=(steps, size)).astype(np.float32)
    lrs = [lr0 * 0.9 ** (s / 5) for s in range(steps)]
    params = p0.copy()
    ema = EMA(params, 0.99)
    opt = make(params, ema)
    for step, (g, lr) in enumerate(zip(grads, lrs)):
        opt.step(g, lr, step)
    return p0, grads, lrs, params, ema, opt


def check(momentum):
    p0, grads, lrs, params, ema, _ = run_steps(7, 6, 25, 0.5, lambda p, e: SGD(p, momentum=momentum, ema=e))
    want_p, want_e = hand_run(p0, grads, lrs, momentum, 0.99)
    np.testing.assert_allclose(params, want_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ema.shadow, want_e, rtol=1e-5, atol=1e-6)
    assert params.dtype == ema.shadow.dtype == np.float32
    assert not np.allclose(ema.shadow, params)  # the average lags the weights


def test_sgd_and_ema_match_hand_computation():
    check(momentum=0.0)


def test_momentum_and_ema_match_hand_computation():
    check(momentum=0.9)


def test_replica_without_ema_applies_the_same_update():
    rng = np.random.default_rng(1)
    a = rng.normal(size=5).astype(np.float32)
    b = a.copy()
    g = rng.normal(size=5).astype(np.float32)
    SGD(a, ema=EMA(a, 0.99)).step(g, 0.1, 0)
    SGD(b).step(g, 0.1, 0)
    assert np.array_equal(a, b)  # bit-identical replicas whether or not they hold the EMA


def hand_adam(p0, grads, lrs, b1, b2, eps, decay):
    """Plain-Python float64 reference of tf.train.AdamOptimizer and TF's EMA."""
    p = [float(v) for v in p0]
    m, v, e = [0.0] * len(p), [0.0] * len(p), list(p)
    for step, (g, lr) in enumerate(zip(grads, lrs)):
        t = step + 1
        lr_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        d = min(decay, (2 + step) / (11 + step))  # TF's global_step after this update: step + 1
        for i in range(len(p)):
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i]
            p[i] -= lr_t * m[i] / (math.sqrt(v[i]) + eps)
            e[i] -= (1 - d) * (e[i] - p[i])
    return np.array(p), np.array(e), np.array(m), np.array(v)


def test_adam_and_ema_match_hand_computation():
    p0, grads, lrs, params, ema, opt = run_steps(
        3, 7, 30, 0.01, lambda p, e: Adam(p, beta1=0.8, beta2=0.99, epsilon=1e-6, ema=e))
    want_p, want_e, want_m, want_v = hand_adam(p0, grads, lrs, 0.8, 0.99, 1e-6, 0.99)
    np.testing.assert_allclose(params, want_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ema.shadow, want_e, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(opt.state["adam_m"], want_m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(opt.state["adam_v"], want_v, rtol=1e-5, atol=1e-7)
    assert params.dtype == opt.state["adam_m"].dtype == np.float32
    assert np.abs(params - p0).max() > 0.05  # it moved: the comparison is not vacuous


def test_adam_update_in_slices_equals_whole_buffer():
    """Concurrent CPU towers update a slice each: slices must compose to the whole update."""
    rng = np.random.default_rng(4)
    p0 = rng.normal(size=10).astype(np.float32)
    g = rng.normal(size=10).astype(np.float32)
    whole, parts = p0.copy(), p0.copy()
    a, b = Adam(whole), Adam(parts)
    for step in range(3):
        a.step(g, 0.01, step)
        for part in (slice(0, 4), slice(4, 10)):
            b.step(g[part], 0.01, step, part)
    assert np.array_equal(whole, parts)


# -- AdamW and RMSProp against their references, written here independently in float64 --------------------

N_REG = 5  # the first N_REG elements play regularized weights, the rest biases: towers adds l2 * w to those only


def with_l2(g, w, l2):
    """The gradient the optimizer sees, as towers.nn.replica forms it: g + l2 * w on regularized weights."""
    g = [float(v) for v in g]
    for i in range(N_REG):
        g[i] += l2 * w[i]
    return g


def torch_adamw_reference(p0, grads, lrs, l2, b1, b2, eps, wd):
    """torch.optim.AdamW's documented algorithm (amsgrad off, maximize off), float64, element by element."""
    p = [float(v) for v in p0]
    m, v = [0.0] * len(p), [0.0] * len(p)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = with_l2(g, p, l2)
        for i in range(len(p)):
            p[i] = p[i] - lr * wd * p[i]
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            m_hat = m[i] / (1 - b1 ** t)
            v_hat = v[i] / (1 - b2 ** t)
            p[i] = p[i] - lr * m_hat / (math.sqrt(v_hat) + eps)
    return np.array(p), np.array(m), np.array(v)


def tf1_rmsprop_reference(p0, grads, lrs, l2, rho, mu, eps, centered):
    """TF 1's ApplyRMSProp / ApplyCenteredRMSProp, float64: ms starts at 1, mom and mg at 0."""
    p = [float(v) for v in p0]
    ms, mom, mg = [1.0] * len(p), [0.0] * len(p), [0.0] * len(p)
    for g, lr in zip(grads, lrs):
        g = with_l2(g, p, l2)
        for i in range(len(p)):
            ms[i] = ms[i] + (g[i] ** 2 - ms[i]) * (1 - rho)
            if centered:
                mg[i] = mg[i] + (g[i] - mg[i]) * (1 - rho)
                denom = ms[i] - mg[i] ** 2 + eps
            else:
                denom = ms[i] + eps
            mom[i] = mom[i] * mu + lr * g[i] / math.sqrt(denom)
            p[i] = p[i] - mom[i]
    return np.array(p), np.array(ms), np.array(mom), np.array(mg)


def run_with_l2(make, l2, seed=5, size=9, steps=30, lr0=0.01):
    """towers' optimizer fed the gradient plus l2 * w (from its own float32 weights) for several steps."""
    rng = np.random.default_rng(seed)
    p0 = rng.normal(size=size).astype(np.float32)
    grads = rng.normal(size=(steps, size)).astype(np.float32)
    lrs = [lr0 * 0.95 ** s for s in range(steps)]
    params = p0.copy()
    opt = make(params)
    for step, (g, lr) in enumerate(zip(grads, lrs)):
        g = g.copy()
        g[:N_REG] += np.float32(l2) * params[:N_REG]
        opt.step(g, lr, step)
    return p0, grads, lrs, params, opt


@pytest.mark.parametrize("wd, l2", [(0.01, 0.0), (0.3, 0.05)])
def test_adamw_matches_torchs_formula_step_for_step(wd, l2):
    from towers.optim.optimizers.adamw import AdamW

    p0, grads, lrs, params, opt = run_with_l2(
        lambda p: AdamW(p, beta1=0.8, beta2=0.99, epsilon=1e-6, weight_decay=wd), l2, lr0=0.05)
    want_p, want_m, want_v = torch_adamw_reference(p0, grads, lrs, l2, 0.8, 0.99, 1e-6, wd)
    np.testing.assert_allclose(params, want_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(opt.state["adam_m"], want_m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(opt.state["adam_v"], want_v, rtol=1e-5, atol=1e-7)
    assert params.dtype == np.float32 and np.abs(params - p0).max() > 0.1  # it moved: not vacuous
    # The decay is decoupled: Adam with L2 = wd (through the gradient) lands elsewhere.
    _, _, _, adam_l2, _ = run_with_l2(lambda p: Adam(p, beta1=0.8, beta2=0.99, epsilon=1e-6), wd + l2, lr0=0.05)
    assert np.abs(adam_l2 - params).max() > 1e-3


@pytest.mark.parametrize("mu, centered, l2", [(0.0, False, 0.0), (0.9, False, 0.01), (0.5, True, 0.01)])
def test_rmsprop_matches_tf1s_formula_step_for_step(mu, centered, l2):
    from towers.optim.optimizers.rmsprop import RMSProp

    p0, grads, lrs, params, opt = run_with_l2(
        lambda p: RMSProp(p, decay=0.9, momentum=mu, epsilon=1e-10, centered=centered), l2)
    want_p, want_ms, want_mom, want_mg = tf1_rmsprop_reference(p0, grads, lrs, l2, 0.9, mu, 1e-10, centered)
    np.testing.assert_allclose(params, want_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(opt.state["rmsprop_ms"], want_ms, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(opt.state["rmsprop_mom"], want_mom, rtol=1e-5, atol=1e-7)
    if centered:
        np.testing.assert_allclose(opt.state["rmsprop_mg"], want_mg, rtol=1e-5, atol=1e-7)
    assert np.abs(params - p0).max() > 0.01


@pytest.mark.slow
@pytest.mark.references
def test_torch_adamw_agrees_when_torch_is_installed():
    torch = pytest.importorskip("torch")
    from towers.optim.optimizers.adamw import AdamW

    p0, grads, lrs, params, _ = run_with_l2(lambda p: AdamW(p, weight_decay=0.1), 0.0, lr0=0.05)
    w = torch.tensor(p0.astype(np.float64), requires_grad=True)
    opt = torch.optim.AdamW([w], lr=lrs[0], weight_decay=0.1)
    largest = float(np.abs(p0).max())  # |w| along the way
    for g, lr in zip(grads, lrs):
        opt.param_groups[0]["lr"] = lr
        w.grad = torch.tensor(g.astype(np.float64))
        opt.step()
        largest = max(largest, float(w.detach().abs().max()))
    # towers keeps w, m and v in float32, the reference float64: the difference is float32 rounding of N steps.
    # Each step rounds w twice (the decay, then the update: half an ulp of |w| each) and takes its update from
    # float32 moments (relative error about 1e-6 of a step of at most lr = 0.05: under an ulp of |w| here), so
    # at most about 2 ulps of the largest |w| a step.  (atol 1e-6 failed with torch 2.13: 1.7e-6 after 30 steps,
    # under this bound of 8e-6.)
    bound = len(grads) * 2 * float(np.finfo(np.float32).eps) * largest
    np.testing.assert_allclose(params, w.detach().numpy(), rtol=0, atol=bound)


@pytest.mark.parametrize("name", ["adamw", "rmsprop"])
def test_new_optimizers_update_in_slices_as_the_whole_buffer(name):
    from towers.optim.optimizers import OPTIMIZERS

    rng = np.random.default_rng(4)
    p0, g = rng.normal(size=10).astype(np.float32), rng.normal(size=10).astype(np.float32)
    whole, parts = p0.copy(), p0.copy()
    cfg = Config(optimizer=name, momentum=0.9 if name == "rmsprop" else None,
                 rmsprop_centered=name == "rmsprop").resolved()
    a, b = OPTIMIZERS[name].from_config(cfg, whole), OPTIMIZERS[name].from_config(cfg, parts)
    for step in range(3):
        a.step(g, 0.01, step)
        for part in (slice(0, 4), slice(4, 10)):
            b.step(g[part], 0.01, step, part)
    assert np.array_equal(whole, parts)


def test_old_optimizers_keep_their_slot_names():
    """Checkpoints written before the optimizers moved hold these keys: they must still load."""
    from towers.optim.optimizers import SLOTS

    assert SGD(np.zeros(3, np.float32), momentum=0.9).slots == ("momentum",)
    assert SGD(np.zeros(3, np.float32)).slots == ()
    assert Adam(np.zeros(3, np.float32)).slots == ("adam_m", "adam_v")
    assert {"momentum", "adam_m", "adam_v"} <= set(SLOTS)


@pytest.mark.parametrize("kw, refused", [
    (dict(lr=10.0, weight_decay=0.1), True),  # exactly 1: every weight zeroed each step
    (dict(lr=0.5, weight_decay=4.0), True),  # 2: every weight's sign flipped
    (dict(lr_boundaries="10", lr_values="0.01,200", weight_decay=0.01), True),  # the schedule's largest rate
    (dict(lr=9.9, weight_decay=0.1), False),
    (dict(lr=0.1, weight_decay=5.0, lr_schedule="cosine", warmup_steps=10), False),
])
def test_adamw_refuses_a_decay_that_zeroes_or_flips_the_weights(kw, refused):
    cfg = Config(optimizer="adamw", **kw)
    if not refused:
        assert cfg.resolved().optimizer == "adamw"
        return
    with pytest.raises(UserError, match=r"lr \S+ x weight_decay \S+ = \S+, not below 1: AdamW multiplies every "
                                        r"parameter by 1 - lr x weight_decay each step"):
        cfg.resolved()
