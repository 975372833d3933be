"""The device kernels of towers: one CUDA module, compiled once, and how its kernels are launched.

Every raw kernel of the layers and reducers lives in ONE CUDA source: a head
(the grid-stride ``LOOP`` and NumPy's ``maximum`` as ``np_max``), the parts the
ops ``register`` when ``towers.ops`` is imported (which ``import towers``
does: the generated elementwise kernels and the hand-written window and loss
kernels, in the order ``towers.ops`` imports them), this module's own
kernels, and a tail.  The text is assembled in that fixed order, so it is the
same string in every process: NVRTC compiles it once and CuPy keeps the
binary in its on-disk kernel cache (``CUPY_CACHE_DIR``, keyed by the text),
so later runs load it without compiling; ``warm_up`` loads every kernel on
the current device before the first step.  A part registered after the first
compile would be missing from the compiled module, so ``register`` refuses it
(an op made later, an optimizer's update, compiles on its own:
``towers.ops.codegen.cuda_form.CudaKernel``).

``launch`` calls a kernel's loaded CUDA function directly, a grid-stride loop
over ``n`` elements on the current stream (a small model's step is bound by the
host's launch cost, and CuPy's per-call lookup costs a few microseconds);
every generated kernel is launched through it.

This module's own kernel, ``gather_batch``: a batch of device-resident data,
``xo = xd[idx] * scale`` and ``yo = yd[idx]`` (NumPy's fancy index and scale on
the host, one launch on a GPU, the CPU's values on the same inputs;
``tests/gpu/test_gpu.py`` checks it).  No atomics: results are deterministic.

Limits: float32 (``gather_batch`` also reads uint8), C-contiguous arrays, at
most ``MAX_ELEMENTS`` elements per array (index arithmetic is 32-bit for
speed, and the grid-stride loop's last index plus its stride must stay below
2**31; larger arrays, and arrays of another dtype, take the array operations
on the device instead: ``takes`` says which).  Launches go on the current
stream; nothing here synchronizes.
"""
from __future__ import annotations

import numpy

from towers.arrays import array_module, on_host

_BLOCK = 256
_MAX_GRID = 65535 * 8
# The kernels' index arithmetic is 32-bit: the grid-stride loop's ``i += stride``
# must not pass 2**31 - 1 for any i < n, so n leaves room for one stride.
MAX_ELEMENTS = 2**31 - 1 - _BLOCK * _MAX_GRID
_F32 = numpy.dtype(numpy.float32)

# The module's text is _HEAD + the registered parts + _OWN + _TAIL (``source``).
#: The kernels' ``maximum``: ``a`` unless ``b`` is larger or NaN (NaN propagates; ``a`` on ties).
NP_MAX = r"""// numpy.maximum(a, b): a unless b is larger or b is NaN (NaN propagates)
__device__ __forceinline__ float np_max(float a, float b) { return (a >= b || a != a) ? a : b; }
"""

_HEAD = r"""
#define LOOP(i, n) for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += blockDim.x * gridDim.x)
""" + NP_MAX + r"""
extern "C" {

"""

_OWN = r"""// One batch from a device-resident data set: rows idx of xd (scaled to float32) and of yd.
__global__ void towers_gather_u8(const unsigned char* xd, const int* yd, const long long* idx, float* xo, int* yo,
                                 int total, int feat, float scale) {
    LOOP(i, total) {
        int r = i / feat, f = i - r * feat;
        long long src = idx[r];
        xo[i] = (float)xd[src * feat + f] * scale;
        if (f == 0) yo[r] = yd[src];
    }
}

__global__ void towers_gather_f32(const float* xd, const int* yd, const long long* idx, float* xo, int* yo,
                                  int total, int feat, float scale) {
    LOOP(i, total) {
        int r = i / feat, f = i - r * feat;
        long long src = idx[r];
        xo[i] = xd[src * feat + f];
        if (f == 0) yo[r] = yd[src];
    }
}

"""

_TAIL = r"""}  // extern "C"
"""

_OWN_NAMES = ("gather_u8", "gather_f32")
_PARTS: list = []  # (CUDA text, kernel names) registered by other modules, in import order
#: NVRTC options of the module: NVRTC's defaults (its generated kernels write every product ``__fmul_rn``,
#: which never contracts into an FMA; ``towers.ops.codegen.cuda_form``).
MODULE_OPTIONS: tuple = ()
_FROZEN: list = []  # the module's text, fixed by the first compile
_KERNELS: dict = {}


def register(source: str, names: tuple) -> None:
    """Add the ``extern "C"`` kernels ``towers_<name>`` for ``names`` (CUDA text, which may use ``LOOP`` and
    ``np_max``) to the module, before its first compile (at import time).  The same part again is a no-op."""
    part = (source, tuple(names))
    if part in _PARTS:
        return
    if _FROZEN:
        raise RuntimeError(f"CUDA kernels {', '.join(names)} registered after the module was compiled: "
                           "register them when their module is imported")
    _PARTS.append(part)


def open_for_parts() -> bool:
    """Whether ``register`` still takes parts: the module has not been compiled yet in this process."""
    return not _FROZEN


def source() -> str:
    """The CUDA module's text: the head, the registered parts in order, this module's kernels, the tail."""
    return _HEAD + "".join(text for text, _ in _PARTS) + _OWN + _TAIL


def kernel_names() -> tuple:
    """Every kernel of the module, ``towers_<name>``: the registered parts' in order, then this module's."""
    return tuple(name for _, names in _PARTS for name in names) + _OWN_NAMES


def raw_kernel(name: str):
    """The raw kernel ``towers_<name>`` (CuPy compiles per device, and caches on disk)."""
    k = _KERNELS.get(name)
    if k is None:
        import cupy

        if not _FROZEN:
            _FROZEN.append(source())
        k = _KERNELS[name] = cupy.RawKernel(_FROZEN[0], "towers_" + name, options=MODULE_OPTIONS)
    return k


def warm_up() -> None:
    """Compile (or load from the disk cache) every kernel on the current device now."""
    for name in kernel_names():
        _ = raw_kernel(name).attributes  # forces compilation and loading on this device


_FUNCS: dict = {}  # (RawKernel, device id) -> its loaded CUDA function
_BLOCK_DIMS = (_BLOCK,)
_i = numpy.int32  # a kernel's int argument


def takes(*arrays) -> bool:
    """Whether the float kernels take these device arrays: float32, at most ``MAX_ELEMENTS`` elements each.

    A kernel reads its buffers as ``float*``: an array of another dtype (a
    user's layer computing in float64) would be misread, so the callers give
    such arrays to CuPy's array operations instead.
    """
    for a in arrays:
        if a.dtype != _F32 or a.size > MAX_ELEMENTS:
            return False
    return True


def launch(kernel, n: int, *args) -> None:
    """The ``cupy.RawKernel`` ``kernel`` over ``n`` elements (a grid-stride loop) on the current device and stream.

    The loaded function is cached per device and called directly (the
    RawKernel's per-call lookup of it is skipped: at a few microseconds per
    launch, host time is what bounds a small model's step).  Arrays must be
    C-contiguous: the callers here check those that come from other layers;
    workspace buffers, parameter views and flat buffers are contiguous by
    construction.
    """
    key = (kernel, _device_id())
    fn = _FUNCS.get(key)
    if fn is None:
        fn = _FUNCS[key] = kernel.kernel  # compiled or loaded for this device once
    fn((min(-(-n // _BLOCK), _MAX_GRID) or 1,), _BLOCK_DIMS, args)


def launch_named(name: str, n: int, *args) -> None:
    """``launch`` of the module's kernel ``towers_<name>``."""
    launch(_KERNELS.get(name) or raw_kernel(name), n, *args)


def _device_id() -> int:
    """The current CUDA device (this stub rebinds itself to CuPy's ``getDevice`` on first use)."""
    global _device_id
    from cupy_backends.cuda.api.runtime import getDevice

    _device_id = getDevice
    return getDevice()


def check_contiguous(*arrays) -> None:
    for a in arrays:
        if not a.flags.c_contiguous:
            raise ValueError(f"towers kernels take C-contiguous arrays, got strides {a.strides}")


# -- device-resident data ------------------------------------------------------------------


def gather_batch(xd, yd, idx, xo, yo, scale) -> None:
    """``xo = xd[idx] * scale`` (float32; ``scale`` None: a plain copy) and ``yo = yd[idx]``.

    ``xd`` is (N, ...) uint8 or float32, ``yd`` (N,) int32, ``idx`` int64 rows.
    """
    if on_host(xd) or not takes(xo) or xd.dtype not in (numpy.uint8, numpy.float32):
        rows = xd[idx]
        if scale is not None:
            array_module(xd).multiply(rows, numpy.float32(scale), out=xo, casting="unsafe")
        else:
            xo[...] = rows
        yo[...] = yd[idx]
        return
    feat = xo.size // max(len(idx), 1)
    name = "gather_u8" if xd.dtype == numpy.uint8 else "gather_f32"
    launch_named(name, xo.size, xd, yd, idx, xo, yo, _i(xo.size), _i(feat),
                 numpy.float32(scale if scale is not None else 1.0))
