"""Batch norm's passes over (M, C) activations: the training statistics, the normalization, backward's sums and dx.

Reductions over the M values of each channel, so the forms differ; both sit
here, step by step, and the layer (``towers.nn.normalization.BatchNorm``)
composes them with its sync points (sync-BN keeps the NumPy passes, whose
moments it gathers across towers):

=============  ==========================================  ==========================================
step           NumPy (``*_passes``)                        compiled CPU (``*_loop``, numba)
=============  ==========================================  ==========================================
moments        ``shift`` = column sums (GEMV) / M,         ``moments_loop``: two passes that only
               ``xc = x - shift``, ``mean(xc)`` and        read, float64 sums
               ``mean(xc^2)`` (two GEMVs)
normalize      ``y = xc * a + b`` (two passes)             ``center_scale_loop``: ``xc`` and ``y``
                                                           in one pass
backward sums  ``sum(dy)``, ``sum(dy * xc)`` (GEMVs)       ``backward_sums_loop`` (float64)
backward dx    ``dx = (xc * k + dy + c0) * a`` (4 passes)  ``backward_dx_loop``: one pass
=============  ==========================================  ==========================================

Per element both forms compute ``y = xc * a + b`` and ``dx = (xc * k + dy +
c0) * a`` with the same roundings; the sums differ (float64 in the loop, a
GEMV's float32 order in NumPy), so results agree to float32 rounding, not bit
for bit: a model with batch norm ``rounds_otherwise`` under the compiled loops
(``towers.ops.backend``).  The moments are taken around a shift, never as
``E[x^2] - E[x]^2`` (module doc of ``towers.nn.normalization``).

NumPy broadcasts a (C,) vector over (M, C) one row of C values at a time:
with C = 16 that is 4x slower than the same pass over rows of ~1,000 values,
so the passes view (M, C) arrays as (M / r, r * C) (``wide``) and tile the
per-channel vectors r times.  Limits: C-contiguous (M, C) arrays of one float
dtype; the compiled loops take host arrays only.
"""
from __future__ import annotations

import functools

import numpy

from towers.devices.kernels import on_host
from towers.ops.backend import compiled as host_loops_chosen
from towers.ops.numba_jit import kernel as numba_kernel
from towers.ops.bias import col_sum

_ROW = 1024  # values per row of the wide views: long enough for NumPy's inner loop


@functools.lru_cache(maxsize=None)
def repeats(m: int, c: int) -> int:
    """How many rows of c channels to lay side by side: the largest divisor of m with r * c <= _ROW."""
    return max(r for r in range(1, max(_ROW // c, 1) + 1) if m % r == 0)


def wide(*arrays):
    """(M, C)-shaped contiguous arrays viewed as (M / r, r * C) (``repeats``), for per-channel broadcasts."""
    m, c = arrays[0].reshape(-1, arrays[0].shape[-1]).shape
    r = repeats(m, c)
    return tuple(a.reshape(m // r, r * c) for a in arrays)


def compiled_for(ws, a) -> bool:
    """Whether this step's array ``a`` takes the compiled loops: a C-contiguous host array, where the process
    chose them, and no ``sync`` (sync-BN gathers the NumPy passes' moments across towers)."""
    return host_loops_chosen() and ws.ctx.sync is None and on_host(a) and a.flags.c_contiguous


# -- the NumPy passes

def moments_passes(x2, xc, scratch, ws, coarse=None):
    """(shift, moments): the shift (the batch mean rounded to the dtype; ``coarse`` rounds it further) and
    moments (2, C) = mean(xc), mean(xc^2) around it; ``xc = x - shift`` is written (kept for backward).
    ``scratch``: an (M, C) buffer (the output's, until it holds the output)."""
    m, c = x2.shape
    dt = x2.dtype.type
    xp = ws.xp
    (xw, xcw, sqw), r = wide(x2, xc, scratch), repeats(m, c)
    # The shift: this tower's mean as float32 rounds it (a GEMV).  The values centred on it (kept for
    # backward) are small, so their moments (two GEMVs and a square) hold float32's precision of the spread,
    # not of the mean.
    shift = ws.array("shift", (c,), x2.dtype)
    col_sum(x2, shift, ws)
    shift *= dt(1.0 / m)
    if coarse is not None:
        shift = coarse(xp, shift)
    xp.subtract(xw, xp.tile(shift, r), out=xcw)
    moments = ws.array("moments", (2, c), x2.dtype)  # mean(xc), mean(xc^2)
    col_sum(xc, moments[0], ws)
    xp.multiply(xcw, xcw, out=sqw)
    col_sum(scratch.reshape(x2.shape), moments[1], ws)
    moments *= dt(1.0 / m)
    return shift, moments


def normalize_passes(xc, a, b, y, xp) -> None:
    """``y = xc * a + b`` over (M, C) arrays, per-channel ``a``, ``b``."""
    (xcw, yw), r = wide(xc, y), repeats(*xc.shape)
    xp.multiply(xcw, xp.tile(a, r), out=yw)
    yw += xp.tile(b, r)


def backward_sums_passes(dy2, xc, scratch, sums, ws) -> None:
    """``sums[0] = sum(dy)``, ``sums[1] = sum(dy * xc)`` per channel (``scratch``: an (M, C) buffer)."""
    (dyw, xcw, sw) = wide(dy2, xc, scratch)
    col_sum(dy2, sums[0], ws)
    ws.xp.multiply(dyw, xcw, out=sw)
    col_sum(scratch.reshape(dy2.shape), sums[1], ws)


def backward_dx_passes(dy2, xc, k, c0, a, dx, xp) -> None:
    """``dx = (xc * k + dy + c0) * a`` over (M, C) arrays, per-channel ``k``, ``c0``, ``a``: four passes."""
    (dyw, xcw, dxw), r = wide(dy2, xc, dx), repeats(*dy2.shape)
    xp.multiply(xcw, xp.tile(k, r), out=dxw)
    dxw += dyw
    dxw += xp.tile(c0, r)
    dxw *= xp.tile(a, r)


# -- the compiled loops


def _f32(*shape):
    """Zeros of ``shape``, float32: a warm-up argument."""
    return numpy.zeros(shape, numpy.float32)



@numba_kernel(warm=lambda: (_f32(2, 2),))
def moments_loop(x):  # pragma: no cover - compiled; tested through the layer
    """(shift, off, var) per channel of (M, C) ``x`` (module doc): two passes that only read.

    A loop that also stored ``xc`` would keep the sums in memory (the
    store might alias them) and run 3x slower: ``center_scale_loop`` writes it.
    """
    m, c = x.shape
    acc = numpy.zeros(c, numpy.float64)
    for i in range(m):
        for j in range(c):
            acc[j] += x[i, j]
    shift = (acc / m).astype(x.dtype)
    s1 = numpy.zeros(c, numpy.float64)
    s2 = numpy.zeros(c, numpy.float64)
    for i in range(m):
        for j in range(c):
            d = numpy.float64(x[i, j] - shift[j])
            s1[j] += d
            s2[j] += d * d
    off = s1 / m
    return shift, off.astype(x.dtype), (s2 / m - off * off).astype(x.dtype)


@numba_kernel(warm=lambda: (_f32(2, 2), _f32(2), _f32(2), _f32(2), _f32(2, 2), _f32(2, 2)))
def center_scale_loop(x, shift, a, b, xc, y):  # pragma: no cover - compiled
    """``xc = x - shift`` and ``y = xc * a + b`` over (M, C) arrays, per-channel ``shift``, ``a``, ``b``."""
    m, c = x.shape
    for i in range(m):
        for j in range(c):
            d = x[i, j] - shift[j]
            xc[i, j] = d
            y[i, j] = d * a[j] + b[j]


@numba_kernel(warm=lambda: (_f32(2, 2), _f32(2, 2)))
def backward_sums_loop(dy, xc):  # pragma: no cover - compiled
    """(sum(dy), sum(dy * xc)) per channel of (M, C) arrays, in float64."""
    m, c = dy.shape
    s0 = numpy.zeros(c, numpy.float64)
    s1 = numpy.zeros(c, numpy.float64)
    for i in range(m):
        for j in range(c):
            d = dy[i, j]
            s0[j] += d
            s1[j] += d * numpy.float64(xc[i, j])
    return s0, s1


@numba_kernel(warm=lambda: (_f32(2, 2), _f32(2, 2), _f32(2), _f32(2), _f32(2), _f32(2, 2)))
def backward_dx_loop(dy, xc, k, c0, a, dx):  # pragma: no cover - compiled
    """``dx = (xc * k + dy + c0) * a`` over (M, C) arrays, per-channel ``k``, ``c0``, ``a``."""
    m, c = dy.shape
    for i in range(m):
        for j in range(c):
            dx[i, j] = (xc[i, j] * k[j] + dy[i, j] + c0[j]) * a[j]
