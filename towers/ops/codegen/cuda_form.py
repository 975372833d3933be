"""An elementwise op's GPU form: the CUDA C text of one kernel, its body the definition, one thread an element.

From the traced definition (``towers.ops.codegen.expr``) this module writes a
``__global__`` function: a grid-stride loop over ``n`` elements whose body
reads element ``i`` of every array it uses (a row operand: element ``i %
cols``) into a local named as the array, computes every operation of the
definition in its order, one ``const`` local each, and stores the outputs
last.  An op of a layer is registered into the one CUDA module of
``towers.devices.kernels``; an optimizer's update (one kernel per variant,
made when the optimizer is) is compiled on its own by ``CudaKernel``.

Exactness, so that the kernel gives the CPU forms' bits on the same inputs:

* every product is ``__fmul_rn(a, b)``: NVRTC never contracts it with a
  following add into a fused multiply-add (it would by default:
  ``--fmad=true``), so each product and sum rounds on its own, as NumPy's
  passes do; ``CudaKernel`` also compiles with ``--fmad=false``
  (``OPTIONS``), and ``tests/devices/test_kernels_compile.py`` checks the machine
  code of every generated kernel for ``fma.``;
* ``/`` and ``sqrtf`` are IEEE-rounded (NVRTC's defaults ``-prec-div`` and
  ``-prec-sqrt``; no ``--use_fast_math``);
* constants are float literals of the float32 value (``1.0f``);
* ``maximum`` is the module's ``np_max`` (NaN wins; ``a`` on ties, so the sign
  of a zero may differ from NumPy's, which gives ``b``).

Limits: float32 arrays (``towers.devices.kernels.takes``), C-contiguous, at
most ``MAX_ELEMENTS`` elements (32-bit indices).
"""
from __future__ import annotations

import numpy

from towers.ops.codegen.expr import Traced, render

# Products never contract into a fused multiply-add (module doc); np_max is NumPy's maximum.
_SPELLING = {"mul": "__fmul_rn({0}, {1})", "sqrt": "sqrtf({0})", "max": "np_max({0}, {1})",
             "where": "{0} ? {1} : {2}"}

#: NVRTC options of a kernel compiled on its own (see the module doc).
OPTIONS = ("--fmad=false",)


def literal(value: float) -> str:
    """A float32 constant as a C float literal that parses back to the same float32."""
    v = float(numpy.float32(value))
    if not numpy.isfinite(v):
        raise ValueError(f"a kernel constant must be finite, got {value!r}")
    text = repr(v)
    return (text if any(c in text for c in ".e") else text + ".0") + "f"


def source(traced: Traced, params: tuple, name: str, restrict: bool = False) -> str:
    """``__global__ void <name>(...)``: ``params`` (the op's arrays and scalars in call order), ``int n`` and,
    with a row operand, ``int cols``.  ``restrict``: the arrays are declared ``__restrict__`` (distinct
    buffers: an optimizer's)."""
    outs = traced.outputs
    number = {n.id: k for k, n in enumerate(traced.nodes)}  # locals numbered per op: the same text in every process
    r = " __restrict__" if restrict else ""

    def ref(a) -> str:
        return a.value if a.op == "arg" else f"t{number[a.id]}"

    def expr(n) -> str:
        return render(n, ref, _SPELLING, literal)

    decl = []
    for p in params:
        if p in traced.scalars:
            decl.append(f"float {p}")
        else:
            decl.append(f"{'' if p in outs else 'const '}float*{r} {p}_")
    decl.append("int n")
    if traced.rows:
        decl.append("int cols")
    lines = [f"__global__ void {name}({', '.join(decl)}) {{",
             "    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {"]
    for n in traced.nodes:
        if n.op == "arg":
            if n.value not in traced.scalars:
                lines.append(f"        const float {n.value} = {n.value}_[{'i % cols' if n.value in traced.rows else 'i'}];")
        else:
            lines.append(f"        const {'bool' if n.is_bool else 'float'} {ref(n)} = {expr(n)};")
    for out, node in outs.items():
        lines.append(f"        {out}_[i] = {ref(node)};")
    lines += ["    }", "}", ""]
    return "\n".join(lines)


class CudaKernel:
    """A generated kernel compiled on its own (``OPTIONS``), launched over the op's arrays
    (``towers.devices.kernels.launch``).  CuPy compiles it on its first launch and caches the binary on disk
    (``CUPY_CACHE_DIR``), so later runs skip NVRTC."""

    def __init__(self, text: str, name: str):
        from towers.devices.kernels import NP_MAX

        self.name = name
        self.source = NP_MAX + 'extern "C" ' + text
        self._raw = None

    @property
    def raw(self):
        if self._raw is None:
            import cupy

            self._raw = cupy.RawKernel(self.source, self.name, options=OPTIONS)
        return self._raw

    def __call__(self, n: int, *args) -> None:
        from towers.devices.kernels import launch

        launch(self.raw, n, *args)
