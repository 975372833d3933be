"""The layers: float64 finite-difference checks of every gradient, and what each layer computes.

Batch norm, residual blocks (identity, option A, projection), global and
windowed average pooling, max-pooling at a stride, dropout, LRN, strided and
padded convolutions without bias, label smoothing.  A layer without
parameters is checked through the parameters of a layer before it, whose
gradient flows through its backward.
"""
from __future__ import annotations

import numpy
import pytest

from towers.errors import UserError
from towers.nn.conv import Conv2D
from towers.nn.dropout import Dropout
from towers.nn.context import StepContext
from towers.nn.layers import Dense, Flatten, ReLU, Sequential, Workspace
from towers.nn.normalization import LRN, BatchNorm
from towers.nn.pooling import AvgPool2D, GlobalAvgPool, MaxPool2D
from towers.nn.replica import Replica
from towers.nn.residual import PadShortcut, Residual


def check_grads(model, x, y, l2=1e-2, eps=1e-6, seed=0, smoothing=0.0, tol=1e-5):
    """Every trainable parameter's gradient against float64 central differences (training mode)."""
    rng = numpy.random.default_rng(seed)
    r = Replica(model, numpy, dtype=numpy.float64, label_smoothing=smoothing)
    # Random, not the init: biases non-zero, and no exact ties in max-pool windows.
    r.set_params(rng.normal(0, 0.3, model.size))

    def loss():
        return float(r.loss_and_grads(x, y, l2))

    loss()
    analytic = r.grads.copy()
    numeric = numpy.empty_like(analytic)
    for i in range(model.size):
        keep = r.params[i]
        r.params[i] = keep + eps
        up = loss()
        r.params[i] = keep - eps
        down = loss()
        r.params[i] = keep
        numeric[i] = (up - down) / (2 * eps)
    for name, shape, off, size in model.layout():
        a, n = analytic[off: off + size], numeric[off: off + size]
        err = numpy.abs(a - n).max() / max(numpy.abs(n).max(), 1e-8)
        assert err < tol, f"{name}: relative error {err:.2e}"
    return r


def _data(shape, classes=3, n=4, seed=1):
    rng = numpy.random.default_rng(seed)
    return rng.normal(size=(n,) + shape), rng.integers(0, classes, n)


def test_batchnorm_gradients_after_conv_and_dense():
    model = Sequential([
        Conv2D("c", 3, 3, padding="same", bias=False), BatchNorm("bn1"), ReLU(),
        Flatten(), Dense("fc", 4), BatchNorm("bn2", scale=False), ReLU(), Dense("out", 3),
    ]).build((5, 4, 2))
    check_grads(model, *_data((5, 4, 2)))


def test_batchnorm_normalizes_with_batch_statistics_and_evaluates_with_moving_ones():
    bn = BatchNorm("bn", momentum=0.9, epsilon=1e-3)
    model = Sequential([bn]).build((3,))
    r = Replica(model, numpy, dtype=numpy.float64)
    r.set_params(numpy.array([2.0, 1.0, 0.5, 0.1, 0.0, -1.0]))  # gamma, beta
    x = numpy.random.default_rng(0).normal(3.0, 2.0, (50, 3))
    y = r.forward(x, training=True)
    want = (x - x.mean(0)) / numpy.sqrt(x.var(0) + 1e-3) * [2.0, 1.0, 0.5] + [0.1, 0.0, -1.0]
    numpy.testing.assert_allclose(y, want, rtol=1e-10, atol=1e-12)
    # Step 0 of the warm-up: d = min(0.9, 1/10), so the moving values move 90% of the way.
    numpy.testing.assert_allclose(r.buffer["bn/moving_mean"], 0.9 * x.mean(0), rtol=1e-12)
    numpy.testing.assert_allclose(r.buffer["bn/moving_variance"], 0.1 + 0.9 * x.var(0), rtol=1e-12)
    r.set_buffers(numpy.array([1.0, 2.0, 3.0, 4.0, 1.0, 0.25]))  # means, then variances
    y = r.forward(x)  # evaluation mode
    want = (x - [1.0, 2.0, 3.0]) / numpy.sqrt(numpy.array([4.0, 1.0, 0.25]) + 1e-3) * [2.0, 1.0, 0.5] + [0.1, 0.0, -1.0]
    numpy.testing.assert_allclose(y, want, rtol=1e-10)
    numpy.testing.assert_array_equal(r.buffers, [1.0, 2.0, 3.0, 4.0, 1.0, 0.25])  # untouched by evaluation


def _bn_reference(x, gamma, beta, dy, epsilon):
    """Batch norm's training forward and backward over axis 0, in float64 on the centred values."""
    x, dy = x.astype(numpy.float64), dy.astype(numpy.float64)
    xc = x - x.mean(axis=0)
    inv_std = 1 / numpy.sqrt((xc * xc).mean(axis=0) + epsilon)
    xhat = xc * inv_std
    dgamma, dbeta = (dy * xhat).sum(axis=0), dy.sum(axis=0)
    dx = gamma * inv_std * (dy - dy.mean(axis=0) - xhat * (dy * xhat).mean(axis=0))
    return xhat * gamma + beta, dx, dgamma, dbeta


def _bn_float32(x, gamma, beta, dy, epsilon):
    """(y, dx, dgamma, dbeta, moving mean, moving variance) of one float32 training step of the layer."""
    bn, f32 = BatchNorm("bn", epsilon=epsilon), numpy.float32
    bn.build(x.shape[1:])
    c = x.shape[1]
    p = {"gamma": gamma.astype(f32), "beta": beta.astype(f32), "moving_mean": numpy.zeros(c, f32),
         "moving_variance": numpy.ones(c, f32)}
    g = {"gamma": numpy.zeros(c, f32), "beta": numpy.zeros(c, f32)}
    ws = Workspace(numpy, StepContext())
    y = bn.forward(p, x.astype(f32), ws).copy()
    dx = bn.backward(p, g, dy.astype(f32), ws, need_dx=True)
    # The first step's moving averages take 0.9 of the batch's statistics (the warm-up).
    return y, dx, g["gamma"], g["beta"], p["moving_mean"] / 0.9, (p["moving_variance"] - 0.1) / 0.9


def test_batchnorm_keeps_float32_precision_on_a_large_mean():
    # Mean 100, std 0.01: E[x^2] - E[x]^2 in float32 loses every digit of the
    # variance (1e4 - 1e4 with float32's 1e-3 steps at 1e4), and
    # sum(dy * x) - mean * sum(dy) most of dgamma's.
    rng = numpy.random.default_rng(0)
    x = (100 + 0.01 * rng.normal(size=(512, 3))).astype(numpy.float32)
    x[:, 1] = 0.3 * rng.normal(size=512).astype(numpy.float32) - 2  # an ordinary channel beside them
    gamma, beta = numpy.array([1.5, 0.7, -0.4]), numpy.array([0.1, -0.2, 0.3])
    dy = rng.normal(size=x.shape) * numpy.array([1.0, 0.5, 2.0])
    want_y, want_dx, want_dgamma, want_dbeta = _bn_reference(x, gamma, beta, dy, 1e-5)
    y, dx, dgamma, dbeta, mean, var = _bn_float32(x, gamma, beta, dy, 1e-5)
    x64 = x.astype(numpy.float64)
    numpy.testing.assert_allclose(mean, x64.mean(axis=0), rtol=1e-6)
    numpy.testing.assert_allclose(var, x64.var(axis=0), rtol=1e-2)  # 1e-4 beside the EMA's 0.1: its rounding
    # Errors relative to each quantity's own scale (y and xhat are O(1) per channel).
    for got, want in ((y, want_y), (dx, want_dx), (dgamma, want_dgamma), (dbeta, want_dbeta)):
        scale = numpy.abs(want).max(axis=0)
        assert (numpy.abs(got - want).max(axis=0) / scale).max() < 2e-5


def test_batchnorm_gradients_on_a_large_mean():
    # The centred algorithm (shift, small offset) against float64 differences: the cancelling
    # E[x^2] - E[x]^2 misses by 5e-4 here even in float64 (the Dense outputs: mean ~100, spread ~0.01).
    rng = numpy.random.default_rng(2)
    model = Sequential([Dense("fc", 4), BatchNorm("bn", epsilon=1e-5), ReLU(), Dense("out", 3)]).build((5,))
    check_grads(model, 100 + 0.01 * rng.normal(size=(6, 5)), rng.integers(0, 3, 6))


def test_batchnorm_moving_statistics_warm_up_with_the_step():
    # After 400 steps on the same data the moving statistics are the data's,
    # whatever their initial values: short runs evaluate well.
    model = Sequential([BatchNorm("bn")]).build((2,))
    r = Replica(model, numpy)
    x = numpy.random.default_rng(0).normal(5.0, 3.0, (64, 2)).astype(numpy.float32)
    for step in range(400):
        r.context.step = step
        r.forward(x, training=True)
    numpy.testing.assert_allclose(r.buffer["bn/moving_mean"], x.mean(0), rtol=1e-3)
    numpy.testing.assert_allclose(r.buffer["bn/moving_variance"], x.var(0), rtol=1e-3)


def test_buffers_are_separate_from_the_trainable_layout():
    model = Sequential([Dense("fc", 3), BatchNorm("bn"), Dense("out", 2)]).build((4,))
    assert [n for n, *_ in model.layout()] == ["fc/weights", "out/weights", "fc/biases", "bn/gamma", "bn/beta",
                                               "out/biases"]
    assert model.buffer_layout() == [("bn/moving_mean", (3,), 0, 3), ("bn/moving_variance", (3,), 3, 3)]
    assert model.size == model.n_trainable == 12 + 6 + 3 + 3 + 3 + 2 and model.buffer_size == 6
    numpy.testing.assert_array_equal(model.init_buffers(), [0, 0, 0, 1, 1, 1])
    r = Replica(model, numpy)
    numpy.testing.assert_array_equal(r.buffers, [0, 0, 0, 1, 1, 1])
    assert r.buffer["bn/moving_variance"].base is r.buffers or numpy.shares_memory(r.buffer["bn/moving_variance"],
                                                                                   r.buffers)
    assert set(r.grad) == set(r.param) and "bn/moving_mean" not in r.grad


@pytest.mark.parametrize("shortcut", [None, "A", "projection"])
def test_residual_block_gradients(shortcut):
    stride = 1 if shortcut is None else 2
    filters = 2 if shortcut is None else 3
    block = Residual([Conv2D("c1", filters, 3, padding=1, stride=stride, bias=False), BatchNorm("bn1"), ReLU(),
                      Conv2D("c2", filters, 3, padding=1, bias=False), BatchNorm("bn2")],
                     shortcut=shortcut, scope="block")
    # A convolution first, so the block's input gradient (both paths) is checked too.
    model = Sequential([Conv2D("c0", 2, 3, padding="same"), block, GlobalAvgPool(), Dense("fc", 3)]).build((5, 5))
    r = check_grads(model, *_data((5, 5)))
    names = set(r.param)
    assert "block/c1/weights" in names and "block/bn2/gamma" in names
    assert ("block/shortcut/weights" in names) == (shortcut == "projection")


@pytest.mark.parametrize("last", [ReLU, BatchNorm])
def test_residual_body_that_may_overwrite_its_gradient(last):
    # ReLU's backward masks dy in place (keeps_dy False): the body must get a copy, or the
    # identity shortcut would read the masked gradient; BatchNorm's only reads it (no copy).
    tail = last() if last is ReLU else last("bn")
    assert tail.keeps_dy == (last is BatchNorm)
    block = Residual([Conv2D("c1", 2, 3, padding=1, bias=False), tail], scope="block")
    model = Sequential([Conv2D("c0", 2, 3, padding="same"), block, GlobalAvgPool(), Dense("fc", 3)]).build((5, 5))
    check_grads(model, *_data((5, 5)))


def test_residual_output_is_relu_of_body_plus_shortcut():
    x = numpy.random.default_rng(0).normal(size=(2, 4, 4, 2))
    body = [Conv2D("c", 4, 3, padding=1, stride=2)]
    model = Sequential([Residual(body, shortcut="A")]).build((4, 4, 2))
    r = Replica(model, numpy, dtype=numpy.float64)
    r.set_params(numpy.random.default_rng(1).normal(size=model.size))
    plain = Replica(Sequential([Conv2D("c", 4, 3, padding=1, stride=2)]).build((4, 4, 2)), numpy, dtype=numpy.float64)
    plain.set_params(r.params)
    short = numpy.zeros((2, 2, 2, 4))
    short[..., :2] = x[:, ::2, ::2, :]
    numpy.testing.assert_allclose(r.forward(x), numpy.maximum(plain.forward(x) + short, 0), rtol=1e-12)
    with pytest.raises(UserError, match="shortcut"):
        Sequential([Residual(body)]).build((4, 4, 2))


def test_pad_shortcut_backward_is_its_transpose():
    rng = numpy.random.default_rng(0)
    layer = Sequential([PadShortcut(5, 2)]).build((5, 3, 2))
    r = Replica(layer, numpy, dtype=numpy.float64)
    x, dy = rng.normal(size=(2, 5, 3, 2)), rng.normal(size=(2, 3, 2, 5))
    y = r.forward(x).copy()
    p, g, ws = r._local[0]
    dx = layer.layers[0].backward(p, g, dy.copy(), ws, True)
    assert numpy.isclose(numpy.sum(y * dy), numpy.sum(x * dx))


@pytest.mark.parametrize("pool", [AvgPool2D(2), AvgPool2D(3, 2, "same"), MaxPool2D(3, 2), MaxPool2D(3, 3),
                                  MaxPool2D(2, 1, "valid"), GlobalAvgPool()])
def test_pooling_gradients(pool):
    model = Sequential([Conv2D("c", 2, 3, padding="same"), pool, Flatten(), Dense("fc", 3)]).build((7, 6))
    check_grads(model, *_data((7, 6)))


def test_pooling_values():
    x = numpy.arange(2 * 5 * 5 * 1, dtype=numpy.float64).reshape(2, 5, 5, 1) % 7
    run = lambda layer: Replica(Sequential([layer]).build((5, 5, 1)), numpy, numpy.float64).forward(x)
    # TF SAME, 3x3 stride 2 over 5x5: 3x3 outputs, 1 row of padding on each side.
    pad = numpy.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-numpy.inf)
    want = numpy.array([[[pad[b, 2 * i: 2 * i + 3, 2 * j: 2 * j + 3].max() for j in range(3)] for i in range(3)]
                        for b in range(2)])
    numpy.testing.assert_array_equal(run(MaxPool2D(3, 2))[..., 0], want)
    # Average pooling SAME divides by the pixels inside the image (a corner window holds 4 of them).
    avg = run(AvgPool2D(3, 2, "same"))
    assert avg[0, 0, 0, 0] == x[0, :2, :2, 0].mean()
    assert avg[1, 1, 1, 0] == x[1, 1:4, 1:4, 0].mean()
    numpy.testing.assert_allclose(run(GlobalAvgPool()), x.mean(axis=(1, 2)))


@pytest.mark.parametrize("stride,padding", [(2, "same"), (2, "valid"), (2, 1), (3, 2), (1, 1), (1, "valid")])
def test_strided_padded_convolution_gradients(stride, padding):
    model = Sequential([Conv2D("c1", 2, 3, padding=padding, stride=stride, bias=False),
                        Conv2D("c2", 2, 2, padding="same", stride=1), Flatten(), Dense("fc", 3)]).build((7, 6))
    assert "c1/biases" not in {n for n, *_ in model.layout()}
    check_grads(model, *_data((7, 6)))


@pytest.mark.parametrize("stride,padding", [(2, "same"), (2, 1), (1, 2), (1, "same")])
def test_strided_convolution_matches_direct_sums(stride, padding):
    rng = numpy.random.default_rng(3)
    x = rng.normal(size=(2, 7, 6, 2))
    conv = Conv2D("c", 3, 3, padding=padding, stride=stride)
    model = Sequential([conv]).build((7, 6, 2))
    r = Replica(model, numpy, dtype=numpy.float64)
    r.set_params(rng.normal(size=model.size))
    got = r.forward(x)
    (t, l), (ho, wo) = conv.pad, conv.out_hw
    xp = numpy.zeros((2, 7 + 2 * 3, 6 + 2 * 3, 2))
    xp[:, 3: 10, 3: 9] = x
    w, b = r.param["c/weights"], r.param["c/biases"]
    want = numpy.zeros((2, ho, wo, 3))
    for i in range(ho):
        for j in range(wo):
            patch = xp[:, 3 - t + i * stride: 3 - t + i * stride + 3, 3 - l + j * stride: 3 - l + j * stride + 3]
            want[:, i, j] = numpy.einsum("nabc,abcf->nf", patch, w) + b
    numpy.testing.assert_allclose(got, want, rtol=1e-10)
    expect_hw = {"same": -(-7 // stride)}.get(padding, (7 + 2 * (padding if padding != "same" else 0) - 3) // stride + 1)
    assert ho == expect_hw


@pytest.mark.parametrize("filters", [4, 24])  # F < C and F > C: dW from dy's im2col, or from x's (_dw_from_x)
@pytest.mark.parametrize("shape,stride", [((6, 5, 3), 1), ((40, 40, 16), 1), ((40, 40, 16), 2)])
def test_chunked_convolution_equals_the_whole_batch_algorithm(shape, stride, filters):
    # (40, 40, 16) at 3x3 makes chunks of a few images: the CPU's cache-sized path.
    rng = numpy.random.default_rng(4)
    x = rng.normal(size=(9,) + shape)
    out = []
    for how in ("chunked", "whole"):
        conv = Conv2D("c", filters, 3, padding="same", stride=stride, algorithm=how)
        m = Sequential([conv]).build(shape)
        assert (len(conv._chunks(x)) > 1) == (how == "chunked" and shape[0] > 10)
        assert conv._dw_from_x == (how == "chunked" and stride == 1 and filters > shape[-1])
        dy = numpy.random.default_rng(5).normal(size=(9,) + conv.out_hw + (filters,))
        r = Replica(m, numpy, dtype=numpy.float64)
        r.set_params(rng.normal(size=m.size) if not out else out[0][0])
        y = r.forward(x, training=True).copy()
        p, g, ws = r._local[0]
        dx = m.layers[0].backward(p, g, dy.copy(), ws, True).copy()
        out.append((r.params.copy(), y, dx, r.grads.copy()))
    for a, b in zip(out[0][1:], out[1][1:]):
        numpy.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_convolution_im2col_plans_follow_the_input_memory():
    # The CPU's chunked im2col keeps its views while the input is the same memory: a new
    # array, new contents in the same array, or a new view of it must all give fresh results.
    rng = numpy.random.default_rng(6)
    chunked, whole = (Conv2D("c", 4, 3, padding="same", algorithm=a) for a in ("chunked", "whole"))
    rs = [Replica(Sequential([conv]).build((40, 40, 16)), numpy, dtype=numpy.float64) for conv in (chunked, whole)]
    for r in rs:
        r.set_params(rng.normal(size=r.params.size) if r is rs[0] else rs[0].params)
    x = rng.normal(size=(9, 40, 40, 16))
    assert len(chunked._chunks(x)) > 1
    for feed in (x, rng.normal(size=x.shape), x, x.reshape(9, 40, 640).reshape(x.shape)):
        if feed is x:
            x[...] = rng.normal(size=x.shape)  # same array, new contents
        got, want = (r.forward(feed, training=True).copy() for r in rs)
        numpy.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        dy = rng.normal(size=got.shape)
        dxs = [r.model.layers[0].backward(r._local[0][0], r._local[0][1], dy.copy(), r._local[0][2], True).copy()
               for r in rs]
        numpy.testing.assert_allclose(dxs[0], dxs[1], rtol=1e-10, atol=1e-12)


def test_lrn_matches_tensorflow_formula_and_its_gradients():
    rng = numpy.random.default_rng(5)
    x = rng.normal(size=(2, 3, 3, 7))
    lrn = LRN(depth_radius=2, bias=1.0, alpha=0.3, beta=0.75)
    r = Replica(Sequential([lrn]).build((3, 3, 7)), numpy, dtype=numpy.float64)
    got = r.forward(x)
    sq = numpy.pad(x * x, ((0, 0), (0, 0), (0, 0), (2, 2)))
    want = x / (1.0 + 0.3 * sum(sq[..., d: d + 7] for d in range(5))) ** 0.75
    numpy.testing.assert_allclose(got, want, rtol=1e-12)
    for beta in (0.75, 0.5, 0.6):
        model = Sequential([Conv2D("c", 5, 3, padding="same"), LRN(2, 1.0, 0.3, beta), Flatten(),
                            Dense("fc", 3)]).build((4, 4))
        check_grads(model, *_data((4, 4)))


def test_dropout_gradients_and_reproducible_masks():
    model = Sequential([Dense("fc1", 6), Dropout(0.4), ReLU(), Dense("fc2", 3)]).build((5,))
    r = check_grads(model, *_data((5,)))
    x = numpy.ones((200, 5), numpy.float32)

    def mask(seed, tower, step):
        rr = Replica(Sequential([Dropout(0.25)]).build((5,)), numpy)
        rr.context.seed, rr.context.tower, rr.context.step = seed, tower, step
        return rr.forward(x, training=True).copy()

    a = mask(0, 0, 7)
    numpy.testing.assert_array_equal(a, mask(0, 0, 7))  # a resume redraws the same mask
    assert set(numpy.unique(a)) == {0.0, numpy.float32(1 / 0.75)}
    assert abs((a == 0).mean() - 0.25) < 0.05
    for other in (mask(1, 0, 7), mask(0, 1, 7), mask(0, 0, 8)):
        assert not numpy.array_equal(a, other)
    numpy.testing.assert_array_equal(r.forward(numpy.ones((2, 5))), r.forward(numpy.ones((2, 5))))  # eval: no dropout


def test_label_smoothing_loss_and_gradient():
    rng = numpy.random.default_rng(6)
    x, y = rng.normal(size=(5, 4)), rng.integers(0, 3, 5)
    model = Sequential([Dense("fc", 3)]).build((4,))
    r = check_grads(model, x, y, l2=0.0, smoothing=0.1)
    logits = r.forward(x)
    logp = logits - numpy.log(numpy.exp(logits).sum(1, keepdims=True))
    target = numpy.full((5, 3), 0.1 / 3)
    target[numpy.arange(5), y] += 0.9
    assert numpy.isclose(float(r.loss_and_grads(x, y, 0.0)), -(target * logp).sum(1).mean())


def test_layer_argument_errors():
    with pytest.raises(UserError, match="padding"):
        Conv2D("c", 2, 3, padding="full")
    with pytest.raises(UserError, match="stride"):
        Conv2D("c", 2, 3, stride=0)
    with pytest.raises(UserError, match="rate"):
        Dropout(1.0)
    with pytest.raises(UserError, match="does not fit"):
        Sequential([MaxPool2D(5, 1, "valid")]).build((3, 3))


def _steps(reps, opts, batches, first_step):
    for k, (x, y) in enumerate(batches):
        for r, opt in zip(reps, opts):
            r.context.step = first_step + k
            r.loss_and_grads(x, y, 1e-3)
            opt.step(r.grads, 0.05, first_step + k)


def test_batchnorm_and_dropout_replica_resumes_bit_for_bit():
    # What a checkpoint must hold for the nn side of an exact resume: weights,
    # buffers, optimizer state and the step (dropout masks come from the step).
    from towers.optim.optimizers import SGD

    model = Sequential([Conv2D("c", 3, 3, padding="same", bias=False), BatchNorm("bn"), ReLU(), Dropout(0.3),
                        GlobalAvgPool(), Dense("fc", 3)]).build((5, 5, 2))
    rng = numpy.random.default_rng(7)
    batches = [(rng.normal(size=(4, 5, 5, 2)).astype(numpy.float32), rng.integers(0, 3, 4)) for _ in range(6)]
    whole = Replica(model, numpy)
    whole.set_params(model.init_params(0))
    opt = SGD(whole.params, 0.9)
    _steps([whole], [opt], batches, 0)
    first = Replica(model, numpy)
    first.set_params(model.init_params(0))
    opt1 = SGD(first.params, 0.9)
    _steps([first], [opt1], batches[:3], 0)
    resumed = Replica(model, numpy)  # a new process: state from the "checkpoint"
    resumed.set_params(first.params.copy())
    resumed.set_buffers(first.buffers.copy())
    opt2 = SGD(resumed.params, 0.9)
    opt2.state["momentum"][...] = opt1.state["momentum"]
    _steps([resumed], [opt2], batches[3:], 3)
    numpy.testing.assert_array_equal(resumed.params, whole.params)
    numpy.testing.assert_array_equal(resumed.buffers, whole.buffers)
    assert not numpy.array_equal(first.buffers, whole.buffers)  # the buffers did move on


@pytest.mark.gpu
@pytest.mark.parametrize("spec,shape", [("resnet20", (8, 8, 3)), ("cifar10", (12, 12)), ("layers", (7, 6, 2))])
def test_models_on_gpu_match_cpu(spec, shape):
    import cupy

    from towers.nn.models import build_model

    if spec == "layers":  # every other new layer, Dropout's host-drawn mask included
        model = Sequential([Conv2D("c", 4, 3, padding=1, stride=2), AvgPool2D(2, 1, "same"), Dropout(0.2),
                            MaxPool2D(3, 2), LRN(2), Flatten(), Dense("fc", 6), BatchNorm("bn"), ReLU(),
                            Dense("out", 5)]).build(shape)
    else:
        model = build_model(spec, shape, 5)
    rng = numpy.random.default_rng(0)
    x = rng.random((6,) + shape, dtype=numpy.float32)
    y = rng.integers(0, 5, 6)
    out = []
    for xp in (numpy, cupy):
        r = Replica(model, xp, label_smoothing=0.1)
        r.set_params(model.init_params(0))
        r.context.step, r.context.tower = 3, 1
        loss = float(r.loss_and_grads(xp.asarray(x), xp.asarray(y), 1e-3))
        logits = r.forward(xp.asarray(x))
        out.append((loss, cupy.asnumpy(r.grads), cupy.asnumpy(r.buffers), cupy.asnumpy(logits)))
    (lc, gc, bc, fc), (lg, gg, bg, fg) = out
    assert abs(lc - lg) <= 1e-4 * abs(lc)
    numpy.testing.assert_allclose(gg, gc, rtol=1e-3, atol=1e-5)
    numpy.testing.assert_allclose(bg, bc, rtol=1e-4, atol=1e-6)
    numpy.testing.assert_allclose(fg, fc, rtol=1e-3, atol=1e-5)
