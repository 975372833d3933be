"""Convolution: ``Conv2D`` (im2col + one matmul), and the shape rules of 2-D windows.

The layer follows the layer API of ``towers.nn.layers`` (build / forward /
backward, scratch from a ``Workspace``, gradients written into views) and runs
on NumPy or CuPy alike.  Activations are NHWC, as in the TensorFlow original,
which is also the layout in which im2col needs no transpose.

Conv2D (any stride; padding ``same`` as TensorFlow's, ``valid``, or a number
of zero pixels on every side; optional bias) is im2col + one matmul:

* forward: im2col (``towers.nn.kernels.im2col``: on the CPU the input is
  copied into a zero-bordered buffer and ONE strided copy, on a GPU one
  kernel at stride 1) turns it into ``cols`` of shape (N*Ho*Wo, kh*kw*C) (row
  = output pixel, column = (i, j, c) tap, the order of a TF (kh, kw, C, F)
  kernel); ``y = cols @ W`` is then already NHWC (N*Ho*Wo, F);
* backward: ``dW = cols.T @ dy``, ``db = sum(dy)``; the input gradient either
  as ``dcols = dy @ W.T`` followed by col2im (kh*kw strided adds into a padded
  buffer on the CPU, one gathering kernel on a GPU), or, at stride 1, as the
  forward convolution of ``dy`` with the kernel turned 180 degrees and its
  channels swapped (``dx_by="conv"``: im2col of ``dy`` + one matmul, several
  times faster on the CPU than col2im's strided adds: 10 ms against 49 ms for
  a ResNet's 32x32x16 layer at batch 32).  Both give the same sums in another
  order; ``lenet5`` keeps col2im, which its published bits depend on.

Limits: ``cols`` costs N*Ho*Wo*kh*kw*C floats (63 MB for LeNet's second
convolution at batch 100), which is why evaluation runs in chunks.  Strides
above 1 take array operations on a GPU too (no dedicated kernel).

Output shapes and padding follow ``towers.nn.windows``.
"""
from __future__ import annotations

from towers.errors import UserError
from towers.nn import kernels
from towers.nn.layers import Layer, Param
from towers.nn.pooling import MaxPool2D  # it lived here: kept importable from here
from towers.nn.windows import check_padding, nhwc, positive, window_geometry


class Conv2D(Layer):
    """2-D convolution (stride, TF padding), im2col + one matmul.

    Parameters (TF layout): ``weights`` (kh, kw, C, F), truncated-normal
    (``stddev``), or He et al.'s normal(0, sqrt(2 / (kh*kw*C))) with
    ``stddev="he"``; ``biases`` (F,) constant ``bias``, none with
    ``bias=False``.  ``regularize`` puts the weights under L2.  ``dx_by``:
    ``"conv"`` (default; stride 1 only, else col2im) or ``"col2im"``, the
    input gradient's algorithm (module doc).
    """

    def __init__(self, scope: str, filters: int, ksize: int = 5, padding="SAME", stddev=0.1, bias=0.0,
                 regularize: bool = False, stride: int = 1, dx_by: str = "conv"):
        self.padding = check_padding(padding, scope)
        self.k, self.stride = positive(ksize, "ksize", scope), positive(stride, "stride", scope)
        if stddev != "he" and not (isinstance(stddev, (int, float)) and stddev > 0):
            raise UserError(f"{scope}: stddev must be a number > 0 or 'he', got {stddev!r}")
        if dx_by not in ("conv", "col2im"):
            raise UserError(f"{scope}: dx_by must be conv or col2im, got {dx_by!r}")
        self.scope, self.filters = scope, int(filters)
        self.stddev, self.regularize, self.dx_by = stddev, regularize, dx_by
        self.bias = None if bias is False else float(bias)

    def build(self, in_shape):
        h, w, c = self.in_hwc = nhwc(tuple(in_shape), self.scope)
        k, s = self.k, self.stride
        self.out_hw, self.pad = window_geometry((h, w), k, s, self.padding, self.scope)
        # The input gradient as a convolution of dy reads dy padded by k-1-pad
        # on top; only at stride 1, and while that padding is not negative.
        self._dx_conv = self.dx_by == "conv" and s == 1 and max(self.pad) <= k - 1
        init = (f"normal:{(2.0 / (k * k * c)) ** 0.5}" if self.stddev == "he"
                else f"truncated_normal:{float(self.stddev)}")
        params = [Param("weights", (k, k, c, self.filters), init, self.regularize)]
        if self.bias is not None:
            params.append(Param("biases", (self.filters,), f"constant:{self.bias}" if self.bias else "zeros", False))
        return params, self.out_hw + (self.filters,)

    def _cols(self, x, ws):
        """im2col: (N, H, W[, C]) -> (N*Ho*Wo, kh*kw*C) in the workspace."""
        k, n = self.k, x.shape[0]
        h, w, c = self.in_hwc
        ho, wo = self.out_hw
        cols = ws.array("cols", (n, ho, wo, k, k, c), x.dtype)
        kernels.im2col(x.reshape(n, h, w, c), cols, self.pad, ws, self.stride)
        return cols.reshape(n * ho * wo, k * k * c)

    def forward(self, p, x, ws):
        n = x.shape[0]
        cols = self._cols(x, ws)
        ho, wo = self.out_hw
        y = ws.array("y", (n, ho, wo, self.filters), x.dtype)
        y2 = y.reshape(-1, self.filters)
        kernels.gemm(cols, p["weights"].reshape(-1, self.filters), y2)
        if self.bias is not None:
            kernels.bias_add(y2, p["biases"])
        ws.saved["cols"], ws.saved["x_shape"] = cols, x.shape
        return y

    def backward(self, p, g, dy, ws, need_dx):
        k, f = self.k, self.filters
        cols = ws.saved["cols"]
        dy2 = dy.reshape(-1, f)  # dy is a contiguous NHWC buffer: a view
        kernels.gemm(cols, dy2, g["weights"].reshape(-1, f), trans_a=True)
        if self.bias is not None:
            kernels.bias_grad(dy2, g["biases"], ws)
        if not need_dx:
            return None
        n = dy.shape[0]
        h, w, c = self.in_hwc
        ho, wo = self.out_hw
        if self._dx_conv:
            return self._dx_as_conv(p["weights"], dy.reshape(n, ho, wo, f), ws).reshape(ws.saved["x_shape"])
        dcols = ws.array("dcols", (n, ho, wo, k, k, c), dy.dtype)
        kernels.gemm(dy2, p["weights"].reshape(-1, f), dcols.reshape(n * ho * wo, k * k * c), trans_b=True)
        # col2im: each tap (i, j) adds its slice back where it was read from.
        dx = kernels.col2im(dcols, (h, w), self.pad, ws, self.stride)
        return dx.reshape(ws.saved["x_shape"])

    def _dx_as_conv(self, weights, dy, ws):
        """dx[i] = sum_a dy[i + top - a] W[a]: dy, padded by k-1-top, convolved with W turned 180 degrees."""
        k, f = self.k, self.filters
        n = dy.shape[0]
        h, w, c = self.in_hwc
        w_rot = ws.array("w_rot", (k, k, f, c), weights.dtype)
        w_rot[...] = weights[::-1, ::-1].transpose(0, 1, 3, 2)
        dcols = ws.array("dy_cols", (n, h, w, k, k, f), dy.dtype)
        kernels.im2col(dy, dcols, (k - 1 - self.pad[0], k - 1 - self.pad[1]), ws.child(0))
        dx = ws.array("dx", (n, h, w, c), dy.dtype)
        kernels.gemm(dcols.reshape(n * h * w, k * k * f), w_rot.reshape(k * k * f, c), dx.reshape(-1, c))
        return dx


__all__ = ["Conv2D", "MaxPool2D"]
