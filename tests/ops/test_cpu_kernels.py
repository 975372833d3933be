"""The CPU kernels rewritten for speed against plain references on NumPy.

``towers.ops.maxpool.maxpool_backward`` walks the window taps with bool masks and
fewer passes; the reference here is the definition, window by window: each
window's gradient goes to its FIRST maximal element in row-major order (ties,
frequent in real activations, pass it to exactly one input).  The products are
``dy * 1`` and ``dy * 0``, so the comparison is exact, not within a tolerance.
The float64 finite-difference checks of the layer's gradient are in
``tests/nn/test_conv.py`` (``test_conv_pool_gradients``), which runs this kernel.
"""
from __future__ import annotations

import numpy
import pytest

from tests.conftest import cpu_form
from towers.nn.layers import Workspace
from towers.ops.activation import add_relu, relu_backward
from towers.ops.l2 import add_scaled
from towers.ops.maxpool import maxpool, maxpool_backward


def _reference_backward(x, dy, k):
    n, h, w, c = x.shape
    dx = numpy.zeros_like(x)
    for b in range(n):
        for i in range(dy.shape[1]):
            for j in range(dy.shape[2]):
                for ch in range(c):
                    win = x[b, i * k: i * k + k, j * k: j * k + k, ch]  # SAME: the bottom/right windows are cut
                    a, e = numpy.unravel_index(numpy.argmax(win), win.shape)  # argmax: the first maximum
                    dx[b, i * k + a, j * k + e, ch] = dy[b, i, j, ch] * numpy.float32(1)
    return dx


def _reference_forward(x, k):
    n, h, w, c = x.shape
    y = numpy.empty((n, -(-h // k), -(-w // k), c), x.dtype)
    for i in range(y.shape[1]):
        for j in range(y.shape[2]):
            y[:, i, j] = x[:, i * k: i * k + k, j * k: j * k + k].max(axis=(1, 2))  # NaN wins, as numpy.max
    return y


@pytest.mark.parametrize("which", ["numpy", "numba"])
def test_maxpool_a_nan_wins_its_window(which):
    x = numpy.arange(2 * 4 * 4 * 3, dtype=numpy.float32).reshape(2, 4, 4, 3)
    x[0, 1, 1, 0] = x[1, 2, 3, 2] = numpy.nan  # after the window's first element, so a plain `>` would skip it
    y = numpy.empty((2, 2, 2, 3), numpy.float32)
    with cpu_form(which):
        maxpool(x, y, 2, Workspace(numpy))
    numpy.testing.assert_array_equal(y, _reference_forward(x, 2))
    assert numpy.isnan(y[0, 0, 0, 0]) and numpy.isnan(y[1, 1, 1, 2]) and numpy.isnan(y).sum() == 2


@pytest.mark.parametrize("which", ["numpy", "numba"])
@pytest.mark.parametrize("shape, k", [((2, 6, 8, 3), 2), ((3, 7, 5, 4), 2), ((2, 9, 7, 2), 3)])
def test_maxpool_equals_the_max_and_the_first_maximum_of_each_window(shape, k, which):
    rng = numpy.random.default_rng(0)
    # Few distinct values: many windows hold tied maxima, in every tap position.
    x = rng.integers(-2, 3, shape).astype(numpy.float32)
    ho, wo = -(-shape[1] // k), -(-shape[2] // k)
    y = numpy.empty((shape[0], ho, wo, shape[3]), numpy.float32)
    dy = rng.standard_normal(y.shape).astype(numpy.float32)
    ws = Workspace(numpy)
    with cpu_form(which):
        maxpool(x, y, k, ws)
        numpy.testing.assert_array_equal(y, _reference_forward(x, k))
        for _ in range(2):  # the second call reuses the workspace's masks: no state left from the first
            dx = maxpool_backward(x, y, dy, k, ws)
            assert dx.shape == x.shape
            numpy.testing.assert_array_equal(dx, _reference_backward(x, dy, k))
    if which == "numba":  # and NumPy's bits: dy * 0 is -0.0 where dy < 0, NaN where dy is NaN
        dy[0, 0, 0, :] = numpy.nan
        with cpu_form("numba"):
            got = maxpool_backward(x, y, dy, k, ws).copy()
        with numpy.errstate(invalid="ignore"), cpu_form("numpy"):
            want = maxpool_backward(x, y, dy, k, Workspace(numpy))
        numpy.testing.assert_array_equal(got.view(numpy.int32), want.view(numpy.int32))
        assert numpy.signbit(got[got == 0]).any()


def test_compiled_relu_kernels_give_numpys_bits():
    """A residual block's add + ReLU and the ReLU's backward: the compiled pass against the NumPy passes, bit for bit,
    NaN, inf and signed zeros included."""
    rng = numpy.random.default_rng(3)
    special = numpy.array([numpy.nan, -0.0, 0.0, -1.0, 1.0, numpy.inf, -numpy.inf], numpy.float32)
    h = numpy.concatenate([special, special, rng.standard_normal(1000).astype(numpy.float32)]).reshape(-1, 3)
    s = numpy.concatenate([special, special[::-1], rng.standard_normal(1000).astype(numpy.float32)]).reshape(-1, 3)
    dy = numpy.concatenate([special[::-1], special, rng.standard_normal(1000).astype(numpy.float32)]).reshape(-1, 3)
    out = {}
    for which in ("numpy", "numba"):
        y = numpy.empty_like(h)
        d = dy.copy()
        with cpu_form(which):
            add_relu(h, s, y)
            with numpy.errstate(invalid="ignore"):  # inf * 0, as the trainer's tower scope allows
                relu_backward(y, d)
        out[which] = (y.view(numpy.int32), d.view(numpy.int32))
    numpy.testing.assert_array_equal(out["numba"][0], out["numpy"][0])
    numpy.testing.assert_array_equal(out["numba"][1], out["numpy"][1])


def test_compiled_l2_gradient_gives_numpys_bits():
    """``g += l2 * w``: the compiled pass rounds the product, then the sum, as NumPy's two passes do (no fused
    multiply-add), NaN, inf, signed zeros and an overflowing product included."""
    rng = numpy.random.default_rng(7)
    w = rng.standard_normal(5000).astype(numpy.float32)
    g = rng.standard_normal(5000).astype(numpy.float32)
    w[:5], g[:5] = [1, -0.0, -1, 3e38, numpy.nan], [numpy.nan, -0.0, numpy.inf, 3e38, 1]
    want, got = g.copy(), g.copy()
    with numpy.errstate(all="ignore"):
        with cpu_form("numpy"):
            add_scaled(want, w, 1e-4)
        with cpu_form("numba"):
            add_scaled(got, w, 1e-4)
            g[3] = -3e38  # -3e38 + (3e38 * 2 rounded: inf) is inf; a fused multiply-add would give a finite 3e38
            add_scaled(g, w, 2.0)
    numpy.testing.assert_array_equal(got.view(numpy.int32), want.view(numpy.int32))
    assert numpy.isposinf(g[3])
