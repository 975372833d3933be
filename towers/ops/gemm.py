"""Matrix products: ``gemm``, ``out = op(a) @ op(b)``, on NumPy (``matmul``) or one cuBLAS call (CuPy).

``sgemm`` is every device GEMM of the ops (``gemm``, ``towers.ops.bias``):
``towers.devices.matmul.sgemm`` through the cuBLAS binding of the current
forms (``towers.ops.forms``: CuPy's, or nvmath-python's under CUDA graphs).
"""
from __future__ import annotations

import numpy

from towers.arrays import array_module, on_host
from towers.devices import matmul
from towers.ops.forms import current as current_forms


def sgemm(a, b, out, trans_a: bool, trans_b: bool, m: int, n: int, k: int) -> bool:
    """``out = op(a) (m, k) @ op(b) (k, n)`` on device arrays by one cuBLAS call through the current forms'
    binding (``towers.devices.matmul.sgemm``); False (nothing done) when it can't."""
    return matmul.sgemm(a, b, out, trans_a, trans_b, m, n, k, current_forms().gemm)


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
