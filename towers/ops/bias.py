"""The bias of a dense or convolution layer: ``y += b`` per row (written once), and its gradient, a column sum.

``bias_add(y, b)``: ``y (rows, cols) += b (cols,)``, an ``Elementwise`` op with
``b`` a row operand: NumPy's one broadcast pass on the CPU (as fast as a
compiled loop), one kernel on a GPU.

``bias_grad(dy, out, ws)`` and ``col_sum(x2, out, ws)``: ``out = x.sum(axis=0)``,
a reduction whose forms differ: NumPy's ``sum`` (``bias_grad`` on the CPU,
the bits the models have always had) or ``ones @ x`` through BLAS
(``col_sum``, and ``bias_grad`` on a GPU: cuBLAS, because CuPy's reduction
over the long axis of a tall, narrow array runs one block per column, 1.2 ms
for LeNet-5's first convolution at batch 100 against a few microseconds for
the product).
"""
from __future__ import annotations

import numpy

from towers.arrays import on_host
from towers.ops.codegen.elementwise import Elementwise
from towers.ops.gemm import sgemm

bias_add = Elementwise("bias_add", lambda y, b: y + b, ("y",), rows=("b",), compiled=False)


def _ones(ws, rows: int, dtype):
    ones = ws.array("ones", (rows,), dtype)
    if ws.saved.get("ones") is not ones:
        ones.fill(1)
        ws.saved["ones"] = ones
    return ones


def bias_grad(dy, out, ws) -> None:
    """``out (cols,) = dy (rows, cols).sum(axis=0)``: NumPy's ``sum`` on the CPU, ``ones @ dy`` on a GPU."""
    if on_host(dy):
        numpy.sum(dy, axis=0, out=out)
        return
    rows, cols = dy.shape
    ones = _ones(ws, rows, dy.dtype)
    # (1, rows) @ (rows, cols): the 1-D vectors are the 1-row matrices, no reshape.
    if not sgemm(ones, dy, out, False, False, 1, cols, rows):
        ws.xp.matmul(ones.reshape(1, -1), dy, out=out.reshape(1, -1))


def col_sum(x2, out, ws) -> None:
    """``out (cols,) = x2 (rows, cols).sum(axis=0)`` as ``ones(rows) @ x2``: one GEMV on either device.

    On the CPU the BLAS product is several times faster than NumPy's reduction
    over the long axis of a tall, narrow array (``bias_grad`` keeps NumPy's sum
    on the CPU: the existing models' bits depend on it).
    """
    rows = x2.shape[0]
    ones = _ones(ws, rows, x2.dtype)
    if on_host(x2):
        numpy.matmul(ones, x2, out=out)
    elif not sgemm(ones, x2, out, False, False, 1, x2.shape[1], rows):
        ws.xp.matmul(ones.reshape(1, -1), x2, out=out.reshape(1, -1))
