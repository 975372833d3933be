"""ReLU: forward, backward, and a residual block's ``relu(h + s)``, each written once (``towers.ops.codegen.elementwise``).

===================  =========================================  ===================================
op                   definition                                 forms
===================  =========================================  ===================================
``relu``             ``maximum(x, 0)``                          NumPy pass against zeros; 1 kernel
``relu_backward``    ``dy * where(y > 0, 1, 0)``                mask + multiply, or 1 compiled pass;
                                                                1 kernel
``add_relu``         ``maximum(h + s, 0)``                      add + maximum, or 1 compiled pass;
                                                                1 kernel
===================  =========================================  ===================================

``maximum`` is NumPy's (NaN passes; +0 for -0.0 on the CPU; the GPU's
``np_max`` keeps -0.0: the sign of a zero may differ between devices).
``relu_backward`` multiplies by 1.0 or 0.0, so signs and NaN follow the
multiply.  ``relu`` keeps NumPy's one pass on the CPU (its SIMD loop is as fast
as a compiled one); the others take the compiled loop where the current forms
take it (``towers.ops.forms``).
"""
from __future__ import annotations

from towers.ops.codegen.elementwise import Elementwise
from towers.ops.codegen.expr import maximum, where


def _relu(x):
    return maximum(x, 0)


relu = Elementwise("relu", _relu, ("y",), compiled=False)  # relu(x, y): y = maximum(x, 0)
relu_backward = Elementwise("relu_backward", lambda y, dy: dy * where(y > 0, 1, 0), ("dy",))  # dy *= (y > 0)
add_relu = Elementwise("add_relu", lambda h, s: _relu(h + s), ("y",))  # add_relu(h, s, y): y = relu(h + s)
