"""Fused CPU kernels compiled by numba (optional): batch norm, pooling, ReLU, col2im, L2, means, updates.

NumPy runs one pass over memory per operation.  Batch norm's training step
is about seven of them forward (a GEMV for the shift, the centring, two
GEMVs and a square for the moments, a multiply and an add) and six backward
(``towers.nn.normalization``): on ResNet-20 (32 x 32 x 16 activations, one
CPU tower x 32) they take 39 ms of a 173 ms step.  A compiled loop reads each
value once per pass and keeps the per-channel sums in registers:

* forward (training): pass 1, per-channel sums of ``x`` -> ``shift`` (the
  batch mean, rounded to float32); pass 2, the sums of ``x - shift`` and of
  its square; pass 3, ``xc = x - shift`` (kept for backward) and
  ``y = xc * a + b``.
  The same shifted moments as the NumPy path (``off = mean(xc)`` is only the
  shift's rounding, so ``var = mean(xc^2) - off^2`` does not cancel), with
  the sums accumulated in float64;
* backward: pass 1, ``sum(dy)`` and ``sum(dy * xc)`` (float64); pass 2,
  ``dx = (xc * k + dy + c) * a``, the NumPy path's formula.

Max-pooling (k x k windows, stride k): forward, one pass over the windows;
backward, one pass that writes each window's ``dy`` at its first maximal
element and ``dy * 0`` elsewhere, instead of NumPy's k*k compare-and-mask passes
(LeNet-5's two poolings: 6.9 to 2.2 ms of a tower's step).  Both are exact,
so they give NumPy's bits.

ReLU: a residual block's ``maximum(h + s, 0)`` in one pass instead of two,
and the backward ``dy *= (y > 0)`` in one pass instead of a mask and a
multiply; exact, NumPy's bits.

L2's gradient ``g += l2 * w`` in one pass instead of two (LeNet-5: 1.6 M
regularized weights); the all-reduce of two CPU towers, ``(a + b) * 0.5``
into both, in one pass instead of three (``towers.parallel.reducers``); and
``loop``: an optimizer's ``cpu_loop`` (its update and the EMA, element by
element, as its NumPy passes round them) compiled into one pass over a tower
thread's slice.  All exact, NumPy's bits.

col2im (``towers.nn.kernels.col2im``): each input pixel gathers its taps in
one pass, in the order of NumPy's strided adds (exact).  A convolution with
more filters than input channels takes its input gradient through it, where
NumPy takes dy's im2col instead (``towers.nn.conv``): other sums.

The kernels release the GIL (``nogil``), so two CPU tower threads run them at
once.  Batch norm's results, and those convolutions', equal the NumPy path's
up to float32 rounding, not bit for bit (``rounds_otherwise``): a run's
``cpu_kernels`` setting is part of what makes its results reproducible.

numba compiles each kernel on its first call (about 2 s for all of them, once
per machine) and caches the machine code on disk beside this file (or in
``NUMBA_CACHE_DIR``), so later runs load it: per kernel an index
(``<kernel>-<line>.pyXY.nbi``: numba's version, then a pickle of the source's
stamp and the data file of each signature) and data files (``.nbc``, pickles
of the object code), in ``__pycache__`` (or ``NUMBA_CACHE_DIR`` followed by
this folder's path).  numba writes them atomically, but a file damaged
afterwards (a disk error, a copy cut short) made numba raise at the first
call of its kernel (``UnpicklingError``, ``EOFError``, ...) in every run until
the folder was deleted.  A cache is a cache: a kernel whose cached code does
not load is compiled again, with a notice naming the folder, and its index is
written anew (``_Recompiling``).  Limits: C-contiguous (M, C)
arrays of one float dtype; the per-tower statistics only (``sync_bn`` keeps the
NumPy path, whose moments it gathers across towers).

``load(mode)`` is the one entry point (the ``cpu_kernels`` setting):
``"auto"`` gives these kernels when numba imports and None otherwise,
``"numba"`` requires it, ``"numpy"`` gives None (layers then run their NumPy
code).  ``towers.step.tower.build_towers`` loads them for CPU towers and
warms them up there; with ``auto`` only for a model ``worth_loading`` them.
Cost: numba's start, about 0.75 s a process (its import, then the first
kernel's machine code: LLVM starts), and the first run on a machine compiles
them (about 2 s).
"""

from __future__ import annotations

import contextlib
import os
import threading
import types

from towers.errors import UserError, notice

MODES = ("auto", "numba", "numpy")
_COMPILED: list = []  # [the namespace of numba dispatchers, or the ImportError], made on the first load
_LOCK = threading.Lock()

#: ``auto`` loads the kernels for models of this many parameters or more: the update, L2 and all-reduce passes
#: they fuse grow with the model (the MLP 784-500-10, 0.4 M: 0.4-0.5 ms of a 3.4 ms step saved; the default
#: digits MLP, 37.5 k: about 0.12 ms, so numba's start, 0.75 s, costs its 2,000-step run more than it saves).
WORTH_PARAMS = 100_000


def worth_loading(model) -> bool:
    """Whether ``auto`` loads the kernels for ``model`` (built): ``WORTH_PARAMS`` or more parameters, or results
    that depend on them (``rounds_otherwise``: a model's results never depend on its size)."""
    return model.size >= WORTH_PARAMS or rounds_otherwise(model)


def rounds_otherwise(model) -> bool:
    """Whether these kernels change ``model``'s (built) results: a layer's ``fused_rounding``, where layers
    after the first with trainable parameters take their input gradient (``Replica._backward``)."""
    first = min((li for li, _, prm in model.params if prm.trainable), default=0)
    return any(layer.fused_rounding(input_grad=i > first) for i, layer in enumerate(model.layers))


def load(mode: str = "auto"):
    """The fused kernels for ``mode`` (module doc), or None for NumPy's array operations.

    Imports numba (about 0.25 s) on the first call.  With ``auto``, a numba that is missing or
    fails to import (a release that does not support this NumPy) leaves NumPy
    in charge, with a notice when it is installed but broken; ``numba``
    refuses to run without it.
    """
    if mode not in MODES:
        raise UserError(f"`cpu_kernels` {mode!r} is unknown: use one of {', '.join(MODES)}")
    if mode == "numpy":
        return None
    with _LOCK:
        if not _COMPILED:
            try:
                _COMPILED.append(_compile(cache=True))
            except ImportError as e:
                _COMPILED.append(e)
            except RuntimeError as e:  # numba found no writable place for its cache
                notice(f"CPU kernels: numba cannot cache them ({e}); they are compiled at every start "
                       "(about a second each): set NUMBA_CACHE_DIR to a writable folder")
                _COMPILED.append(_compile(cache=False))
    kernels = _COMPILED[0]
    if isinstance(kernels, ImportError):
        missing = isinstance(kernels, ModuleNotFoundError) and kernels.name == "numba"
        why = "numba is not installed" if missing else f"numba does not import ({kernels})"
        if mode == "numba":
            raise UserError(f"`cpu_kernels` numba: {why}; install a numba that supports NumPy "
                            f"{_numpy_version()} (pip install -U numba) or set `cpu_kernels` to auto or numpy")
        if not missing:
            notice(f"CPU kernels: {why}; NumPy's array operations run instead")
        return None
    return kernels


def _numpy_version() -> str:
    import numpy

    return numpy.__version__


def warm_up(kernels) -> None:
    """Call every kernel once on tiny float32 arrays, so that each kernel's machine code is loaded from the disk
    cache (or compiled: about a second a kernel, once per machine) here, not in a timed step."""
    import numpy

    f = numpy.float32
    x, y, v = numpy.zeros((1, 2, 2, 2), f), numpy.zeros((1, 1, 1, 2), f), numpy.zeros(2, f)
    x2, flat = x.reshape(-1, 2), x.reshape(-1)
    kernels.bn_moments(x2)
    kernels.center_scale(x2, v, v, v, x2.copy(), x2.copy())
    kernels.bn_backward_sums(x2, x2)
    kernels.bn_backward_dx(x2, x2, v, v, v, x2.copy())
    kernels.maxpool(x, 2, y)
    kernels.maxpool_backward(x, y, y, 2, x.copy())
    kernels.add_relu(flat, flat, flat.copy())
    kernels.relu_backward(flat, flat.copy())
    kernels.add_scaled(flat.copy(), flat, f(0))
    kernels.mean2(flat.copy(), flat.copy(), f(0.5))
    kernels.col2im(numpy.zeros((1, 1, 1, 2, 2, 2), f), x.copy(), 0, 0, 1)


_DAMAGED: set = set()  # cache folders whose damage was noticed (one notice a folder and process)


def _recompiling_cache(numba):
    """numba's per-function disk cache, which compiles again where its files do not load (module doc).

    numba loads a kernel's cached code (``load_overload``) when the kernel is
    first called for a signature; a damaged index or data file raises there,
    on every start.  Here that load gives nothing instead, so numba compiles
    the kernel and saves it (``save_overload``), after the index is removed:
    numba's save reads the index first and would raise on it again (a data
    file it names is then written anew, as numba numbers them).
    """
    from numba.core.caching import FunctionCache

    class _Recompiling(FunctionCache):
        def load_overload(self, sig, target_context):
            try:
                return super().load_overload(sig, target_context)
            except MemoryError:
                raise
            except Exception as e:  # whatever a damaged pickle or object code raises
                index = self._cache_file._index_path
                with contextlib.suppress(OSError):
                    os.unlink(index)
                if self.cache_path not in _DAMAGED:
                    _DAMAGED.add(self.cache_path)
                    notice(f"CPU kernels: numba's cache in {self.cache_path} does not load "
                           f"({self._py_func.__name__}: {type(e).__name__}: {e}); compiling the kernels again "
                           "(a second or two) and caching them anew")
                return None

    return _Recompiling


def _compile(cache: bool):
    """The kernels as numba dispatchers (each compiled per dtype on its first call; ``cache``: on disk).

    With ``cache``, numba looks for a writable folder for it when each kernel
    is defined (beside this file, then the user's cache folder), and raises
    ``RuntimeError`` when there is none (a read-only install, no home); a
    kernel whose cached code does not load is compiled again
    (``_recompiling_cache``).
    """
    import numba
    import numpy
    njit = numba.njit(nogil=True, cache=cache, error_model="numpy")
    cache_class = _recompiling_cache(numba) if cache else None

    def jit(fn):
        dispatcher = njit(fn)
        if cache_class is not None:
            # What numba's Dispatcher.enable_caching does (cache=True), with the cache that recompiles.
            dispatcher._cache = cache_class(dispatcher.py_func)
        return dispatcher

    @jit
    def bn_moments(x):  # pragma: no cover - compiled; tested through the layer
        """(shift, off, var) per channel of (M, C) ``x`` (module doc): two passes that only read.

        A loop that also stored ``xc`` would keep the sums in memory (the
        store might alias them) and run 3x slower: ``center_scale`` writes it.
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

    @jit
    def center_scale(x, shift, a, b, xc, y):  # pragma: no cover - compiled
        """``xc = x - shift`` and ``y = xc * a + b`` over (M, C) arrays, per-channel ``shift``, ``a``, ``b``."""
        m, c = x.shape
        for i in range(m):
            for j in range(c):
                d = x[i, j] - shift[j]
                xc[i, j] = d
                y[i, j] = d * a[j] + b[j]

    @jit
    def bn_backward_sums(dy, xc):  # pragma: no cover - compiled
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

    @jit
    def bn_backward_dx(dy, xc, k, c0, a, dx):  # pragma: no cover - compiled
        """``dx = (xc * k + dy + c0) * a`` over (M, C) arrays, per-channel ``k``, ``c0``, ``a``."""
        m, c = dy.shape
        for i in range(m):
            for j in range(c):
                dx[i, j] = (xc[i, j] * k[j] + dy[i, j] + c0[j]) * a[j]

    @jit
    def maxpool(x, k, y):  # pragma: no cover - compiled
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

    @jit
    def maxpool_backward(x, y, dy, k, dx):  # pragma: no cover - compiled
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

    @jit
    def add_relu(h, s, y):  # pragma: no cover - compiled
        """``y = maximum(h + s, 0)`` over flat arrays, the sum rounded first (NaN passes, -0.0 gives 0.0: as
        ``numpy.maximum`` against zeros)."""
        for i in range(y.size):
            v = h[i] + s[i]
            y[i] = v if (v > 0 or v != v) else 0

    @jit
    def relu_backward(y, dy):  # pragma: no cover - compiled
        """In place over flat arrays: ``dy *= (y > 0)`` as 1.0 / 0.0 (signs and NaN follow the multiply)."""
        one, zero = dy.dtype.type(1), dy.dtype.type(0)
        for i in range(dy.size):
            dy[i] = dy[i] * (one if y[i] > 0 else zero)

    @jit
    def add_scaled(g, w, s):  # pragma: no cover - compiled
        """In place over flat arrays: ``g += s * w``, the product rounded first (L2's gradient)."""
        for i in range(g.size):
            g[i] += w[i] * s

    @jit
    def col2im(dcols, dx, top, left, stride):  # pragma: no cover - compiled
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

    @jit
    def mean2(a, b, s):  # pragma: no cover - compiled
        """In place over flat arrays: ``a`` and ``b`` both become ``(a + b) * s``, the sum rounded first (the
        all-reduce of two CPU towers: NumPy's add, scale and copy in one pass)."""
        for i in range(a.size):
            v = (a[i] + b[i]) * s
            a[i] = v
            b[i] = v

    loops: dict = {}

    def loop(fn):
        """``fn`` (a plain Python loop over flat arrays: an optimizer's ``cpu_loop``) compiled, once per process."""
        compiled = loops.get(fn)
        if compiled is None:
            with _LOCK:
                compiled = loops.get(fn) or jit(fn)
                loops[fn] = compiled
        return compiled

    return types.SimpleNamespace(loop=loop, bn_moments=bn_moments, center_scale=center_scale, bn_backward_sums=bn_backward_sums,
                                 bn_backward_dx=bn_backward_dx, maxpool=maxpool, maxpool_backward=maxpool_backward,
                                 add_relu=add_relu, relu_backward=relu_backward, add_scaled=add_scaled,
                                 mean2=mean2, col2im=col2im)
