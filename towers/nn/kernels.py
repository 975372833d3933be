"""Fused kernels of the layers: one CUDA launch where NumPy takes several passes.

Each function here takes arrays of one module (NumPy or CuPy) and writes into
the output it is given.  On NumPy it runs the array operations the layers have
always run (the CPU's arithmetic is unchanged); on CuPy it launches ONE raw CUDA
kernel that does the same arithmetic in the same order, so a GPU step makes
far fewer launches (a small model's step is bound by the host's launch cost):

===================  ==========================================  ==============
function             NumPy passes                                CUDA launches
===================  ==========================================  ==============
``bias_add``         ``y += b`` (broadcast)                      1
``relu``             ``maximum(x, 0)``                           1
``relu_backward``    ``greater`` + ``multiply``                  1
``add_scaled``       ``multiply`` + ``add`` (the L2 gradient)    1
``softmax_xent``     max, subtract, exp, sum, divide, fancy      1 (+2 for the
                     indexing (take/scatter), multiply           loss, if asked)
``im2col``           pad copy + one 6-D strided copy             1 (stride 1)
``col2im``           fill + k*k strided adds + crop              1 (stride 1)
``maxpool``          copy + k*k-1 maxima (+ pad)                 1
``maxpool_backward`` 3-4 passes per window tap (bool masks)      1
``col_sum``          one GEMV with a ones vector                 1 (cuBLAS)
===================  ==========================================  ==============

Strided convolutions (stride > 1) take the NumPy-style array operations on a
GPU too (``im2col``, ``col2im``): CuPy runs them, there is no dedicated kernel.

Exactness: where the NumPy passes round once per operation, the kernel rounds
at the same places (``__fmul_rn`` keeps NVRTC from contracting ``a + b * c``
into an FMA; sums add the same terms in the same order), so ``relu``,
``relu_backward``, ``add_scaled``, ``bias_add``, ``im2col``, ``col2im``,
``maxpool`` and ``maxpool_backward`` give the CPU's values on
the same inputs (NaN where NumPy has NaN; the sign of a zero may differ: seen on
an H200, NVRTC turned ReLU's select into a max instruction, which gives +0.0
for -0.0); ``softmax_xent`` differs by the last bits of ``expf``/``logf``
and of the row sum's order.  ``tests/test_gpu.py`` checks each kernel against
its NumPy version.  No kernel uses atomics: results are deterministic, so
replicas stay bit-identical.

Limits: float32 activations, C-contiguous arrays, at most
``towers.devices.kernels.MAX_ELEMENTS`` elements per array (index arithmetic is
32-bit for speed; larger arrays, and arrays of another dtype, take the
NumPy-style array operations on the device instead, which CuPy runs as well).  The CUDA
text of these kernels is registered, when this module is imported, with
``towers.devices.kernels``: the one CUDA module of towers' kernels (with the
reducers' and the data's), compiled once by NVRTC and kept in CuPy's on-disk
kernel cache, and its launch machinery; ``warm_up`` there loads them before the
first step.  The cuBLAS GEMM under ``gemm``, ``bias_grad`` and ``col_sum`` is
``towers.devices.matmul.sgemm``.  Launches go on the current stream; nothing
here synchronizes.
"""
from __future__ import annotations

import numpy

from towers.devices.kernels import check_contiguous, launch_named, on_host, register, takes
from towers.devices.matmul import sgemm
from towers.devices.placement import array_module

_i = numpy.int32  # a kernel's int argument

# The layers' kernels, in the one CUDA module of ``towers.devices.kernels`` (which defines LOOP and np_max).
_SOURCE = r"""__global__ void towers_bias_add(float* y, const float* b, int n, int cols) {
    LOOP(i, n) y[i] = y[i] + b[i % cols];
}

__global__ void towers_relu(const float* x, float* y, int n) {
    LOOP(i, n) y[i] = np_max(x[i], 0.f);
}

__global__ void towers_relu_backward(const float* y, float* dy, int n) {
    LOOP(i, n) dy[i] = dy[i] * (y[i] > 0.f ? 1.f : 0.f);
}

__global__ void towers_add_scaled(float* g, const float* w, float s, int n) {
    LOOP(i, n) g[i] = g[i] + __fmul_rn(w[i], s);
}

// One thread per row: log-sum-exp shifted cross-entropy and (softmax - onehot) / n.
__global__ void towers_softmax_xent(const float* logits, const int* labels, float* d, float* row_loss,
                                    int n, int c, float inv_n) {
    LOOP(r, n) {
        const float* l = logits + (long long)r * c;
        float* dr = d + (long long)r * c;
        float m = l[0];
        for (int j = 1; j < c; ++j) m = np_max(m, l[j]);
        float s = 0.f;
        for (int j = 0; j < c; ++j) { float e = expf(l[j] - m); dr[j] = e; s += e; }
        int y = labels[r];
        row_loss[r] = logf(s) - (l[y] - m);
        for (int j = 0; j < c; ++j) {
            float p = dr[j] / s;
            if (j == y) p = p - 1.f;
            dr[j] = p * inv_n;
        }
    }
}

// cols (n, ho, wo, k, k, c) from x (n, h, w, c); taps outside the image are 0.
__global__ void towers_im2col(const float* x, float* cols, int total, int h, int w, int c,
                              int ho, int wo, int k, int pt, int pl) {
    LOOP(i, total) {
        int ch = i % c, t = i / c;
        int kj = t % k; t /= k;
        int ki = t % k; t /= k;
        int ow = t % wo; t /= wo;
        int oh = t % ho, b = t / ho;
        int ih = oh + ki - pt, iw = ow + kj - pl;
        cols[i] = (ih >= 0 && ih < h && iw >= 0 && iw < w) ? x[((b * h + ih) * w + iw) * c + ch] : 0.f;
    }
}

// dx (n, h, w, c) = sum of the taps of dcols (n, ho, wo, k, k, c) that read it, in (ki, kj) order.
__global__ void towers_col2im(const float* dcols, float* dx, int total, int h, int w, int c,
                              int ho, int wo, int k, int pt, int pl) {
    LOOP(i, total) {
        int ch = i % c, t = i / c;
        int iw = t % w; t /= w;
        int ih = t % h, b = t / h;
        float acc = 0.f;
        for (int ki = 0; ki < k; ++ki) {
            int oh = ih + pt - ki;
            if (oh < 0 || oh >= ho) continue;
            for (int kj = 0; kj < k; ++kj) {
                int ow = iw + pl - kj;
                if (ow < 0 || ow >= wo) continue;
                acc += dcols[((((b * ho + oh) * wo + ow) * k + ki) * k + kj) * c + ch];
            }
        }
        dx[i] = acc;
    }
}

// y (n, ho, wo, c): max of each k x k window of x (n, h, w, c), row-major, past-the-edge taps skipped.
__global__ void towers_maxpool(const float* x, float* y, int total, int h, int w, int c, int ho, int wo, int k) {
    LOOP(i, total) {
        int ch = i % c, t = i / c;
        int ow = t % wo; t /= wo;
        int oh = t % ho, b = t / ho;
        const float* base = x + ((b * h + oh * k) * w + ow * k) * c + ch;
        float m = base[0];
        for (int a = 0; a < k && oh * k + a < h; ++a)
            for (int e = 0; e < k && ow * k + e < w; ++e)
                if (a || e) m = np_max(m, base[(a * w + e) * c]);
        y[i] = m;
    }
}

// dx (n, h, w, c): dy of the window at its FIRST element (row-major) equal to the window's max, else 0.
__global__ void towers_maxpool_backward(const float* x, const float* y, const float* dy, float* dx, int total,
                                        int h, int w, int c, int ho, int wo, int k) {
    LOOP(i, total) {
        int ch = i % c, t = i / c;
        int iw = t % w; t /= w;
        int ih = t % h, b = t / h;
        int oh = ih / k, ow = iw / k, a0 = ih - oh * k, e0 = iw - ow * k;
        int o = ((b * ho + oh) * wo + ow) * c + ch;
        float m = y[o], g = 0.f;
        if (x[i] == m) {
            const float* base = x + ((b * h + oh * k) * w + ow * k) * c + ch;
            bool earlier = false;
            for (int a = 0; a <= a0 && !earlier; ++a)
                for (int e = 0; e < k && ow * k + e < w; ++e) {
                    if (a == a0 && e == e0) break;
                    if (base[(a * w + e) * c] == m) { earlier = true; break; }
                }
            g = earlier ? 0.f : 1.f;
        }
        dx[i] = dy[o] * g;
    }
}

"""

register(_SOURCE, ("bias_add", "relu", "relu_backward", "add_scaled", "softmax_xent", "im2col", "col2im", "maxpool",
                   "maxpool_backward"))


# -- elementwise ------------------------------------------------------------------------


def bias_add(y, b) -> None:
    """In place: ``y (rows, cols) += b (cols,)``."""
    if on_host(y) or not takes(y, b):
        y += b
        return
    launch_named("bias_add", y.size, y, b, _i(y.size), _i(b.size))


def relu(x, y) -> None:
    """``y = maximum(x, 0)`` (NaN passes through, as NumPy's maximum).

    NumPy: against an array of zeros, not the scalar 0: the same values, but
    its array-array loop is SIMD and 2-3x faster than the array-scalar one
    (0.30 against 0.72 ms on a 4 MB activation).
    """
    if on_host(x):
        numpy.maximum(x, host_zeros(x.shape, x.dtype), out=y)
        return
    if not takes(x, y):
        array_module(x).maximum(x, 0, out=y)
        return
    check_contiguous(x)
    launch_named("relu", x.size, x, y, _i(x.size))


_HOST_ZEROS: dict = {}  # dtype -> a read-only vector of zeros, grown as needed (shared by all towers' threads)


def host_zeros(shape: tuple, dtype):
    """A read-only NumPy array of zeros shaped ``shape``: a view of one vector per dtype, made once."""
    size = int(numpy.prod(shape))
    z = _HOST_ZEROS.get(numpy.dtype(dtype))
    if z is None or z.size < size:
        z = numpy.zeros(max(size, 1 << 16), dtype)
        z.flags.writeable = False
        _HOST_ZEROS[numpy.dtype(dtype)] = z  # a thread that grew it concurrently just made one more
    return z[:size].reshape(shape)


def add_relu(h, s, y, ws) -> None:
    """``y = maximum(h + s, 0)`` (a residual block's output): one compiled pass with the step's fused CPU
    kernels (``cpu_kernels``), else an add and ``relu``; the same bits either way."""
    fused = fused_for(ws, h, s)
    if fused is not None and y.flags.c_contiguous:
        fused.add_relu(h.reshape(-1), s.reshape(-1), y.reshape(-1))
        return
    ws.xp.add(h, s, out=y)
    relu(y, y)


def relu_backward(y, dy, ws=None) -> None:
    """In place: ``dy *= (y > 0)`` (as 1.0 / 0.0, so signs and NaN follow the multiply).

    NumPy: through a bool mask shaped like ``y``, ``ws``'s scratch (a quarter
    of a float mask's memory traffic: the two passes take 0.63 instead of 0.90
    ms on a 4 MB activation, with the same products).  With ``ws``'s fused CPU
    kernels (``cpu_kernels``): one compiled pass, the same products.
    """
    fused = fused_for(ws, y, dy)
    if fused is not None:
        fused.relu_backward(y.reshape(-1), dy.reshape(-1))
        return
    if on_host(y) or not takes(y, dy):
        xp = array_module(y)
        mask = ws.array("mask", y.shape, bool) if ws is not None else xp.empty(y.shape, dtype=bool)
        xp.greater(y, 0, out=mask)
        xp.multiply(dy, mask, out=dy)
        return
    check_contiguous(dy)
    launch_named("relu_backward", y.size, y, dy, _i(y.size))


def add_scaled(g, w, s, tmp=None, fused=None) -> None:
    """In place: ``g += s * w`` with ``s * w`` rounded first (the L2 gradient).

    ``tmp`` is the NumPy path's scratch, shaped like ``w``; ``fused``, the
    step's fused CPU kernels (``cpu_kernels``): one compiled pass instead of
    two, the same products and sums.
    """
    s = g.dtype.type(s)
    if (fused is not None and on_host(g) and g.shape == w.shape and g.dtype == w.dtype and g.flags.c_contiguous
            and w.flags.c_contiguous):
        fused.add_scaled(g.reshape(-1), w.reshape(-1), s)  # the compiled loop walks flat arrays
        return
    if on_host(g) or not takes(g, w):
        xp = array_module(g)
        tmp = tmp if tmp is not None else xp.empty_like(w)
        xp.multiply(w, s, out=tmp)
        g += tmp
        return
    launch_named("add_scaled", g.size, g, w, s, _i(g.size))


def bias_grad(dy, out, ws) -> None:
    """``out (cols,) = dy (rows, cols).sum(axis=0)``: the bias gradient.

    NumPy: ``sum``.  CuPy: ``ones(rows) @ dy`` through cuBLAS, because CuPy's
    reduction over the long axis of a tall, narrow array runs one block per
    column (1.2 ms for LeNet-5's first convolution at batch 100, against a few
    microseconds for the product).
    """
    if on_host(dy):
        numpy.sum(dy, axis=0, out=out)
        return
    rows, cols = dy.shape
    ones = ws.array("ones", (rows,), dy.dtype)
    if ws.saved.get("ones") is not ones:
        ones.fill(1)
        ws.saved["ones"] = ones
    # (1, rows) @ (rows, cols): the 1-D vectors are the 1-row matrices, no reshape.
    if not sgemm(ones, dy, out, False, False, 1, cols, rows):
        ws.xp.matmul(ones.reshape(1, -1), dy, out=out.reshape(1, -1))


def col_sum(x2, out, ws) -> None:
    """``out (cols,) = x2 (rows, cols).sum(axis=0)`` as ``ones(rows) @ x2``: one GEMV on either device.

    On the CPU the BLAS product is several times faster than NumPy's
    reduction over the long axis of a tall, narrow array; on a GPU see
    ``bias_grad``.  (``bias_grad`` keeps NumPy's sum on the CPU: the existing
    models' bits depend on it.)
    """
    rows = x2.shape[0]
    ones = ws.array("ones", (rows,), x2.dtype)
    if ws.saved.get("ones") is not ones:
        ones.fill(1)
        ws.saved["ones"] = ones
    if on_host(x2):
        numpy.matmul(ones, x2, out=out)
    elif not sgemm(ones, x2, out, False, False, 1, x2.shape[1], rows):
        ws.xp.matmul(ones.reshape(1, -1), x2, out=out.reshape(1, -1))


# -- matrix products -----------------------------------------------------------------------


def gemm(a, b, out, trans_a: bool = False, trans_b: bool = False) -> None:
    """``out = op(a) @ op(b)``, ``op`` the transpose where asked; 2-D arrays, ``out`` (m, n).

    NumPy: ``numpy.matmul`` on the (transposed) views, as the layers always did.
    CuPy, float32 C-contiguous operands: ONE ``cublasGemmEx`` call on the
    current stream, with the arguments ``cupy.matmul`` ends in (its compute
    type, so ``--tf32`` applies, and its algorithm), without its Python-level
    dispatch (about 20 us a call on the host, several times the GEMM itself at
    these sizes).  Other dtypes, layouts or empty operands take ``cupy.matmul``.
    """
    if on_host(a):
        numpy.matmul(a.T if trans_a else a, b.T if trans_b else b, out=out)
        return
    m, k = a.shape[::-1] if trans_a else a.shape
    kb, n = b.shape[::-1] if trans_b else b.shape
    if k != kb or out.shape != (m, n):
        raise ValueError(f"gemm: op(a) {(m, k)} @ op(b) {(kb, n)} into {out.shape}")
    if not sgemm(a, b, out, trans_a, trans_b, m, n, k):
        array_module(a).matmul(a.T if trans_a else a, b.T if trans_b else b, out=out)


# -- the loss --------------------------------------------------------------------------


def softmax_xent(logits, labels, ws, want_loss: bool):
    """Mean sparse softmax cross-entropy from logits and its gradient ``(softmax - onehot) / n``.

    Log-sum-exp shifted, never the log of a softmax.  Returns (loss or None,
    dlogits); dlogits lives in the workspace ``ws``.  The loss is a 0-d device
    array (no host sync).
    """
    xp = ws.xp
    n, c = logits.shape
    prob = ws.array("prob", (n, c), logits.dtype)
    if on_host(logits) or not takes(logits):
        return _softmax_xent_arrays(xp, logits, labels, ws, prob, want_loss)
    check_contiguous(logits)
    if labels.dtype != numpy.int32 or not labels.flags.c_contiguous:
        lab = ws.array("labels", (n,), numpy.int32)
        lab[...] = labels
        labels = lab
    row_loss = ws.array("row_loss", (n,), logits.dtype)
    launch_named("softmax_xent", n, logits, labels, prob, row_loss, _i(n), _i(c), logits.dtype.type(1.0 / n))
    return (row_loss.sum() / logits.dtype.type(n) if want_loss else None), prob


def _softmax_xent_arrays(xp, logits, labels, ws, prob, want_loss):
    """The array-operation version (NumPy on the CPU; CuPy for arrays too big for the kernel)."""
    n, c = logits.shape
    m = ws.array("max", (n, 1), logits.dtype)
    xp.max(logits, axis=1, keepdims=True, out=m)
    z = ws.array("z", (n, c), logits.dtype)
    xp.subtract(logits, m, out=z)
    xp.exp(z, out=prob)
    s = ws.array("sum", (n, 1), logits.dtype)
    xp.sum(prob, axis=1, keepdims=True, out=s)
    rows = ws.array("rows", (n,), numpy.int64)
    if ws.saved.get("rows_n") != n:
        rows[...] = xp.arange(n)
        ws.saved["rows_n"] = n
    loss = None
    if want_loss:
        loss = (xp.sum(xp.log(s)) - xp.sum(z[rows, labels])) / logits.dtype.type(n)
    xp.divide(prob, s, out=prob)
    prob[rows, labels] -= 1
    prob *= logits.dtype.type(1.0 / n)
    return loss, prob


# -- convolution: im2col / col2im --------------------------------------------------------


def im2col(x, cols, pad: tuple, ws, stride: int = 1) -> None:
    """``cols (n, ho, wo, k, k, c)`` from ``x (n, h, w, c)`` with (top, left) zero padding ``pad``.

    Output pixel (oh, ow) reads the k x k window at (oh * stride - top, ow *
    stride - left); taps outside the image read 0.  NumPy (and CuPy for
    ``stride`` > 1): the input is copied into a zero-bordered workspace buffer
    (zeroed once; only its interior is rewritten), then ONE strided copy of its
    window view (each (j, c) run of a tap row is contiguous in the buffer; on
    the CPU each run moves as one element of a void dtype, a memcpy).
    """
    n, ho, wo, k, _, c = cols.shape
    h, w = x.shape[1:3]
    if on_host(x) or stride != 1 or not takes(x, cols):
        src = padded(ws, "xpad", x, pad, ((ho - 1) * stride + k, (wo - 1) * stride + k), 0)
        if on_host(src):
            dst, win = _window_rows(src, cols, stride)
            dst[...] = win
            return
        s = src.strides
        cols[...] = ws.xp.lib.stride_tricks.as_strided(
            src, shape=(n, ho, wo, k, k, c), strides=(s[0], s[1] * stride, s[2] * stride, s[1], s[2], s[3]))
        return
    check_contiguous(x)  # the layer input: a user's layer may hand in a strided view, which the kernel would misread
    launch_named("im2col", cols.size, x, cols, _i(cols.size), _i(h), _i(w), _i(c), _i(ho), _i(wo), _i(k),
            _i(pad[0]), _i(pad[1]))


def _window_rows(src, cols, stride: int):
    """(dst, win): NumPy ``cols (n, ho, wo, k, k, c)`` and the windows of the padded ``src``, as arrays of rows.

    A window row (k taps x c channels) is one contiguous run in both arrays, so
    each is ONE element of a k*c-float void dtype: ``dst[...] = win`` is
    im2col's copy, a memcpy a row (15-25% faster than k*c floats at a time).
    """
    n, ho, wo, k, _, c = cols.shape
    s = src.strides
    row = numpy.dtype((numpy.void, k * c * src.itemsize))
    return (cols.reshape(n, ho, wo, k, k * c).view(row)[..., 0],
            numpy.ndarray((n, ho, wo, k), row, src, 0, (s[0], s[1] * stride, s[2] * stride, s[1])))


def im2col_plan(x, cols_of, pad: tuple, ws, stride: int, chunks) -> list:
    """The CPU's im2col of ``x (n, h, w, c)`` chunk by chunk, as views made once; ``run_im2col`` runs a chunk's.

    Per chunk [b0, b1): (interior, images, dst, win, cols) -- ``padded``'s copy
    and ``im2col``'s as views, and the chunk's cols (rows, k*k*c), from
    ``cols_of(m)`` (an m-image chunk's (m, ho, wo, k, k, c) buffer).  A chunk
    then costs two NumPy calls and no Python bookkeeping (with a chunk an image,
    that bookkeeping was a fifth of a 16-channel layer's forward).  The views
    stay valid while ``x`` (C-contiguous) and the workspace buffers are the same
    arrays, as a layer's input and buffers are from step to step.
    """
    plan = []
    for b0, b1 in chunks:
        cols = cols_of(b1 - b0)
        _, ho, wo, k, _, c = cols.shape
        src, interior, images = _pad_views(ws, "xpad", x[b0:b1], pad, ((ho - 1) * stride + k, (wo - 1) * stride + k), 0)
        plan.append((interior, images) + _window_rows(src, cols, stride) + (cols.reshape(-1, k * k * c),))
    return plan


def run_im2col(step) -> None:
    """One chunk of an ``im2col_plan``: its images into the padded buffer, then its window rows into cols."""
    interior, images, dst, win, _ = step
    if interior is not None:
        interior[...] = images
    dst[...] = win


def col2im(dcols, in_hw: tuple, pad: tuple, ws, stride: int = 1, out=None):
    """Return ``dx (n, h, w, c)``: each tap of ``dcols (n, ho, wo, k, k, c)`` added back where it was read.

    NumPy (and CuPy for ``stride`` > 1): k*k strided adds into a zeroed padded
    buffer, in (i, j) order, then the interior is cropped into ``dx``.  CUDA,
    and the step's fused CPU kernels (``cpu_kernels``): one pass in which each
    ``dx`` element sums its taps in the same order (a gather: no atomics, the
    same bits).  ``dx`` lives in ``ws`` (NumPy, VALID padding: the padded
    buffer itself), or in ``out`` (a C-contiguous (n, h, w, c) host array)
    with the fused kernels.
    """
    n, ho, wo, k, _, c = dcols.shape
    h, w = in_hw
    fused = fused_for(ws, dcols)
    if fused is not None:
        fits = out is not None and out.flags.c_contiguous and out.shape == (n, h, w, c) and out.dtype == dcols.dtype
        dx = out if fits else ws.array("dx", (n, h, w, c), dcols.dtype)
        fused.col2im(dcols, dx, pad[0], pad[1], stride)
        return dx
    if on_host(dcols) or stride != 1 or not takes(dcols):
        hp, wp = (ho - 1) * stride + k, (wo - 1) * stride + k
        dpad = ws.array("dpad", (n, hp, wp, c), dcols.dtype)
        dpad.fill(0)
        for i in range(k):
            for j in range(k):
                dpad[:, i: i + stride * (ho - 1) + 1: stride, j: j + stride * (wo - 1) + 1: stride, :] += \
                    dcols[:, :, :, i, j, :]
        return crop(ws, dpad, pad, (h, w))
    dx = ws.array("dx", (n, h, w, c), dcols.dtype)
    launch_named("col2im", dx.size, dcols, dx, _i(dx.size), _i(h), _i(w), _i(c), _i(ho), _i(wo), _i(k),
            _i(pad[0]), _i(pad[1]))
    return dx


def padded(ws, key: str, x, pad: tuple, hw: tuple, fill: float):
    """``x (n, h, w, c)`` inside a workspace buffer (n, *hw, c) bordered with ``fill``, at offset ``pad``.

    Rows and columns of ``x`` beyond the buffer (windows that never reach them)
    are left out.  The border is written once, when the buffer is made; later
    calls rewrite the interior only.  Without padding, and with every window
    inside the input, ``x`` itself is returned (read in place).
    """
    src, interior, images = _pad_views(ws, key, x, pad, hw, fill)
    if interior is not None:
        interior[...] = images
    return src


def _pad_views(ws, key: str, x, pad: tuple, hw: tuple, fill: float):
    """(buffer, interior, images): ``padded``'s buffer and its copy as views (``interior[...] = images``).

    (x, None, None) where x is read in place (C-contiguous; a copy otherwise).
    """
    n, h, w, c = x.shape
    (t, l), (hp, wp) = pad, hw
    if (t, l) == (0, 0) and hp <= h and wp <= w:
        return (x if x.flags.c_contiguous else ws.xp.ascontiguousarray(x)), None, None
    src = zeroed(ws, key, (n, hp, wp, c), x.dtype, fill)
    hh, ww = min(h, hp - t), min(w, wp - l)
    return src, src[:, t: t + hh, l: l + ww, :], x[:, :hh, :ww, :]


def crop(ws, dpad, pad: tuple, hw: tuple):
    """Inverse of ``_padded`` for gradients: the (h, w) interior of ``dpad`` at ``pad``, 0 where it had no rows."""
    n, hp, wp, c = dpad.shape
    (t, l), (h, w) = pad, hw
    if (t, l) == (0, 0) and (hp, wp) == (h, w):
        return dpad
    dx = ws.array("dx", (n, h, w, c), dpad.dtype)
    hh, ww = min(h, hp - t), min(w, wp - l)
    if (hh, ww) != (h, w):
        dx.fill(0)
    dx[:, :hh, :ww, :] = dpad[:, t: t + hh, l: l + ww, :]
    return dx


def zeroed(ws, key: str, shape: tuple, dtype, fill: float = 0):
    """A workspace buffer filled with ``fill`` (0) when (and only when) it was first made.

    Callers write only its interior, so the border survives across steps.
    """
    a = ws.array(key, shape, dtype)
    tag = ("zeroed", key, tuple(shape), numpy.dtype(dtype).str)
    if ws.saved.get(tag) is not a:
        a.fill(fill)
        ws.saved[tag] = a
    return a


# -- max-pooling ---------------------------------------------------------------------------


def _windows(x, k: int, out_hw: tuple, ws):
    """(n, ho, k, wo, k, c) view of ``x (n, h, w, c)``, padded with -inf at the end when needed."""
    n, h, w, c = x.shape
    ho, wo = out_hw
    if (ho * k, wo * k) != (h, w):
        # SAME: TF pads the bottom/right only (total pad < k).  -inf never wins
        # a window, since every window holds at least one real element.
        xpad = ws.array("xpad", (n, ho * k, wo * k, c), x.dtype)
        xpad.fill(-numpy.inf)
        xpad[:, :h, :w, :] = x
        x = xpad
    return x.reshape(n, ho, k, wo, k, c)


def fused_for(ws, *arrays):
    """The step's fused CPU kernels (``ws.ctx.fused``, ``towers.nn.fused_cpu``) for C-contiguous host ``arrays``,
    or None (no workspace, no kernels, or an array they do not take)."""
    fused = getattr(ws.ctx, "fused", None) if ws is not None else None
    if fused is None or not all(on_host(a) and a.flags.c_contiguous for a in arrays):
        return None
    return fused


def maxpool(x, y, k: int, ws) -> None:
    """``y (n, ho, wo, c)``: the max of each k x k window of ``x (n, h, w, c)`` (stride k, SAME).

    NumPy: k*k elementwise maxima over strided window views (several times
    faster than a reduction over the two non-adjacent window axes); with the
    step's fused CPU kernels (``cpu_kernels``), one compiled pass.
    """
    n, ho, wo, c = y.shape
    h, w = x.shape[1:3]
    fused = fused_for(ws, x, y)
    if fused is not None:  # one compiled pass (towers.nn.fused_cpu): the same maxima
        fused.maxpool(x, k, y)
        return
    if on_host(x) or not takes(x, y):
        xp = ws.xp
        win = _windows(x, k, (ho, wo), ws)
        y[...] = win[:, :, 0, :, 0, :]
        for a in range(k):
            for b in range(k):
                if a or b:
                    xp.maximum(y, win[:, :, a, :, b, :], out=y)
        return
    check_contiguous(x)
    launch_named("maxpool", y.size, x, y, _i(y.size), _i(h), _i(w), _i(c), _i(ho), _i(wo), _i(k))


def maxpool_backward(x, y, dy, k: int, ws):
    """Return ``dx`` (in ``ws``, shaped like ``x``): ``dy`` of each window at its FIRST maximal element (row-major), 0 elsewhere.

    A window of tied values (frequent after a ReLU: all zeros) passes its
    gradient to exactly one input, as TensorFlow's CPU kernel does.
    """
    n, ho, wo, c = y.shape
    h, w = x.shape[1:3]
    fused = fused_for(ws, x, dy)
    if fused is not None:  # one compiled pass: the same first maxima, dy * 1 and 0 are exact
        dx = ws.array("dx", x.shape, dy.dtype)
        fused.maxpool_backward(x, y, dy, k, dx)
        return dx
    if on_host(x) or not takes(x, y, dy):
        xp = ws.xp
        win = _windows(x, k, (ho, wo), ws)
        dwin = ws.array("dwin", win.shape, dy.dtype)
        # Bool masks (a quarter of a float mask's memory traffic; the product
        # dy * mask is dy * 1.0 or dy * 0.0, as with a float mask): ``eq`` the
        # tap that takes the window's gradient, ``left`` the windows whose
        # maximum is still unclaimed.  The first tap needs no ``left`` (every
        # window is unclaimed), the last one does not update it.
        left, eq = ws.array("left", y.shape, bool), ws.array("eq", y.shape, bool)
        last = k * k - 1
        for t in range(k * k):
            a, b = divmod(t, k)
            xp.equal(win[:, :, a, :, b, :], y, out=eq)
            if t:
                eq &= left  # only the first maximum of each window
            if t == 0:
                xp.logical_not(eq, out=left)
            elif t < last:
                left ^= eq  # eq is a subset of left: clears the windows just claimed
            xp.multiply(dy, eq, out=dwin[:, :, a, :, b, :])
        dx = dwin.reshape(n, ho * k, wo * k, c)
        if (ho * k, wo * k) != (h, w):
            out = ws.array("dx", (n, h, w, c), dy.dtype)
            out[...] = dx[:, :h, :w, :]
            dx = out
        return dx
    dx = ws.array("dx", x.shape, dy.dtype)
    check_contiguous(dy)
    launch_named("maxpool_backward", dx.size, x, y, dy, dx, _i(dx.size), _i(h), _i(w), _i(c), _i(ho), _i(wo), _i(k))
    return dx
