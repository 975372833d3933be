"""Convolution: ``Conv2D`` (im2col + one matmul), and the shape rules of 2-D windows.

The layer follows the layer API of ``towers.nn.layers`` (build / forward /
backward, scratch from a ``Workspace``, gradients written into views) and runs
on NumPy or CuPy alike.  Activations are NHWC, as in the TensorFlow original,
which is also the layout in which im2col needs no transpose.

Conv2D (any stride; padding ``same`` as TensorFlow's, ``valid``, or a number
of zero pixels on every side; optional bias) is im2col + matmuls:

* forward: im2col (``towers.ops.im2col``: on the CPU the input is
  copied into a zero-bordered buffer and ONE strided copy of whole window
  rows, on a GPU one kernel at stride 1) turns it into ``cols`` of shape
  (N*Ho*Wo, kh*kw*C) (row = output pixel, column = (i, j, c) tap, the order
  of a TF (kh, kw, C, F) kernel); ``y = cols @ W`` is then already NHWC
  (N*Ho*Wo, F).  On the CPU the copies' views are planned once per input
  buffer (``im2col_plan``), so a chunk costs its copies and GEMMs;
* backward: ``db = sum(dy)``, ``dW`` and the input gradient (below).

Two algorithms, ``algorithm=``:

* ``"chunked"`` (the default; why, with measurements: docs/architecture.md,
  "Why some paths are as they are").  On the CPU the batch goes through in
  chunks of images whose ``cols`` fit in about ``CHUNK_BYTES`` (a core's L2
  cache), im2col'd again in backward instead of kept.  At stride 1 backward
  makes ONE im2col, of ``dy`` padded by k-1-pad (row = input pixel): the input
  gradient is the forward convolution of ``dy`` with the kernel turned 180
  degrees and its channels swapped, and ``dW`` is ``x^T @ dcols`` with the taps
  turned back.  With more filters than input channels (F > C) ``dW = cols(x)^T
  @ dy`` from x's im2col instead (``_dw_from_x``), and dy's im2col gives the
  input gradient alone; under the compiled CPU forms (``towers.ops.forms``)
  such a layer's input gradient is ``dcols = dy @ W.T`` and the compiled col2im,
  so the two CPU modes sum it in different orders.  At other strides, and for
  the first layer (no input gradient), ``dW = cols.T @ dy`` from ``x``'s
  im2col, and ``dcols = dy @ W.T`` and col2im (compiled, with the same bits,
  under the compiled forms).  On a GPU: one chunk, the whole batch.
* ``"whole"``: the batch's ``cols`` in one piece, kept for backward; the input
  gradient by ``dcols = dy @ W.T`` and col2im (kh*kw strided adds into a padded
  buffer on the CPU, one gathering kernel on a GPU).  No built-in model uses
  it (it is slower).  ``cols`` costs N*Ho*Wo*kh*kw*C floats, which is why
  evaluation runs in chunks.

Both give the same sums in other orders.  Strides above 1 take array
operations on a GPU (no dedicated kernel).

On a GPU with ``gpu_conv`` cudnn (``towers.ops.forms``) the three
products run on cuDNN instead (``towers.ops.conv``: forward, weight
gradient, input gradient; no im2col), on the NHWC activations as they are and
a KRSC copy of the kernel (F, kh, kw, C: cuDNN's channels-last filter), made
in forward and read again by backward's input gradient; the weight gradient
comes out KRSC and is turned into its HWIO view of the flat buffer (one copy
each way per step).  A shape cuDNN refuses runs the im2col form above.  The
two agree to float32 rounding (other sums).

Output shapes and padding follow ``towers.nn.windows``.
"""
from __future__ import annotations

from towers.arrays import on_host
from towers.errors import UserError
from towers.nn.layers import Exported, Layer, Param
from towers.nn.pooling import MaxPool2D  # it lived here: kept importable from here
from towers.nn.windows import check_padding, nhwc, positive, window_geometry
from towers.ops import conv as device_conv
from towers.ops.bias import bias_add, bias_grad
from towers.ops.gemm import gemm
from towers.ops.forms import current as current_forms
from towers.ops.im2col import col2im, im2col, im2col_plan, run_im2col


CHUNK_BYTES = 1 << 20  # a CPU chunk's im2col buffer: about the size of a core's L2 cache


class Conv2D(Layer):
    """2-D convolution (stride, TF padding), im2col + matmuls (module doc).

    Parameters (TF layout): ``weights`` (kh, kw, C, F), truncated-normal
    (``stddev``), or He et al.'s normal(0, sqrt(2 / (kh*kw*C))) with
    ``stddev="he"``; ``biases`` (F,) constant ``bias``, none with
    ``bias=False``.  ``regularize`` puts the weights under L2.
    ``algorithm``: ``"chunked"`` (default) or ``"whole"`` (module doc).
    Exported as Keras' ``Conv2D`` (``kernel`` HWIO as is, ``bias``) and
    PyTorch's ``nn.Conv2d`` (``weight`` (F, C, kh, kw), ``bias``).
    """

    keeps_dy = True  # backward reads dy only

    def __init__(self, scope: str, filters: int, ksize: int = 5, padding="SAME", stddev=0.1, bias=0.0,
                 regularize: bool = False, stride: int = 1, algorithm: str = "chunked"):
        self.padding = check_padding(padding, scope)
        self.k, self.stride = positive(ksize, "ksize", scope), positive(stride, "stride", scope)
        if stddev != "he" and not (isinstance(stddev, (int, float)) and stddev > 0):
            raise UserError(f"{scope}: stddev must be a number > 0 or 'he', got {stddev!r}")
        if algorithm not in ("chunked", "whole"):
            raise UserError(f"{scope}: algorithm must be chunked or whole, got {algorithm!r}")
        self.scope, self.filters = scope, int(filters)
        self.stddev, self.regularize, self.algorithm = stddev, regularize, algorithm
        self.bias = None if bias is False else float(bias)

    def build(self, in_shape):
        h, w, c = self.in_hwc = nhwc(tuple(in_shape), self.scope)
        k, s = self.k, self.stride
        self.out_hw, self.pad = window_geometry((h, w), k, s, self.padding, self.scope)
        # The padding after the image (bottom, right), cuDNN's post-padding: a number of pixels pads both sides
        # alike (the windows that do not fit are dropped, as cuDNN's division rounds down); SAME's extra row
        # goes at the bottom (asymmetric only there); VALID none.
        self.post_pad = (self.pad if isinstance(self.padding, int) else
                         tuple(max(0, (o - 1) * s + k - n - p) for o, n, p in zip(self.out_hw, (h, w), self.pad)))
        # The input gradient as a convolution of dy reads dy padded by k-1-pad
        # on top; only at stride 1, and while that padding is not negative.
        self._dx_conv = self.algorithm == "chunked" and s == 1 and max(self.pad) <= k - 1
        # dW from x's im2col (k*k*C wide) rather than from dy's (k*k*F): one more im2col, and a GEMM
        # with the long side k*k*C, which BLAS runs faster when F > C (LeNet-5's conv2, 32 -> 64
        # channels: backward 22.4 -> 20.5 ms at batch 50; with F == C, as in ResNet-20, dy's is faster).
        self._dw_from_x = self._dx_conv and self.filters > c
        init = (f"normal:{(2.0 / (k * k * c)) ** 0.5}" if self.stddev == "he"
                else f"truncated_normal:{float(self.stddev)}")
        params = [Param("weights", (k, k, c, self.filters), init, self.regularize)]
        if self.bias is not None:
            params.append(Param("biases", (self.filters,), f"constant:{self.bias}" if self.bias else "zeros", False))
        return params, self.out_hw + (self.filters,)

    def exports(self, framework):
        return {"torch": {"weights": Exported("weight", lambda a, order: a.transpose(3, 2, 0, 1)),
                          "biases": Exported("bias")},
                "keras": {"weights": Exported("kernel"), "biases": Exported("bias")}}.get(framework, {})

    # -- both algorithms

    def _im2col_chunks(self, a, ws, of_dy=False):
        """Yield ``((b0, b1), cols)`` per chunk of the batch (``_chunks``), each chunk's im2col made just before.

        ``cols`` (rows, k*k*C) is the im2col of ``a``, x (row = output pixel),
        or with ``of_dy`` of dy padded by k-1-pad (row = input pixel,
        ``_backward_as_conv``; its padded buffer in ``ws.child(0)``, as its pad
        may differ).  On the CPU from ``kernels.im2col_plan``'s views, kept
        while ``a`` is the same memory (address, shape, strides): ``Conv2D`` is
        handed the same buffers step after step, and backward's im2col of x
        reuses the forward's plan.
        """
        k = self.k
        if of_dy:
            (h, w), c, out_hw, stride = self.out_hw, self.filters, self.in_hwc[:2], 1
            pad, key, pad_ws = (k - 1 - self.pad[0], k - 1 - self.pad[1]), "dy_cols", ws.child(0)
        else:
            (h, w, c), out_hw, stride, pad, key, pad_ws = self.in_hwc, self.out_hw, self.stride, self.pad, "cols", ws
        n = a.shape[0]
        a4 = a.reshape(n, h, w, c)

        def cols_of(m):
            return ws.array(key, (m,) + out_hw + (k, k, c), a.dtype)

        chunks = self._chunks(a, c if of_dy else None)
        if not (on_host(a) and a4.flags.c_contiguous):
            for b0, b1 in chunks:
                cols = cols_of(b1 - b0)
                im2col(a4[b0:b1], cols, pad, pad_ws, stride)
                yield (b0, b1), cols.reshape(-1, k * k * c)
            return
        # The same memory, not just the same object: a layer's backward returns a new view of its
        # buffer each step.  The plan holds ``a``, so no other array can take over its address.
        where = (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype, chunks)
        plan = ws.saved.get(key + "_plan")
        if plan is None or plan[1] != where:
            plan = ws.saved[key + "_plan"] = (a, where, im2col_plan(a4, cols_of, pad, pad_ws, stride, chunks))
        for chunk, step in zip(chunks, plan[2]):
            run_im2col(step)
            yield chunk, step[-1]

    def _chunks(self, x, channels=None):
        """Image ranges [b0, b1) of the batch: cache-sized on the CPU, the whole batch on a GPU.

        The size is that of the forward's im2col of ``x``, or with ``channels``
        that of the input-sized im2col of ``dy`` (``_backward_as_conv``).
        """
        n = x.shape[0]
        if self.algorithm == "whole" or not on_host(x):
            return [(0, n)]
        hw = self.in_hwc[:2] if channels else self.out_hw
        per_image = hw[0] * hw[1] * self.k * self.k * (channels or self.in_hwc[2]) * x.dtype.itemsize
        step = max(1, CHUNK_BYTES // per_image)
        return [(b, min(b + step, n)) for b in range(0, n, step)]

    def forward(self, p, x, ws):
        n, f = x.shape[0], self.filters
        ho, wo = self.out_hw
        y = ws.array("y", (n, ho, wo, f), x.dtype)
        ws.saved["cudnn"] = device_conv.forward(x.reshape((n,) + self.in_hwc), self._krsc(p, ws), y, *self._geometry)
        if not ws.saved["cudnn"]:
            w2, y2, rows = p["weights"].reshape(-1, f), y.reshape(-1, f), ho * wo
            for (b0, b1), cols in self._im2col_chunks(x, ws):
                gemm(cols, w2, y2[b0 * rows: b1 * rows])
        if self.bias is not None:
            bias_add(y.reshape(-1, f), p["biases"])
        # "whole" keeps the batch's im2col for backward (one chunk); "chunked" recomputes it there.
        ws.saved["x"], ws.saved["x_shape"] = x, x.shape
        return y

    def backward(self, p, g, dy, ws, need_dx):
        x, f = ws.saved["x"], self.filters
        dy2 = dy.reshape(-1, f)  # dy is a contiguous NHWC buffer: a view
        if self.bias is not None:
            bias_grad(dy2, g["biases"], ws)
        n = dy.shape[0]
        x4, dy4 = x.reshape((n,) + self.in_hwc), dy.reshape((n,) + self.out_hw + (f,))
        dw = ws.array("dw_krsc", (f, self.k, self.k, self.in_hwc[2]), dy.dtype) if ws.saved.get("cudnn") else None
        if dw is not None and device_conv.weight_grad(x4, dy4, dw, *self._geometry):
            g["weights"][...] = dw.transpose(1, 2, 3, 0)
            if not need_dx:
                return None
            dx = ws.array("dx", x4.shape, dy.dtype)
            if not device_conv.data_grad(dy4, ws.saved["w_krsc"], dx, *self._geometry):
                dx = self._dx(p["weights"], dy4, ws)
            return dx.reshape(ws.saved["x_shape"])
        if ws.saved.get("cudnn"):  # the forward ran on cuDNN: the im2col of x that backward reads is made here
            for _ in self._im2col_chunks(x, ws):
                pass
        gw = g["weights"].reshape(-1, f)
        # F > C on CPU towers with the compiled forms: dW from x's im2col and dx by col2im, one compiled gather
        # (LeNet-5's conv2: dx 10.6 -> 8.1 ms at batch 50); without them NumPy's col2im is slower than dy's im2col.
        # Measured on the CPU only: a GPU keeps its path (and its results).
        from_x = self._dw_from_x and on_host(dy)
        if need_dx and self._dx_conv and not (from_x and current_forms().compiled):
            if from_x:
                self._weight_grad(x, dy2, gw, ws)
            return self._backward_as_conv(p["weights"], None if from_x else gw, x, dy, ws)
        chunks = self._weight_grad(x, dy2, gw, ws)
        if not need_dx:
            return None
        dx = ws.array("dx_batch", (n,) + self.in_hwc, dy.dtype) if len(chunks) > 1 else None
        for b0, b1 in chunks:
            view = dx[b0:b1] if dx is not None else None
            part = self._dx(p["weights"], dy[b0:b1], ws, view)
            if dx is None:
                dx = part
            elif part is not view:  # the compiled col2im writes the chunk's rows in place
                view[...] = part
        return dx.reshape(ws.saved["x_shape"])

    def convolves(self) -> bool:
        return True

    def _krsc(self, p, ws):
        """The kernel as cuDNN's KRSC (F, kh, kw, C) copy, kept for backward, where the convolution runs on cuDNN
        (``towers.ops.conv.on_cudnn``); else the HWIO kernel (``towers.ops.conv`` then declines)."""
        w = p["weights"]
        if not device_conv.on_cudnn(w):
            return w
        k = ws.saved["w_krsc"] = ws.array("w_krsc", (self.filters, self.k, self.k, self.in_hwc[2]), w.dtype)
        k[...] = w.transpose(3, 0, 1, 2)
        return k

    @property
    def _geometry(self) -> tuple:
        """(pad, post_pad, stride): what ``towers.ops.conv`` takes after the arrays."""
        return self.pad, self.post_pad, self.stride

    def compiled_rounding(self, input_grad: bool = True) -> bool:
        """With more filters than input channels the compiled CPU forms take dx by col2im, NumPy by dy's im2col:
        other sums, where the input gradient is taken (``Layer``)."""
        return input_grad and getattr(self, "_dw_from_x", False)

    def _weight_grad(self, x, dy2, gw, ws) -> list:
        """``gw = cols(x)^T @ dy``, chunk by chunk from x's im2col (the forward's, when it is one chunk); the chunks."""
        chunks = self._chunks(x)
        rows = dy2.shape[0] // x.shape[0]
        if len(chunks) == 1:  # the forward's im2col is still in the workspace
            gemm(ws.array("cols", self._cols_shape(x.shape[0]), x.dtype).reshape(-1, gw.shape[0]), dy2, gw,
                         trans_a=True)
            return chunks
        part = ws.array("dw_part", gw.shape, gw.dtype)
        for i, ((b0, b1), cols) in enumerate(self._im2col_chunks(x, ws)):
            gemm(cols, dy2[b0 * rows: b1 * rows], gw if i == 0 else part, trans_a=True)
            if i:
                gw += part
        return chunks

    def _cols_shape(self, n):
        return (n,) + self.out_hw + (self.k, self.k, self.in_hwc[2])

    def _dx(self, weights, dy, ws, out=None):
        """The input gradient of the images of ``dy`` (n, Ho, Wo, F) by ``dcols = dy @ W.T`` and col2im (into
        ``out`` where ``col2im`` can)."""
        k, f = self.k, self.filters
        n = dy.shape[0]
        h, w, c = self.in_hwc
        ho, wo = self.out_hw
        dcols = ws.array("dcols", (n, ho, wo, k, k, c), dy.dtype)
        gemm(dy.reshape(-1, f), weights.reshape(-1, f), dcols.reshape(n * ho * wo, k * k * c), trans_b=True)
        # col2im: each tap (i, j) adds its slice back where it was read from.
        return col2im(dcols, (h, w), self.pad, ws, self.stride, out)

    def _backward_as_conv(self, weights, gw, x, dy, ws):
        """Stride 1: both gradients from ONE im2col of ``dy``, padded by k-1-top (``dcols``, row = input pixel);
        the input gradient alone when ``gw`` is None (``_dw_from_x``: dW came from x's im2col).

        ``dcols[q, a'] = dy[q + top - a]`` for the tap a' = k-1-a, so
        ``dx = dcols @ W`` turned 180 degrees with its channels swapped (the
        forward convolution of dy), and ``dW[a] = sum_q x[q]^T dcols[q, a']``,
        i.e. ``x^T @ dcols`` (C, k*k*F), taps turned back.  Chunked as the
        forward; ``dx`` is written in place, chunk by chunk.
        """
        k, f = self.k, self.filters
        n = dy.shape[0]
        h, w, c = self.in_hwc
        w_rot = ws.array("w_rot", (k * k * f, c), weights.dtype)
        w_rot.reshape(k, k, f, c)[...] = weights[::-1, ::-1].transpose(0, 1, 3, 2)
        dw_rot = ws.array("dw_rot", (c, k * k * f), weights.dtype) if gw is not None else None
        x2 = x.reshape(-1, c)
        dx = ws.array("dx", (n, h, w, c), dy.dtype)
        dx2 = dx.reshape(-1, c)
        for i, ((b0, b1), dcols) in enumerate(self._im2col_chunks(dy, ws, of_dy=True)):
            r0, r1 = b0 * h * w, b1 * h * w
            gemm(dcols, w_rot, dx2[r0:r1])
            if dw_rot is None:
                continue
            part = dw_rot if i == 0 else ws.array("dw_part", dw_rot.shape, gw.dtype)
            gemm(x2[r0:r1], dcols, part, trans_a=True)
            if i:
                dw_rot += part
        if dw_rot is not None:
            gw.reshape(k, k, c, f)[...] = dw_rot.reshape(c, k, k, f)[:, ::-1, ::-1].transpose(1, 2, 0, 3)
        return dx.reshape(ws.saved["x_shape"])
