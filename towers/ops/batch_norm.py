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
(``towers.ops.forms``).  The moments are taken around a shift, never as
``E[x^2] - E[x]^2`` (module doc of ``towers.nn.normalization``).

NumPy broadcasts a (C,) vector over (M, C) one row of C values at a time:
with C = 16 that is 4x slower than the same pass over rows of ~1,000 values,
so the passes view (M, C) arrays as (M / r, r * C) (``wide``) and tile the
per-channel vectors r times.  Limits: C-contiguous (M, C) arrays of one float
dtype; the compiled loops take host arrays only.

On a GPU (``device_kernels_for``: float32 device arrays, at most 256
channels, no sync-BN) a training forward is three launches and a backward
three, the per-channel arithmetic of the layer done in the kernels instead
of a dozen array operations on (C,) vectors:

* ``bn_partial``: per block of rows, the sums of ``x - x[0]`` and of its
  square (forward), or of ``dy`` and ``dy * xc`` (backward), in float64, into
  a (blocks, 2, C) buffer: no atomics, a fixed order, the same bits every run;
* ``bn_stats`` / ``bn_grad_stats``: one thread per channel adds the blocks'
  sums in order and computes the layer's quantities as the passes do:
  ``shift`` (the mean rounded to float32), ``off``, ``var``, the moving
  statistics' EMA step, ``inv_std``, ``a``, ``b`` (forward); gamma's and
  beta's gradients, ``k`` and ``c0`` (backward);
* ``bn_apply`` / ``bn_dx``: ``y = xc * a + b`` and ``dx = (xc * k + dy + c0) *
  a`` per element, with ``xc = x - shift`` recomputed from the input (not
  stored), every product rounded apart (``__fmul_rn``: no FMA contraction).

The sums are float64 as in the compiled loops, so the results agree with the
NumPy passes to float32 rounding.
"""
from __future__ import annotations

import functools

import numpy

from towers.arrays import on_host
from towers.devices.kernels import check_contiguous, launch_named, register, takes
from towers.ops.forms import current as current_forms
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
    """Whether this step's array ``a`` takes the compiled loops: a C-contiguous host array, where the current
    forms take them (``towers.ops.forms``), and no ``sync`` (sync-BN gathers the NumPy passes' moments across
    towers)."""
    return current_forms().compiled and ws.ctx.sync is None and on_host(a) and a.flags.c_contiguous


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


# -- the CUDA form (module doc): registered into the one CUDA module

register(r"""// Batch norm over (m, c) rows: per block of rows, float64 sums per channel into part (blocks, 2, c).
// grad 0: sums of d = x - x[0, ch] and d * d; grad 1: sums of dy and dy * (x - shift[ch]).
// 256 threads: lanes = 256 / c rows at a time, thread t on channel t % c; lane sums added in order.
__global__ void towers_bn_partial(const float* x, const float* dy, const float* shift, double* part, int m, int c,
                                  int rows, int grad) {
    __shared__ double s1[256], s2[256];
    int t = threadIdx.x, lanes = 256 / c, lane = t / c, ch = t - lane * c;
    double a1 = 0.0, a2 = 0.0;
    if (lane < lanes) {
        int r0 = blockIdx.x * rows, r1 = min(r0 + rows, m);
        for (int r = r0 + lane; r < r1; r += lanes) {
            long long i = (long long)r * c + ch;
            if (grad) {
                double g = (double)dy[i];
                a1 += g;
                a2 += g * (double)(x[i] - shift[ch]);
            } else {
                double d = (double)x[i] - (double)x[ch];
                a1 += d;
                a2 += d * d;
            }
        }
    }
    s1[t] = a1;
    s2[t] = a2;
    __syncthreads();
    if (t < c) {
        double u1 = 0.0, u2 = 0.0;
        for (int l = 0; l < lanes; ++l) {
            u1 += s1[l * c + t];
            u2 += s2[l * c + t];
        }
        part[(long long)blockIdx.x * 2 * c + t] = u1;
        part[(long long)blockIdx.x * 2 * c + c + t] = u2;
    }
}

// Per channel, from the blocks' sums around x[0, ch]: shift (the mean as float32), off = mean - shift, the biased
// variance (at least 0), the moving statistics' step mv - (mv - batch) * (1 - d), inv_std, a = gamma * inv_std and
// b = beta - off * a (the layer's quantities: stats[0..4] = shift, off, inv_std, a, b).
__global__ void towers_bn_stats(const double* part, int blocks, int m, int c, const float* x, const float* gamma,
                                int has_gamma, const float* beta, int has_beta, float* moving_mean, float* moving_var,
                                const float* one_minus_d_at, float eps, float* stats) {
    const float one_minus_d = one_minus_d_at[0];  // in device memory: a step replayed as a CUDA graph reads its own
    LOOP(ch, c) {
        double u1 = 0.0, u2 = 0.0;
        for (int b = 0; b < blocks; ++b) {
            u1 += part[(long long)b * 2 * c + ch];
            u2 += part[(long long)b * 2 * c + c + ch];
        }
        double d1 = u1 / m, ref = (double)x[ch];
        float shift = (float)(ref + d1);
        float off = (float)((ref - (double)shift) + d1);
        double var64 = u2 / m - d1 * d1;
        float var = var64 > 0.0 ? (float)var64 : 0.0f;
        float mean = shift + off;
        moving_mean[ch] = moving_mean[ch] - __fmul_rn(moving_mean[ch] - mean, one_minus_d);
        moving_var[ch] = moving_var[ch] - __fmul_rn(moving_var[ch] - var, one_minus_d);
        float inv_std = 1.0f / sqrtf(var + eps);
        float a = has_gamma ? __fmul_rn(gamma[ch], inv_std) : inv_std;
        float b = __fmul_rn(-off, a);
        if (has_beta) b += beta[ch];
        stats[ch] = shift;
        stats[c + ch] = off;
        stats[2 * c + ch] = inv_std;
        stats[3 * c + ch] = a;
        stats[4 * c + ch] = b;
    }
}

// y = (x - shift) * a + b, per element.
__global__ void towers_bn_apply(const float* x, const float* stats, float* y, int n, int c) {
    LOOP(i, n) {
        int ch = i % c;
        y[i] = __fmul_rn(x[i] - stats[ch], stats[3 * c + ch]) + stats[4 * c + ch];
    }
}

// Per channel, from the blocks' sums of dy and dy * xc: s1 = (sum(dy xc) - off sum(dy)) * inv_std, gamma's and
// beta's gradients (s1, sum(dy)), and dx's coefficients k = -inv_std * s1 / m, c0 = off * inv_std * s1 / m - s0 / m
// (grads[0..1] = k, c0).
__global__ void towers_bn_grad_stats(const double* part, int blocks, int m, int c, const float* stats,
                                     float* g_gamma, int has_gamma, float* g_beta, int has_beta, float* grads) {
    LOOP(ch, c) {
        double u0 = 0.0, u1 = 0.0;
        for (int b = 0; b < blocks; ++b) {
            u0 += part[(long long)b * 2 * c + ch];
            u1 += part[(long long)b * 2 * c + c + ch];
        }
        float off = stats[c + ch], inv_std = stats[2 * c + ch];
        float s0 = (float)u0;
        float s1 = __fmul_rn((float)u1 - __fmul_rn(off, s0), inv_std);
        if (has_gamma) g_gamma[ch] = s1;
        if (has_beta) g_beta[ch] = s0;
        float inv_m = (float)(1.0 / m);  // as the passes' dtype(1.0 / m)
        float mean0 = __fmul_rn(s0, inv_m), mean1 = __fmul_rn(s1, inv_m);
        grads[ch] = __fmul_rn(-inv_std, mean1);
        grads[c + ch] = __fmul_rn(__fmul_rn(off, inv_std), mean1) - mean0;
    }
}

// dx = ((x - shift) * k + dy + c0) * a, per element.
__global__ void towers_bn_dx(const float* dy, const float* x, const float* stats, const float* grads, float* dx,
                             int n, int c) {
    LOOP(i, n) {
        int ch = i % c;
        dx[i] = __fmul_rn(__fmul_rn(x[i] - stats[ch], grads[ch]) + dy[i] + grads[c + ch], stats[3 * c + ch]);
    }
}
""", ("bn_partial", "bn_stats", "bn_apply", "bn_grad_stats", "bn_dx"))

#: The GPU kernels run batch norm (``device_kernels_for``); False: the array passes on the device too.
DEVICE_KERNELS = [True]
_BLOCK_ROWS = 256  # rows per block of ``bn_partial`` (at most _MAX_BLOCKS blocks: more rows each then)
_MAX_BLOCKS = 1024
_i = numpy.int32


def device_kernels_for(ws, a) -> bool:
    """Whether this step's (M, C) array ``a`` takes the GPU kernels (module doc): float32 on a device, C-contiguous,
    at most 256 channels, no ``sync`` (sync-BN gathers the passes' moments across towers)."""
    return (DEVICE_KERNELS[0] and not on_host(a) and ws.ctx.sync is None and takes(a) and a.flags.c_contiguous
            and a.shape[1] <= 256)


def _partial(x2, dy2, stats, ws):
    m, c = x2.shape
    blocks = min(-(-m // _BLOCK_ROWS), _MAX_BLOCKS)
    rows = -(-m // blocks)
    part = ws.array("bn_part", (blocks, 2, c), numpy.float64)
    grad = dy2 is not None
    launch_named("bn_partial", blocks * 256, x2, dy2 if grad else x2, stats if grad else x2, part, _i(m), _i(c),
                 _i(rows), _i(grad))
    return part, blocks


def forward_kernels(x2, gamma, beta, moving_mean, moving_var, one_minus_d, eps, y2, ws):
    """Training forward of (M, C) ``x2`` into ``y2`` on the GPU; the moving statistics stepped in place by
    ``one_minus_d``, a 1-element float32 device array (1 - their EMA's decay); returns ``stats`` (5, C): shift,
    off, inv_std, a, b (kept for backward)."""
    m, c = x2.shape
    part, blocks = _partial(x2, None, None, ws)
    stats = ws.array("bn_stats", (5, c), numpy.float32)
    launch_named("bn_stats", c, part, _i(blocks), _i(m), _i(c), x2, x2 if gamma is None else gamma,
                 _i(gamma is not None), x2 if beta is None else beta, _i(beta is not None), moving_mean, moving_var,
                 one_minus_d, numpy.float32(eps), stats)
    launch_named("bn_apply", x2.size, x2, stats, y2, _i(x2.size), _i(c))
    return stats


def backward_kernels(dy2, x2, stats, g_gamma, g_beta, dx2, ws) -> None:
    """Backward of ``forward_kernels`` on the GPU: gamma's and beta's gradients (None: the layer has none) and,
    with ``dx2`` (else None), the input gradient."""
    m, c = x2.shape
    check_contiguous(dy2)
    part, blocks = _partial(x2, dy2, stats, ws)
    grads = ws.array("bn_grads", (2, c), numpy.float32)
    launch_named("bn_grad_stats", c, part, _i(blocks), _i(m), _i(c), stats, stats if g_gamma is None else g_gamma,
                 _i(g_gamma is not None), stats if g_beta is None else g_beta, _i(g_beta is not None), grads)
    if dx2 is not None:
        launch_named("bn_dx", dx2.size, dy2, x2, stats, grads, dx2, _i(dx2.size), _i(c))
