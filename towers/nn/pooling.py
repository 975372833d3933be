"""Pooling layers: ``MaxPool2D``, ``AvgPool2D`` (k x k windows at a stride) and ``GlobalAvgPool``.

All follow the layer API of ``towers.nn.layers`` and run on NumPy or CuPy;
activations are NHWC; shapes and padding follow ``towers.nn.windows``
(TensorFlow's rules).

MaxPool2D.  Windows that tile the image (stride = k, no padding on top/left,
LeNet-5's 2x2) take the dedicated op of ``towers.ops.maxpool`` (``maxpool``,
``maxpool_backward``: on the CPU k*k maxima over strided views or one
compiled pass, on a GPU one kernel each way).  Any other window (the CIFAR-10 model's 3x3 at stride 2)
takes array operations on either device: the input in a -inf-bordered
buffer, k*k maxima over strided tap views; backward walks the taps in
row-major order and gives each window's gradient to its FIRST maximal element
(a window of tied values, frequent after a ReLU, passes its gradient to
exactly one input, as TensorFlow's CPU kernel does); overlapping windows add.

AvgPool2D.  The mean of each window's real elements: with ``same`` padding a
border window divides by the count of its pixels inside the image, as
TensorFlow's ``avg_pool`` does.

GlobalAvgPool.  (N, H, W, C) -> (N, C), the mean over H and W (the head of a
ResNet).
"""
from __future__ import annotations

import numpy

from towers.nn.layers import Layer
from towers.nn.windows import check_padding, nhwc, positive, window_geometry
from towers.ops.im2col import crop, padded
from towers.ops.maxpool import maxpool, maxpool_backward


class _Pool2D(Layer):
    """k x k windows at ``stride`` (default k) with TF ``padding``: shapes and tap views."""

    def __init__(self, ksize: int, stride: int | None, padding, name: str):
        self.name = name
        self.k = positive(ksize, "ksize", name)
        self.stride = self.k if stride is None else positive(stride, "stride", name)
        self.padding = check_padding(padding, name)

    def build(self, in_shape):
        h, w, c = self.in_hwc = nhwc(tuple(in_shape), self.name)
        self.out_hw, self.pad = window_geometry((h, w), self.k, self.stride, self.padding, self.name)
        ho, wo = self.out_hw
        self.span = ((ho - 1) * self.stride + self.k, (wo - 1) * self.stride + self.k)  # rows/cols windows read
        return [], self.out_hw + (c,)

    def _taps(self, src):
        """(a, b, view): the (n, Ho, Wo, c) strided view of tap (a, b) of every window, row-major."""
        s, (ho, wo) = self.stride, self.out_hw
        for a in range(self.k):
            for b in range(self.k):
                yield a, b, src[:, a: a + s * (ho - 1) + 1: s, b: b + s * (wo - 1) + 1: s, :]

    def _input(self, x, ws, fill: float):
        n = x.shape[0]
        return padded(ws, "xpad", x.reshape((n,) + self.in_hwc), self.pad, self.span, fill)


class MaxPool2D(_Pool2D):
    """k x k max-pooling at ``stride`` (default k), TF ``padding`` (default SAME)."""

    def __init__(self, ksize: int = 2, stride: int | None = None, padding="SAME"):
        super().__init__(ksize, stride, padding, "MaxPool2D")

    def build(self, in_shape):
        params, out = super().build(in_shape)
        # The tiling windows of the dedicated kernels pad at the bottom/right only.
        self._tiling = self.stride == self.k and self.padding == "same" and self.pad == (0, 0)
        return params, out

    def forward(self, p, x, ws):
        n, x_shape = x.shape[0], x.shape
        y = ws.array("y", (n,) + self.out_hw + (self.in_hwc[2],), x.dtype)
        if self._tiling:
            x = x.reshape((n,) + self.in_hwc)
            maxpool(x, y, self.k, ws)
        else:
            x = self._input(x, ws, -numpy.inf)
            for a, b, tap in self._taps(x):
                if a or b:
                    ws.xp.maximum(y, tap, out=y)
                else:
                    y[...] = tap
        ws.saved["x"], ws.saved["y"], ws.saved["x_shape"] = x, y, x_shape
        return y

    def backward(self, p, g, dy, ws, need_dx):
        if not need_dx:
            return None
        x, y = ws.saved["x"], ws.saved["y"]
        if self._tiling:
            return maxpool_backward(x, y, dy, self.k, ws).reshape(ws.saved["x_shape"])
        xp = ws.xp
        dpad = ws.array("dpad", x.shape, dy.dtype)
        dpad.fill(0)
        left = ws.array("left", y.shape, dy.dtype)  # 1 until the window's max is claimed
        left.fill(1)
        eq = ws.array("eq", y.shape, dy.dtype)
        for (_, _, tap), (_, _, dtap) in zip(self._taps(x), self._taps(dpad)):
            xp.equal(tap, y, out=eq)  # 1.0 / 0.0: no bool temporary
            eq *= left  # only the first maximum of each window
            left -= eq
            eq *= dy
            dtap += eq
        return crop(ws, dpad, self.pad, self.in_hwc[:2]).reshape(ws.saved["x_shape"])


class AvgPool2D(_Pool2D):
    """k x k average pooling at ``stride`` (default k), TF ``padding`` (default VALID).

    A window divides by the number of its pixels inside the image (padding
    does not count), as TensorFlow's ``avg_pool``.
    """

    def __init__(self, ksize: int = 2, stride: int | None = None, padding="VALID"):
        super().__init__(ksize, stride, padding, "AvgPool2D")

    def build(self, in_shape):
        params, out = super().build(in_shape)
        # 1 / (pixels inside the image) per window, from the same tap views over a mask.
        inside = numpy.zeros((1,) + self.span + (1,), numpy.float64)
        (t, l), (h, w) = self.pad, self.in_hwc[:2]
        inside[:, t: t + h, l: l + w] = 1
        count = sum(tap for _, _, tap in self._taps(inside))
        self._inv_count = 1.0 / count[0]  # (Ho, Wo, 1), float64 until a dtype asks
        return params, out

    def forward(self, p, x, ws):
        n, x_shape = x.shape[0], x.shape
        y = ws.array("y", (n,) + self.out_hw + (self.in_hwc[2],), x.dtype)
        x = self._input(x, ws, 0.0)
        for a, b, tap in self._taps(x):
            if a or b:
                y += tap
            else:
                y[...] = tap
        y *= ws.constant("inv_count", self._inv_count, y.dtype)
        ws.saved["x_padded_shape"], ws.saved["x_shape"] = x.shape, x_shape
        return y

    def backward(self, p, g, dy, ws, need_dx):
        if not need_dx:
            return None
        dpad = ws.array("dpad", ws.saved["x_padded_shape"], dy.dtype)
        dpad.fill(0)
        share = ws.array("share", dy.shape, dy.dtype)
        ws.xp.multiply(dy, ws.constant("inv_count", self._inv_count, dy.dtype), out=share)
        for _, _, dtap in self._taps(dpad):
            dtap += share
        return crop(ws, dpad, self.pad, self.in_hwc[:2]).reshape(ws.saved["x_shape"])


class GlobalAvgPool(Layer):
    """(N, H, W, C) -> (N, C): the mean over each channel's pixels ((N, H, W): one channel)."""

    def build(self, in_shape):
        h, w, c = self.in_hwc = nhwc(tuple(in_shape), "GlobalAvgPool")
        return [], (c,)

    def forward(self, p, x, ws):
        n, (h, w, c) = x.shape[0], self.in_hwc
        y = ws.array("y", (n, c), x.dtype)
        ws.xp.sum(x.reshape(n, h * w, c), axis=1, out=y)
        y *= y.dtype.type(1.0 / (h * w))
        ws.saved["x_shape"] = x.shape
        return y

    def backward(self, p, g, dy, ws, need_dx):
        if not need_dx:
            return None
        n, (h, w, c) = dy.shape[0], self.in_hwc
        dx = ws.array("dx", (n, h * w, c), dy.dtype)
        dx[...] = (dy * dy.dtype.type(1.0 / (h * w)))[:, None, :]
        return dx.reshape(ws.saved["x_shape"])
