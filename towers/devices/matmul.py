"""Float32 matrix products on a GPU: one cuBLAS GEMM as ``cupy.matmul`` would call it, and their precision.

``sgemm`` is the layers' device GEMM (``towers.ops.gemm``, ``bias_grad``,
``col_sum``): ONE ``cublasGemmEx`` call on the current stream, with the compute
type and algorithm ``cupy.matmul`` picks, without its Python-level dispatch.
It goes through CuPy's cuBLAS binding and handles (``binding`` ``"cupy"``),
or, where a run's forms chose it for CUDA graphs (``binding`` ``"nvmath"``:
``towers.ops.forms``, whose current value the ops hand in), through
nvmath-python's binding (``nvmath.bindings.cublas``; CuPy's refuses
every call while a stream captures) with handles of our own: one per device,
stream and thread (as cuDNN's, ``towers.devices.cudnn``: GEMMs on two streams
never share a workspace), each bound to its stream once and given a 32 MiB
workspace of its own after that (``cublasSetStream`` would put the default
workspace pool back), so that nothing is allocated inside a capture, as
cuBLAS's notes on CUDA graphs advise.  A handle is made by the first GEMM on
its stream, which must not run inside a capture (an eager warm-up step comes
first), and destroyed by ``release_streams`` (a ``Trainer``'s ``close``).
Both bindings call the same cuBLAS with the same arguments.
``set_tf32`` switches that compute type, CuPy's process-wide setting, between
plain float32 and TF32 tensor cores (``tf32``); ``sgemm`` follows it, as
``cupy.matmul`` does.  CuPy is imported on the first GPU call only.
"""
from __future__ import annotations

import threading

import numpy

INT_MAX = 2**31 - 1  # cuBLAS's sizes and leading dimensions are ints
_CUBLAS: dict = {}  # what a device GEMM needs, found on the first one (CuPy imported lazily)
_ONE = numpy.ones(1, dtype=numpy.float32)  # alpha and beta, read by cuBLAS from host memory
_ZERO = numpy.zeros(1, dtype=numpy.float32)  # (CuPy's handles keep the host pointer mode)
_NV_HANDLES: dict = {}  # (device, stream pointer, thread) -> _NvHandle
_NV_WORKSPACE = 32 << 20  # bytes: cuBLAS's recommendation for Hopper


def sgemm(a, b, out, trans_a: bool, trans_b: bool, m: int, n: int, k: int, binding: str = "cupy") -> bool:
    """``out = op(a) (m, k) @ op(b) (k, n)`` by cuBLAS through ``binding``'s handles (``"cupy"`` or
    ``"nvmath"``: module doc); False (nothing done) when it can't.

    cuBLAS is column-major: a row-major (r, c) array is the column-major
    (c, r) matrix with leading dimension c, so the row-major ``out = A B`` is
    computed as the column-major ``out^T = B^T A^T``: operands swapped, each
    transposed exactly when asked.  A 1-D operand is a one-row matrix.
    """
    if not (a.dtype == b.dtype == out.dtype == numpy.float32 and m and n and k
            and a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous
            and max(a.size, b.size, out.size) <= INT_MAX):
        return False
    c = _CUBLAS or _cublas()
    compute = c["compute"].get(c["compute_type"](numpy.float32))
    if compute is None:  # a compute type set elsewhere (FP16, BF16...): cupy.matmul knows them all
        return False
    if binding == "nvmath":
        h = _nv_handle()
        gemm_ex, handle, algo = h.gemm_ex, h.handle, h.algo
    else:
        gemm_ex, handle = c["gemmEx"], c["handle"]()  # per device and thread; gemmEx sets its stream
        algo = c["algos"].get(handle)
        if algo is None:
            algo = c["algos"][handle] = c["algo"]()
    r32, ops = c["r32"], c["ops"]
    gemm_ex(handle, ops[trans_b], ops[trans_a], n, m, k, c["one"],
            b.data.ptr, r32, b.shape[-1], a.data.ptr, r32, a.shape[-1],
            c["zero"], out.data.ptr, r32, n, compute, algo)
    return True


class _NvHandle:
    """A cuBLAS handle of nvmath-python's binding bound to one stream, and its workspace (module doc)."""

    def __init__(self, stream_ptr: int):
        import cupy
        from nvmath.bindings import cublas  # noqa: PLC0415 - optional, GPU only (cuda_graphs)

        self.cublas, self.gemm_ex = cublas, cublas.gemm_ex
        self.handle = cublas.create()
        cublas.set_stream(self.handle, stream_ptr)
        self.workspace = cupy.empty(_NV_WORKSPACE, dtype=numpy.uint8)  # kept: a captured graph holds its address
        cublas.set_workspace(self.handle, self.workspace.data.ptr, self.workspace.nbytes)
        self.algo = (_CUBLAS or _cublas())["algo"]()


def _nv_handle() -> _NvHandle:
    import cupy

    stream = cupy.cuda.get_current_stream()
    key = (cupy.cuda.Device().id, stream.ptr, threading.get_ident())
    h = _NV_HANDLES.get(key)
    if h is None:
        if stream.ptr and stream.is_capturing():
            raise RuntimeError("no cuBLAS handle for this stream yet: its first GEMM runs inside a CUDA graph "
                               "capture (a handle is made in an eager step first)")
        h = _NV_HANDLES[key] = _NvHandle(key[1])
    return h


def release_streams(stream_ptrs) -> None:
    """Destroy the nvmath cuBLAS handles bound to these streams, with their workspaces (their work finished)."""
    ptrs = set(stream_ptrs)
    for key in [k for k in _NV_HANDLES if k[1] in ptrs]:
        h = _NV_HANDLES.pop(key)
        h.cublas.destroy(h.handle)


def nvmath_available() -> str | None:
    """None when nvmath-python's cuBLAS binding imports and makes a handle on the current device (destroyed again:
    the towers' GEMMs make their own, per stream); else why not."""
    try:
        from nvmath.bindings import cublas  # noqa: PLC0415 - optional, GPU only (cuda_graphs)

        cublas.destroy(cublas.create())
    except Exception as e:  # ImportError, or a cuBLAS library that does not load
        return (f"nvmath-python's cuBLAS binding does not start ({type(e).__name__}: {e}); "
                "pip install nvmath-python (with cuda-bindings of the driver's CUDA major version)")
    return None


def _cublas() -> dict:
    """The cuBLAS bindings, constants and CuPy settings ``_sgemm`` uses, as ``cupy.matmul`` picks them."""
    import cupy
    from cupy._core import _routines_linalg as linalg
    from cupy_backends.cuda.api import runtime
    from cupy_backends.cuda.libs import cublas

    def algo():  # cupy.matmul's choice (tensordot_core_v11)
        cc = int(cupy.cuda.Device().compute_capability)
        return cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP if cc >= 80 else cublas.CUBLAS_GEMM_DEFAULT

    _CUBLAS.update(
        gemmEx=cublas.gemmEx, handle=cupy.cuda.device.get_cublas_handle, algos={}, algo=algo,
        r32=runtime.CUDA_R_32F, ops={False: cublas.CUBLAS_OP_N, True: cublas.CUBLAS_OP_T},
        one=_ONE.ctypes.data, zero=_ZERO.ctypes.data, compute_type=linalg.get_compute_type,
        compute={linalg.COMPUTE_TYPE_DEFAULT: cublas.CUBLAS_COMPUTE_32F,
                 linalg.COMPUTE_TYPE_TF32: cublas.CUBLAS_COMPUTE_32F_FAST_TF32,
                 linalg.COMPUTE_TYPE_PEDANTIC: cublas.CUBLAS_COMPUTE_32F_PEDANTIC},
    )
    return _CUBLAS


# -- matmul precision --------------------------------------------------------------------------


def set_tf32(on: bool):
    """Float32 matmuls of CuPy on TF32 tensor cores (``on``) or in plain float32.

    Returns the previous setting, for ``restore_compute_type``.  The setting is
    CuPy's, process-wide (every device and thread); TF32 keeps float32 range
    with a 10-bit mantissa in the products (about 3e-4 relative error per GEMM).
    """
    from cupy._core import _routines_linalg as linalg

    previous = linalg.get_compute_type(numpy.float32)
    linalg.set_compute_type(numpy.float32, linalg.COMPUTE_TYPE_TF32 if on else linalg.COMPUTE_TYPE_DEFAULT)
    return previous


def restore_compute_type(previous) -> None:
    """Put back the setting ``set_tf32`` returned."""
    from cupy._core import _routines_linalg as linalg

    linalg.set_compute_type(numpy.float32, previous)
