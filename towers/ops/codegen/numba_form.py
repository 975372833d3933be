"""An elementwise op's compiled CPU form: one loop over the elements, its body the definition, for numba.

From the traced definition (``towers.ops.codegen.expr``) this module writes the Python
source of a function that loops over flat C-contiguous arrays: each iteration
reads element ``i`` of every array it uses (a row operand: element ``i %
cols``), computes every operation of the definition in its order, one local
each, and then stores the outputs (so an output sharing an input's memory is
read before it is written).  numba compiles it (``towers.ops.numba_jit``):
one pass over memory instead of one per operation, with the same roundings:

* constants are made of the arrays' dtype (``x.dtype.type(1.0)``) before the
  loop: an int or float64 constant would make numba compute a float32
  expression in float64 (it promotes int x float32 to float64);
* the scalars are given in the arrays' dtype (``towers.ops.codegen.elementwise`` casts
  them), for the same reason;
* numba does not contract ``a * b + c`` into a fused multiply-add (no
  ``fastmath``), and divides by zero as NumPy does (``error_model="numpy"``);
* ``maximum(a, b)`` is ``a if (a > b or a != a) else b``, NumPy's ``maximum``
  (NaN wins, ``b`` on ties: ``maximum(-0.0, 0)`` is +0).
"""
from __future__ import annotations

from towers.ops.codegen.expr import Traced, render

# maximum as NumPy's: NaN wins, else the larger (the first on ties)
_SPELLING = {"sqrt": "numpy.sqrt({0})", "max": "{0} if ({0} > {1} or {0} != {0}) else {1}",
             "where": "{1} if {0} else {2}"}


def source(traced: Traced, params: tuple, name: str) -> str:
    """The loop's source: ``def <name>(*params[, cols])``, ``params`` the op's arrays and scalars in call order."""
    lead = next(iter(traced.outputs))
    number = {n.id: k for k, n in enumerate(traced.nodes)}  # locals numbered per op: the same source every process

    def ref(a) -> str:  # an operand: a scalar argument by its name, an array's element by its local
        if a.op == "arg":
            return a.value if a.value in traced.scalars else f"{a.value}_"
        return f"t{number[a.id]}"

    def expr(n) -> str:
        return render(n, ref, _SPELLING, lambda v: f"{lead}.dtype.type({v!r})")

    lines = [f"def {name}({', '.join(params)}{', cols' if traced.rows else ''}):"]
    for n in traced.nodes:  # constants and values of scalars alone: once, before the loop
        if traced.scalar_only(n) and n.op != "arg":
            lines.append(f"    {ref(n)} = {expr(n)}")
    lines.append(f"    for i in range({lead}.size):")
    for n in traced.nodes:
        if traced.scalar_only(n):
            continue
        if n.op == "arg":
            lines.append(f"        {ref(n)} = {n.value}[{'i % cols' if n.value in traced.rows else 'i'}]")
        else:
            lines.append(f"        {ref(n)} = {expr(n)}")
    for out, node in traced.outputs.items():
        lines.append(f"        {out}[i] = {ref(node)}")
    return "\n".join(lines) + "\n"
