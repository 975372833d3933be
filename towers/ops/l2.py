"""L2's gradient, ``g += w * s`` (the product rounded first), written once (``towers.ops.codegen.elementwise``).

Two NumPy passes (a multiply into scratch, an add), or one compiled pass where
the current forms take it (``towers.ops.forms``), or one kernel
(``g + __fmul_rn(w, s)``: never a fused multiply-add): the same bits.
``towers.nn.replica`` adds it to the regularized weights' gradients.
"""
from __future__ import annotations

from towers.ops.codegen.elementwise import Elementwise

# add_scaled(g, w, s): g = g + w * s.
add_scaled = Elementwise("add_scaled", lambda g, w, s: g + w * s, ("g",), scalars=("s",))
