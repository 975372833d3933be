"""The CPU kernels rewritten for speed (issue 31) against plain references on NumPy.

``kernels.maxpool_backward`` now walks the window taps with bool masks and
fewer passes; the reference here is the definition, window by window: each
window's gradient goes to its FIRST maximal element in row-major order (ties,
frequent in real activations, pass it to exactly one input).  The products are
``dy * 1`` and ``dy * 0``, so the comparison is exact, not within a tolerance.
The float64 finite-difference checks of the layer's gradient are in
``tests/test_conv.py`` (``test_conv_pool_gradients``), which runs this kernel.
"""
from __future__ import annotations

import numpy
import pytest

from towers.nn import kernels
from towers.nn.layers import Workspace


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


@pytest.mark.parametrize("shape, k", [((2, 6, 8, 3), 2), ((3, 7, 5, 4), 2), ((2, 9, 7, 2), 3)])
def test_maxpool_backward_equals_the_first_maximum_of_each_window(shape, k):
    rng = numpy.random.default_rng(0)
    # Few distinct values: many windows hold tied maxima, in every tap position.
    x = rng.integers(-2, 3, shape).astype(numpy.float32)
    ho, wo = -(-shape[1] // k), -(-shape[2] // k)
    y = numpy.empty((shape[0], ho, wo, shape[3]), numpy.float32)
    dy = rng.standard_normal(y.shape).astype(numpy.float32)
    ws = Workspace(numpy)
    kernels.maxpool(x, y, k, ws)
    for _ in range(2):  # the second call reuses the workspace's masks: no state left from the first
        dx = kernels.maxpool_backward(x, y, dy, k, ws)
        assert dx.shape == x.shape
        numpy.testing.assert_array_equal(dx, _reference_backward(x, dy, k))
