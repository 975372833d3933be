"""A convolution's windows: im2col (gather the k x k window of every output pixel) and col2im (its adjoint).

``im2col(x, cols, pad, ws, stride)``: ``cols (n, ho, wo, k, k, c)`` from ``x
(n, h, w, c)``, taps outside the image read 0.  ``col2im(dcols, in_hw, pad,
ws, stride)``: each tap of ``dcols`` added back to the pixel it read.  Their
forms differ (a copy of strided views against an index gather), so they sit
side by side here, each doing the same additions in the same order:

==========  =======================================  ===========================  ==============
op          NumPy                                    compiled CPU (numba)         CUDA
==========  =======================================  ===========================  ==============
im2col      pad copy + one strided copy of window    (NumPy's: a memcpy a row)    1 launch
            rows (``im2col_plan``: views made once)                               (stride 1)
col2im      fill + k*k strided adds + crop           ``col2im_loop``: one gather  1 launch
                                                                                  (stride 1)
==========  =======================================  ===========================  ==============

col2im's per-pixel arithmetic is the same sum in every form: the taps that
read the pixel, in tap order (i, j) from 0, starting from 0 (the NumPy adds
into a zeroed buffer round it so), hence the same bits.  Strided
convolutions (stride > 1) take the NumPy-style array operations on a GPU too
(CuPy runs them); the compiled loop takes any stride.  ``padded``, ``crop``
and ``zeroed`` are the padded workspace buffers the pooling layers share.

Limits: the kernels take float32, C-contiguous arrays of at most
``towers.devices.kernels.MAX_ELEMENTS`` elements (others take the array
operations); launches go on the current stream, nothing synchronizes.
"""
from __future__ import annotations

import numpy

from towers.arrays import on_host
from towers.devices.kernels import check_contiguous, launch_named, register, takes
from towers.ops.forms import current as current_forms
from towers.ops.numba_jit import kernel as numba_kernel

_i = numpy.int32  # a kernel's int argument

register(r"""// cols (n, ho, wo, k, k, c) from x (n, h, w, c); taps outside the image are 0.
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

""", ("im2col", "col2im"))


@numba_kernel(warm=lambda: (numpy.zeros((1, 1, 1, 2, 2, 2), numpy.float32), numpy.zeros((1, 2, 2, 2), numpy.float32),
                                0, 0, 1))
def col2im_loop(dcols, dx, top, left, stride):  # pragma: no cover - compiled
    """``dx (n, h, w, c)`` from ``dcols (n, ho, wo, k, k, c)``: each element the sum of the taps that read it,
    in tap order (i, j) from 0, as NumPy's strided adds into a zeroed buffer round it (a gather, one pass)."""
    n, ho, wo, k, _, c = dcols.shape
    h, w = dx.shape[1], dx.shape[2]
    for b in range(n):
        for r in range(h):
            for q in range(w):
                for ch in range(c):
                    dx[b, r, q, ch] = 0
                for i in range(k):
                    y = r + top - i
                    if y < 0 or y % stride or y // stride >= ho:
                        continue
                    for j in range(k):
                        x = q + left - j
                        if x < 0 or x % stride or x // stride >= wo:
                            continue
                        for ch in range(c):
                            dx[b, r, q, ch] += dcols[b, y // stride, x // stride, i, j, ch]



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
    buffer, in (i, j) order, then the interior is cropped into ``dx``.  CUDA
    (stride 1), and the compiled loop where the current forms take it
    (``col2im_loop``): one pass in which each ``dx`` element sums its taps in
    the same order (a gather: no atomics, the same bits).  ``dx`` lives in
    ``ws`` (NumPy, VALID padding: the padded buffer itself), or in ``out`` (a
    C-contiguous (n, h, w, c) host array) with the compiled loop.
    """
    n, ho, wo, k, _, c = dcols.shape
    h, w = in_hw
    if on_host(dcols) and current_forms().compiled and dcols.flags.c_contiguous:
        fits = out is not None and out.flags.c_contiguous and out.shape == (n, h, w, c) and out.dtype == dcols.dtype
        dx = out if fits else ws.array("dx", (n, h, w, c), dcols.dtype)
        col2im_loop(dcols, dx, pad[0], pad[1], stride)
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
    """Inverse of ``padded`` for gradients: the (h, w) interior of ``dpad`` at ``pad``, 0 where it had no rows."""
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
