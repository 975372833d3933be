"""Max-pooling over k x k windows at stride k (SAME: windows cut at the bottom and right edges), and its gradient.

A reduction over windows, so its forms differ and sit side by side here:

====================  =============================  ===========================  ==============
op                    NumPy                          compiled CPU (numba)         CUDA
====================  =============================  ===========================  ==============
``maxpool``           copy + k*k-1 maxima (+ pad)    ``maxpool_loop``, one pass   1 launch
``maxpool_backward``  3-4 passes per window tap      ``maxpool_backward_loop``,   1 launch
                      (bool masks)                   one pass
====================  =============================  ===========================  ==============

Per element they compute the same thing: a window's maximum, NaN winning as in
``numpy.maximum`` (the compiled loop and the kernel keep the running maximum
``m`` unless a tap ``v`` is larger or NaN: the kernel's ``np_max(m, v)``), and
the gradient ``dy`` at the window's FIRST maximal element in row-major order,
``dy * 0`` elsewhere (a window of tied values, frequent after a ReLU, passes its
gradient to exactly one input, as TensorFlow's CPU kernel does).  Exact, so
every form gives NumPy's values (LeNet-5's two poolings, one CPU tower: 6.9 ms
of NumPy passes against 2.2 compiled).  No atomics: deterministic.

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

register(r"""// y (n, ho, wo, c): max of each k x k window of x (n, h, w, c), row-major, past-the-edge taps skipped.
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

""", ("maxpool", "maxpool_backward"))


def _compiled(*arrays) -> bool:
    """Whether these arrays take the compiled loops: host arrays, C-contiguous, where the current forms take them."""
    return current_forms().compiled and all(on_host(a) and a.flags.c_contiguous for a in arrays)


@numba_kernel(warm=lambda: (numpy.zeros((1, 2, 2, 2), numpy.float32), 2, numpy.zeros((1, 1, 1, 2), numpy.float32)))
def maxpool_loop(x, k, y):  # pragma: no cover - compiled
    """``y (n, ho, wo, c)``: the max of each k x k window of ``x (n, h, w, c)``, stride k, windows cut at the
    bottom and right edges (SAME).  A NaN wins its window, as in ``numpy.maximum``."""
    n, h, w, c = x.shape
    for b in range(n):  # x in memory order: each window's first tap comes first and sets its y
        for r in range(h):
            i, a = r // k, r % k
            for q in range(w):
                j, first = q // k, a == 0 and q % k == 0
                for ch in range(c):
                    v = x[b, r, q, ch]
                    if first:
                        y[b, i, j, ch] = v
                    else:
                        m = y[b, i, j, ch]
                        if v > m or (v != v and m == m):
                            y[b, i, j, ch] = v

@numba_kernel(warm=lambda: (numpy.zeros((1, 2, 2, 2), numpy.float32), numpy.zeros((1, 1, 1, 2), numpy.float32),
                                numpy.zeros((1, 1, 1, 2), numpy.float32), 2, numpy.zeros((1, 2, 2, 2), numpy.float32)))
def maxpool_backward_loop(x, y, dy, k, dx):  # pragma: no cover - compiled
    """``dx``: each window's ``dy`` at its FIRST element equal to its max (row-major), ``dy * 0`` elsewhere.

    The windows tile the input (stride k), so every element of ``dx`` is
    written once: no zeroing pass.
    """
    n, h, w, c = x.shape
    ho, wo = y.shape[1], y.shape[2]
    left = numpy.empty(c, numpy.bool_)  # per channel: the window's maximum is still unclaimed
    one, zero = dy.dtype.type(1), dy.dtype.type(0)
    for b in range(n):
        for i in range(ho):
            for j in range(wo):
                left[:] = True
                for a in range(k):
                    r = i * k + a
                    if r >= h:
                        break
                    for e in range(k):
                        q = j * k + e
                        if q >= w:
                            break
                        for ch in range(c):
                            take = left[ch] and x[b, r, q, ch] == y[b, i, j, ch]
                            # dy * 1 or dy * 0, as NumPy's masked multiply: -0.0 and NaN where it gives them
                            dx[b, r, q, ch] = dy[b, i, j, ch] * (one if take else zero)
                            left[ch] = left[ch] and not take



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


def maxpool(x, y, k: int, ws) -> None:
    """``y (n, ho, wo, c)``: the max of each k x k window of ``x (n, h, w, c)`` (stride k, SAME).

    NumPy: k*k elementwise maxima over strided window views (several times
    faster than a reduction over the two non-adjacent window axes); compiled
    (where the current forms take it), one pass.
    """
    n, ho, wo, c = y.shape
    h, w = x.shape[1:3]
    if _compiled(x, y):  # one compiled pass: the same maxima
        maxpool_loop(x, k, y)
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
    if _compiled(x, y, dy):  # one compiled pass: the same first maxima, dy * 1 and 0 are exact
        dx = ws.array("dx", x.shape, dy.dtype)
        maxpool_backward_loop(x, y, dy, k, dx)
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
