"""Convolution and max-pooling layers.

Both layers follow the layer API of ``towers.nn.layers`` (build / forward /
backward, scratch from a ``Workspace``, gradients written into views) and run
on NumPy or CuPy alike.  Activations are NHWC, as in the TensorFlow original,
which is also the layout in which im2col needs no transpose.

Conv2D (stride 1, SAME or VALID padding) is im2col + one matmul:

* forward: im2col (``towers.nn.kernels.im2col``: on the CPU the input is
  copied into a zero-bordered buffer and ONE strided copy, on a GPU one
  kernel) turns it into ``cols`` of shape (N*Ho*Wo, kh*kw*C) (row = output pixel, column
  = (i, j, c) tap, the order of a TF (kh, kw, C, F) kernel); ``y = cols @ W``
  is then already NHWC (N*Ho*Wo, F);
* backward: ``dW = cols.T @ dy``, ``db = sum(dy)``, and for the input gradient
  ``dcols = dy @ W.T`` followed by col2im (kh*kw strided adds into a padded
  buffer on the CPU, one gathering kernel on a GPU).

Limits: stride 1 only; ``cols`` costs N*Ho*Wo*kh*kw*C floats (63 MB for LeNet's
second convolution at batch 100), which is why evaluation runs in chunks.

MaxPool2D (k x k window, stride k, TF SAME padding): on the CPU k*k maxima
over strided (N, Ho, k, Wo, k, C) window views, on a GPU one kernel each way
(``towers.nn.kernels.maxpool``, ``maxpool_backward``).  Its gradient goes to the
FIRST maximal element of each window (row-major), so a window of tied values
(frequent after a ReLU: all zeros) still passes its gradient to exactly one
input, as TensorFlow's CPU kernel does.
"""
from __future__ import annotations

from towers.errors import UserError
from towers.nn import kernels
from towers.nn.layers import Layer, Param


def _nhwc(in_shape: tuple, who: str) -> tuple:
    """Per-example (H, W) or (H, W, C) -> (H, W, C); anything else is a UserError."""
    if len(in_shape) == 2:
        return tuple(in_shape) + (1,)
    if len(in_shape) == 3:
        return tuple(in_shape)
    hint = ("; flat examples need their image shape: for TFRecord bytes `decode` NAME:uint8:H,W "
            "(e.g. image_raw:uint8:28,28), for an npz x reshaped to (N, H, W)") if len(in_shape) == 1 else ""
    raise UserError(f"{who}: takes images (N, H, W) or (N, H, W, C), got per-example shape {in_shape}{hint}")


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
        k, n = self.k, x.shape[0]
        h, w, c = self.in_hwc
        ho, wo = self.out_hw
        cols = ws.array("cols", (n, ho, wo, k, k, c), x.dtype)
        kernels.im2col(x.reshape(n, h, w, c), cols, self.pad, ws)
        return cols.reshape(n * ho * wo, k * k * c)

    def forward(self, p, x, ws):
        n = x.shape[0]
        cols = self._cols(x, ws)
        ho, wo = self.out_hw
        y = ws.array("y", (n, ho, wo, self.filters), x.dtype)
        y2 = y.reshape(-1, self.filters)
        kernels.gemm(cols, p["weights"].reshape(-1, self.filters), y2)
        kernels.bias_add(y2, p["biases"])
        ws.saved["cols"], ws.saved["x_shape"] = cols, x.shape
        return y

    def backward(self, p, g, dy, ws, need_dx):
        k, f = self.k, self.filters
        cols = ws.saved["cols"]
        dy2 = dy.reshape(-1, f)  # dy is a contiguous NHWC buffer: a view
        kernels.gemm(cols, dy2, g["weights"].reshape(-1, f), trans_a=True)
        kernels.bias_grad(dy2, g["biases"], ws)
        if not need_dx:
            return None
        n = dy.shape[0]
        h, w, c = self.in_hwc
        ho, wo = self.out_hw
        dcols = ws.array("dcols", (n, ho, wo, k, k, c), dy.dtype)
        kernels.gemm(dy2, p["weights"].reshape(-1, f), dcols.reshape(n * ho * wo, k * k * c), trans_b=True)
        # col2im: each tap (i, j) adds its slice back where it was read from.
        dx = kernels.col2im(dcols, (h, w), self.pad, ws)
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

    def forward(self, p, x, ws):
        n, x_shape = x.shape[0], x.shape
        h, w, c = self.in_hwc
        x = x.reshape(n, h, w, c)
        y = ws.array("y", (n,) + self.out_hwc, x.dtype)
        kernels.maxpool(x, y, self.k, ws)
        ws.saved["x"], ws.saved["y"], ws.saved["x_shape"] = x, y, x_shape
        return y

    def backward(self, p, g, dy, ws, need_dx):
        if not need_dx:
            return None
        dx = kernels.maxpool_backward(ws.saved["x"], ws.saved["y"], dy, self.k, ws)
        return dx.reshape(ws.saved["x_shape"])


__all__ = ["Conv2D", "MaxPool2D"]
