"""Convolution and max-pooling layers.

Both layers follow the layer API of ``towers.nn.layers`` (build / forward /
backward, scratch from a ``Workspace``, gradients written into views) and run
on NumPy or CuPy alike.  Activations are NHWC, as in the TensorFlow original,
which is also the layout in which im2col needs no transpose.

Conv2D (stride 1, SAME or VALID padding) is im2col + one matmul:

* forward: the input is copied into a zero-bordered buffer; ONE strided copy
  turns it into ``cols`` of shape (N*Ho*Wo, kh*kw*C) (row = output pixel, column
  = (i, j, c) tap, the order of a TF (kh, kw, C, F) kernel); ``y = cols @ W``
  is then already NHWC (N*Ho*Wo, F);
* backward: ``dW = cols.T @ dy``, ``db = sum(dy)``, and for the input gradient
  ``dcols = dy @ W.T`` followed by col2im: kh*kw strided adds into the padded
  buffer.

Limits: stride 1 only; ``cols`` costs N*Ho*Wo*kh*kw*C floats (63 MB for LeNet's
second convolution at batch 100), which is why evaluation runs in chunks.

MaxPool2D (k x k window, stride k, TF SAME padding) reshapes the input to
(N, Ho, k, Wo, k, C) and reduces the two window axes.  Its gradient goes to the
FIRST maximal element of each window (row-major), so a window of tied values
(frequent after a ReLU: all zeros) still passes its gradient to exactly one
input, as TensorFlow's CPU kernel does.
"""
from __future__ import annotations

import numpy

from towers.errors import UserError
from towers.nn.layers import Layer, Param


def _as_strided(xp, a, shape, strides):
    """``as_strided`` of NumPy or CuPy (the same signature in both)."""
    return xp.lib.stride_tricks.as_strided(a, shape=shape, strides=strides)


def _nhwc(in_shape: tuple, who: str) -> tuple:
    """Per-example (H, W) or (H, W, C) -> (H, W, C); anything else is a UserError."""
    if len(in_shape) == 2:
        return tuple(in_shape) + (1,)
    if len(in_shape) == 3:
        return tuple(in_shape)
    raise UserError(f"{who}: takes images (N, H, W) or (N, H, W, C), got per-example shape {in_shape}")


def _zeroed(ws, key: str, shape: tuple, dtype):
    """A workspace buffer that was zero-filled when (and only when) it was first made.

    Callers write only its interior, so the zero border survives across steps.
    """
    a = ws.array(key, shape, dtype)
    tag = (key, tuple(shape), numpy.dtype(dtype).str)
    if ws.saved.get(("zeroed",) + tag) is not a:
        a.fill(0)
        ws.saved[("zeroed",) + tag] = a
    return a


class Conv2D(Layer):
    """2-D convolution, stride 1, ``SAME`` or ``VALID``: im2col + one matmul.

    Parameters (TF layout): ``weights`` (kh, kw, C, F) truncated-normal(stddev),
    ``biases`` (F,) constant ``bias``.  ``regularize`` puts the weights under L2.
    """

    def __init__(self, scope: str, filters: int, ksize: int = 5, padding: str = "SAME",
                 stddev: float = 0.1, bias: float = 0.0, regularize: bool = False):
        if padding not in ("SAME", "VALID"):
            raise UserError(f"{scope}: padding must be SAME or VALID, got {padding!r}")
        self.scope, self.filters, self.k = scope, int(filters), int(ksize)
        self.padding, self.stddev, self.bias, self.regularize = padding, float(stddev), float(bias), regularize

    def build(self, in_shape):
        h, w, c = self.in_hwc = _nhwc(tuple(in_shape), self.scope)
        k = self.k
        if self.padding == "SAME":
            self.pad = ((k - 1) // 2, (k - 1) // 2)  # top/left; TF puts the odd extra row at the end
            ho, wo = h, w
        else:
            self.pad = (0, 0)
            ho, wo = h - k + 1, w - k + 1
        if ho < 1 or wo < 1:
            raise UserError(f"{self.scope}: a {k}x{k} VALID convolution does not fit images of {h}x{w}")
        self.out_hw = (ho, wo)
        return [
            Param("weights", (k, k, c, self.filters), f"truncated_normal:{self.stddev}", self.regularize),
            Param("biases", (self.filters,), f"constant:{self.bias}" if self.bias else "zeros", False),
        ], (ho, wo, self.filters)

    def _cols(self, x, ws):
        """im2col: (N, H, W[, C]) -> (N*Ho*Wo, kh*kw*C) in the workspace."""
        xp, k = ws.xp, self.k
        n = x.shape[0]
        h, w, c = self.in_hwc
        ho, wo = self.out_hw
        x = x.reshape(n, h, w, c)
        hp, wp = ho + k - 1, wo + k - 1
        if (hp, wp) == (h, w):  # VALID: read the input in place
            src = x if x.flags.c_contiguous else xp.ascontiguousarray(x)
        else:
            src = _zeroed(ws, "xpad", (n, hp, wp, c), x.dtype)
            t, l = self.pad
            src[:, t : t + h, l : l + w, :] = x
        s = src.strides
        # Window view (n, ho, wo, i, j, c): the (j, c) run of a tap row is
        # contiguous in src, so this is one strided copy with kw*C-long runs.
        win = _as_strided(xp, src, (n, ho, wo, k, k, c), (s[0], s[1], s[2], s[1], s[2], s[3]))
        cols = ws.array("cols", (n, ho, wo, k, k, c), x.dtype)
        cols[...] = win
        return cols.reshape(n * ho * wo, k * k * c)

    def forward(self, p, x, ws):
        xp = ws.xp
        n = x.shape[0]
        cols = self._cols(x, ws)
        ho, wo = self.out_hw
        y = ws.array("y", (n, ho, wo, self.filters), x.dtype)
        y2 = y.reshape(-1, self.filters)
        xp.matmul(cols, p["weights"].reshape(-1, self.filters), out=y2)
        y2 += p["biases"]
        ws.saved["cols"], ws.saved["x_shape"] = cols, x.shape
        return y

    def backward(self, p, g, dy, ws, need_dx):
        xp, k, f = ws.xp, self.k, self.filters
        cols = ws.saved["cols"]
        dy2 = dy.reshape(-1, f)  # dy is a contiguous NHWC buffer: a view
        xp.matmul(cols.T, dy2, out=g["weights"].reshape(-1, f))
        xp.sum(dy2, axis=0, out=g["biases"])
        if not need_dx:
            return None
        n = dy.shape[0]
        h, w, c = self.in_hwc
        ho, wo = self.out_hw
        dcols = ws.array("dcols", (n, ho, wo, k, k, c), dy.dtype)
        xp.matmul(dy2, p["weights"].reshape(-1, f).T, out=dcols.reshape(n * ho * wo, k * k * c))
        # col2im: each tap (i, j) adds its slice back where it was read from.
        dpad = ws.array("dpad", (n, ho + k - 1, wo + k - 1, c), dy.dtype)
        dpad.fill(0)
        for i in range(k):
            for j in range(k):
                dpad[:, i : i + ho, j : j + wo, :] += dcols[:, :, :, i, j, :]
        t, l = self.pad
        if dpad.shape[1:3] == (h, w):
            return dpad.reshape(ws.saved["x_shape"])
        dx = ws.array("dx", (n, h, w, c), dy.dtype)
        dx[...] = dpad[:, t : t + h, l : l + w, :]
        return dx.reshape(ws.saved["x_shape"])


class MaxPool2D(Layer):
    """k x k max-pooling with stride k and TF SAME padding (ceil(H/k) x ceil(W/k))."""

    def __init__(self, ksize: int = 2):
        self.k = int(ksize)

    def build(self, in_shape):
        h, w, c = self.in_hwc = _nhwc(tuple(in_shape), "MaxPool2D")
        k = self.k
        ho, wo = -(-h // k), -(-w // k)
        self.out_hwc = (ho, wo, c)
        return [], self.out_hwc

    def _windows(self, x, ws):
        """(N, Ho, k, Wo, k, C) view of the input, padded with -inf at the end when needed."""
        k = self.k
        n = x.shape[0]
        h, w, c = self.in_hwc
        ho, wo, _ = self.out_hwc
        x = x.reshape(n, h, w, c)
        if (ho * k, wo * k) != (h, w):
            # SAME: TF pads the bottom/right only (total pad < k).  -inf never wins
            # a window, since every window holds at least one real element.
            xp_ = ws.array("xpad", (n, ho * k, wo * k, c), x.dtype)
            xp_.fill(-numpy.inf)
            xp_[:, :h, :w, :] = x
            x = xp_
        return x.reshape(n, ho, k, wo, k, c)

    def forward(self, p, x, ws):
        xp = ws.xp
        win = self._windows(x, ws)
        n = x.shape[0]
        y = ws.array("y", (n,) + self.out_hwc, x.dtype)
        # k*k elementwise maxima over strided views: several times faster than a
        # reduction over the two non-adjacent window axes.
        y[...] = win[:, :, 0, :, 0, :]
        for a in range(self.k):
            for b in range(self.k):
                if a or b:
                    xp.maximum(y, win[:, :, a, :, b, :], out=y)
        ws.saved["win"], ws.saved["y"], ws.saved["x_shape"] = win, y, x.shape
        return y

    def backward(self, p, g, dy, ws, need_dx):
        if not need_dx:
            return None
        xp, k = ws.xp, self.k
        win, y = ws.saved["win"], ws.saved["y"]
        n, ho, _, wo, _, c = win.shape
        dwin = ws.array("dwin", win.shape, dy.dtype)
        left = ws.array("left", y.shape, dy.dtype)  # 1 until the window's max is claimed
        left.fill(1)
        eq = ws.array("eq", y.shape, dy.dtype)
        for a in range(k):
            for b in range(k):
                xp.equal(win[:, :, a, :, b, :], y, out=eq)  # 1.0 / 0.0: no bool temporary
                eq *= left  # only the first maximum of each window
                left -= eq
                xp.multiply(dy, eq, out=dwin[:, :, a, :, b, :])
        h, w, _ = self.in_hwc
        dx = dwin.reshape(n, ho * k, wo * k, c)
        if (ho * k, wo * k) != (h, w):
            out = ws.array("dx", (n, h, w, c), dy.dtype)
            out[...] = dx[:, :h, :w, :]
            dx = out
        return dx.reshape(ws.saved["x_shape"])


__all__ = ["Conv2D", "MaxPool2D"]
