"""Learning-rate schedule, SGD with momentum, and the EMA against hand computations."""
import math

import numpy as np

from towers.optim.ema import EMA, ema_decay
from towers.optim.optimizers import SGD, Adam
from towers.optim.schedule import learning_rate


def test_exponential_decay_matches_tensorflow_formula():
    assert learning_rate(0.8, 0.99, 0, 1000) == 0.8
    assert math.isclose(learning_rate(0.8, 0.99, 1500, 1000), 0.8 * 0.99 ** 1.5)
    assert math.isclose(learning_rate(0.8, 0.99, 1500, 1000, staircase=True), 0.8 * 0.99)
    assert math.isclose(learning_rate(0.8, 0.99, 2999, 1000, staircase=True), 0.8 * 0.99 ** 2)


def test_ema_decay_warms_up_like_tensorflow():
    assert ema_decay(0.99, 0) == 0.1
    assert ema_decay(0.99, 10) == 11 / 20
    assert ema_decay(0.99, 10**6) == 0.99


def hand_run(p0, grads, lrs, momentum, decay):
    """Plain-Python float64 reference of SGD(+momentum) and TF's EMA."""
    p = [float(v) for v in p0]
    v = [0.0] * len(p)
    e = list(p)
    for step, (g, lr) in enumerate(zip(grads, lrs)):
        d = min(decay, (1 + step) / (10 + step))
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
        d = min(decay, (1 + step) / (10 + step))
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
