"""LeNet-5 layers: float64 finite-difference checks of every gradient, shapes, errors."""
from __future__ import annotations

import numpy
import pytest

from tests.conftest import cpu_form
from towers.errors import UserError
from towers.nn.conv import Conv2D, MaxPool2D
from towers.nn.layers import Dense, Flatten, ReLU, Sequential
from towers.nn.models import build_model, lenet5
from towers.nn.replica import Replica


def _loss(replica, x, y, l2):
    return float(replica.loss_and_grads(x, y, l2, want_loss=True))


def _check_grads(model, x, y, l2=1e-2, eps=1e-6, seed=0):
    """Every parameter gradient (and the input path) against central differences."""
    rng = numpy.random.default_rng(seed)
    r = Replica(model, numpy, dtype=numpy.float64)
    # Random, not the init: biases non-zero, and no exact ties in max-pool windows.
    r.set_params(rng.normal(0, 0.3, model.size))
    _loss(r, x, y, l2)
    analytic = r.grads.copy()
    numeric = numpy.empty_like(analytic)
    for i in range(model.size):
        keep = r.params[i]
        r.params[i] = keep + eps
        up = _loss(r, x, y, l2)
        r.params[i] = keep - eps
        down = _loss(r, x, y, l2)
        r.params[i] = keep
        numeric[i] = (up - down) / (2 * eps)
    for name, shape, off, size in model.layout():
        a, n = analytic[off : off + size], numeric[off : off + size]
        err = numpy.abs(a - n).max() / max(numpy.abs(n).max(), 1e-8)
        assert err < 1e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("in_shape", [(7, 6), (6, 5, 2)])
@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("filters", [2, 5])  # c2: fewer or more filters than its 3 input channels (_dw_from_x)
@pytest.mark.parametrize("cpu_kernels", ["numpy", "numba"])  # numba: c2's input gradient by the compiled col2im
def test_conv_pool_gradients(in_shape, padding, filters, cpu_kernels):
    # Odd sizes exercise SAME padding of both the convolution and the pool;
    # two convolutions make the first one's input gradient path (col2im) count.
    rng = numpy.random.default_rng(1)
    model = Sequential([
        Conv2D("c1", 3, 3, padding=padding, regularize=True), ReLU(), MaxPool2D(2),
        Conv2D("c2", filters, 3, padding="SAME"), ReLU(), Flatten(), Dense("fc", 3, bias=0.1),
    ]).build(in_shape)
    x = rng.normal(size=(2,) + in_shape)
    y = numpy.array([0, 2])
    with cpu_form(cpu_kernels):
        _check_grads(model, x, y)


def test_lenet5_shapes_names_and_small_gradients():
    m = lenet5((28, 28), 10).build((28, 28))
    names = [n for n, *_ in m.layout()]
    assert names[:2] == ["layer5-fc1/weights", "layer6-fc2/weights"]  # L2 on fc weights only, first
    assert set(names) == {f"{s}/{k}" for s in ("layer1-conv1", "layer3-conv2", "layer5-fc1", "layer6-fc2")
                          for k in ("weights", "biases")}
    shapes = {n: s for n, s, *_ in m.layout()}
    assert shapes["layer1-conv1/weights"] == (5, 5, 1, 32)
    assert shapes["layer3-conv2/weights"] == (5, 5, 32, 64)
    assert shapes["layer5-fc1/weights"] == (7 * 7 * 64, 512)
    init = m.init_params(0)
    off = {n: (o, s) for n, _, o, s in m.layout()}
    o, s = off["layer5-fc1/biases"]
    assert numpy.all(init[o : o + s] == numpy.float32(0.1))
    # The same architecture, shrunk, through the finite-difference check.
    small = lenet5((8, 8), 3)
    small.layers[0].filters, small.layers[3].filters, small.layers[7].units = 2, 3, 4
    small.build((8, 8))
    x = numpy.random.default_rng(2).normal(size=(2, 8, 8))
    _check_grads(small, x, numpy.array([1, 2]))


def test_conv_matches_direct_convolution():
    rng = numpy.random.default_rng(3)
    conv = Conv2D("c", 4, 3)
    model = Sequential([conv]).build((5, 6, 2))
    r = Replica(model, numpy, dtype=numpy.float64)
    r.set_params(rng.normal(size=model.size))
    x = rng.normal(size=(2, 5, 6, 2))
    got = r.forward(x)
    w, b = r.param["c/weights"], r.param["c/biases"]
    xp = numpy.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    want = numpy.zeros((2, 5, 6, 4)) + b
    for i in range(3):
        for j in range(3):
            want += numpy.einsum("nhwc,cf->nhwf", xp[:, i : i + 5, j : j + 6, :], w[i, j])
    numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_maxpool_same_padding_and_first_max_gradient():
    pool = MaxPool2D(2)
    model = Sequential([pool]).build((3, 3))
    r = Replica(model, numpy, dtype=numpy.float32)
    x = numpy.array([[[1, 1, 0], [1, 1, 5], [2, -3, -4]]], dtype=numpy.float32)
    y = r.forward(x)
    assert y.shape == (1, 2, 2, 1)
    numpy.testing.assert_array_equal(y[0, :, :, 0], [[1, 5], [2, -4]])
    ws = r._local[0][2]
    dx = pool.backward({}, {}, numpy.ones_like(y), ws, need_dx=True)
    # Tied window of ones: exactly one (the first) input receives the gradient.
    numpy.testing.assert_array_equal(dx[0], [[1, 0, 0], [0, 0, 1], [1, 0, 1]])


def test_lenet5_by_name_and_bad_shapes():
    assert build_model("lenet5", (28, 28, 1), 10).output_shape == (10,)
    with pytest.raises(UserError, match="images"):
        build_model("lenet5", (784,), 10)
    with pytest.raises(UserError, match="padding"):
        Conv2D("c", 2, 3, padding="FULL")
    with pytest.raises(UserError, match="does not fit"):
        Sequential([Conv2D("c", 2, 5, padding="VALID")]).build((3, 3))
