"""The mean of two towers' buffers on one device, written to both: ``a = b = (a + b) * s``, written once.

The all-reduce of two towers sharing a device (``towers.parallel.reducers``):
NumPy's add, scale and copy (three passes), one compiled pass where the
current forms take it (``towers.ops.forms``), or one kernel: the same bits.
"""
from __future__ import annotations

from towers.ops.codegen.elementwise import Elementwise


def _mean2(a, b, s):
    v = (a + b) * s
    return {"a": v, "b": v}


mean2 = Elementwise("mean2", _mean2, ("a", "b"), scalars=("s",))  # mean2(a, b, s)
