"""An elementwise op: its arithmetic written once, its NumPy, compiled-CPU and GPU forms derived from it.

``Elementwise(name, definition, outputs)`` traces the definition (a Python
function of one element of each array, ``towers.ops.codegen.expr``) once, when it is
made, and derives:

* the array form (``towers.ops.codegen.numpy_form``): one in-place NumPy pass per
  operation over the whole arrays; CuPy runs the same passes for device
  arrays the kernel does not take (not float32, or too large);
* the compiled CPU form (``towers.ops.codegen.numba_form``): one loop whose body is the
  definition, compiled by numba on first use (``towers.ops.numba_jit``);
* the GPU form (``towers.ops.codegen.cuda_form``): one CUDA kernel, registered into the
  one CUDA module (``towers.devices.kernels``) when the op is made at import
  (``module=True``: the layers' ops), or compiled on its own (an optimizer's
  update, made when the optimizer is; an op made after the module's first
  compile).

Every form performs the definition's operations in its order, each rounded to
the arrays' dtype, so they give the same bits on the same inputs
(``tests/ops/test_elementwise.py``; the kernel's statements run on the CPU in
``tests/ops/test_cuda_emitter.py``, compiled by NVRTC in
``tests/devices/test_kernels_compile.py``, on a GPU in ``tests/gpu/``).

``op(*args)`` takes the definition's arguments in its order (arrays and
scalars), then the output-only arrays, and writes the outputs in place.  It
picks the form from the arrays: device arrays take the kernel, host arrays the
compiled loop when the current forms take it (``towers.ops.forms``) and the
arrays are C-contiguous, else the passes.  Scalars are cast to the arrays'
dtype.  Before a kernel or a compiled loop runs, the arrays' sizes are checked
(every full array the outputs' size, a row operand a row long) and a mismatch
is a ``ValueError``, as NumPy's broadcasting gives the passes.  A launch goes
on the current stream; nothing synchronizes.
"""
from __future__ import annotations

import inspect
import keyword
import threading

import numpy

from towers.arrays import array_module, on_host
from towers.devices import kernels as device
from towers.ops.forms import current as current_forms
from towers.ops.codegen.cuda_form import CudaKernel
from towers.ops.codegen.cuda_form import source as cuda_text
from towers.ops.codegen.numba_form import source as numba_text
from towers.ops.numba_jit import from_source, on_warm_up
from towers.ops.codegen.expr import trace
from towers.ops.codegen.numpy_form import NumpyForm

_i = numpy.int32
_MADE: list = []  # every op made in this process (the compile test compiles each one's kernel)
# Names the generated sources use for themselves.
_RESERVED = {"n", "i", "cols", "xp", "S", "B", "dt", "numpy", "float", "int", "bool", "const", "np_max", "sqrtf",
             "range", "prange"}
# C++ keywords (CUDA C is C++) that are not Python's: an argument so named would compile only on a GPU.
_CPP = set("""alignas alignof asm auto char char16_t char32_t class constexpr const_cast decltype default delete do
double dynamic_cast enum explicit export extern friend goto inline long mutable namespace new noexcept nullptr
operator private protected public register reinterpret_cast short signed sizeof static static_assert static_cast
struct switch template this thread_local throw typedef typeid typename union unsigned using virtual void volatile
wchar_t restrict""".split())
_LOCK = threading.Lock()  # first uses from several tower threads make one compiled loop and one kernel


def made() -> list:
    """Every ``Elementwise`` made in this process so far."""
    return list(_MADE)


class Elementwise:
    """One op and its three forms (module doc).

    ``outputs``: the arrays it writes, in order: a definition argument (in
    place) or a new name (an output-only array, given after the arguments).
    ``scalars``: the arguments that are one value per call; ``rows``: array
    arguments holding one value per column of the (rows, cols) outputs.
    ``params``: the definition's argument names, when it takes ``**kwargs``
    (default: its signature).  ``compiled``: whether host arrays may take the
    compiled loop (False where NumPy's single pass is as fast).
    ``module``: register the kernel into the one CUDA module (an op made at
    import; one made after the module's first compile is compiled on its own
    instead); else it is compiled on its own.  ``distinct``: the caller never
    passes one memory as two of the arrays (an optimizer's own buffers), so the
    kernel declares them ``__restrict__``.
    """

    def __init__(self, name: str, definition, outputs: tuple, scalars: tuple = (), rows: tuple = (),
                 params: tuple | None = None, compiled: bool = True, module: bool = True, distinct: bool = False):
        params = tuple(params if params is not None else inspect.signature(definition).parameters)
        for p in (*params, *outputs):
            if not p.isidentifier() or keyword.iskeyword(p) or p in _RESERVED or p in _CPP or p[0] == "_" or p.endswith("_") or (
                    p[0] == "t" and p[1:].isdigit()) or (p[0] == "c" and p[1:].isdigit()):
                raise ValueError(f"{name}: {p!r} cannot name an argument of a generated kernel")
        arrays = tuple(p for p in params if p not in scalars)
        self.name = name
        self.traced = trace(definition, arrays, tuple(scalars), tuple(rows), tuple(outputs))
        self.params = params + tuple(o for o in outputs if o not in params)  # the call order
        self._scalar_at = [i for i, p in enumerate(self.params) if p in scalars]
        self._array_at = [i for i, p in enumerate(self.params) if p not in scalars]
        self._is_array = [p not in scalars for p in self.params]
        self._full_at = [i for i in self._array_at if self.params[i] not in rows]
        self._lead = self.params.index(outputs[0])
        self._rows = bool(rows)
        self.numpy_form = NumpyForm(self.traced, self.params, name)
        self.numba_source = numba_text(self.traced, self.params, "towers_" + name)
        self._loop = None
        self.compiled = compiled
        if compiled:
            on_warm_up(lambda: self.loop().warm())
        self.cuda_source = cuda_text(self.traced, self.params, "towers_" + name, restrict=distinct)
        self.in_module = module and device.open_for_parts()
        self._kernel = None
        if self.in_module:
            device.register(self.cuda_source + "\n", (name,))
        _MADE.append(self)

    # -- the forms

    def loop(self):
        """The compiled CPU form (a ``numba_jit.NumbaKernel``; its source written and imported on the first call)."""
        if self._loop is None:
            with _LOCK:
                if self._loop is None:
                    self._loop = from_source(self.numba_source, "towers_" + self.name, self._warm_args)
        return self._loop

    def kernel(self):
        """The GPU form compiled on its own (``cuda_form.CudaKernel``), for an op outside the one module."""
        if self._kernel is None:
            with _LOCK:
                if self._kernel is None:
                    self._kernel = CudaKernel(self.cuda_source, "towers_" + self.name)
        return self._kernel

    def _warm_args(self) -> tuple:
        f = numpy.float32
        args = [f(0.5) if i in self._scalar_at else numpy.zeros(2, f) for i in range(len(self.params))]
        return tuple(args) + ((_i(2),) if self._rows else ())

    def warm_up(self) -> None:
        """Load (or compile) the compiled CPU form now, where the current forms take it: not inside a timed step."""
        if self.compiled and current_forms().compiled:
            self.loop().warm()

    # -- a call

    def __call__(self, *args) -> None:
        lead = args[self._lead]
        dt = lead.dtype.type
        if self._scalar_at:
            args = list(args)
            for i in self._scalar_at:
                args[i] = dt(args[i])
        if on_host(lead):
            if self.compiled and current_forms().compiled and self._flat(args, lead):
                cols = self._cols(args)
                self._check(args, lead, cols)
                self.loop()(*self._flatten(args), *cols)
                return
            self.numpy_form(numpy, args, [args[i] for i in self._array_at], lead)
            return
        arrays = [args[i] for i in self._array_at]
        if device.takes(*arrays) and all(a.flags.c_contiguous for a in arrays):
            n = lead.size
            cols = self._cols(args)
            self._check(args, lead, cols)
            extra = (_i(n),) + cols
            if self.in_module:
                device.launch_named(self.name, n, *args, *extra)
            else:
                self.kernel()(n, *args, *extra)
            return
        self.numpy_form(array_module(lead), args, arrays, lead)

    def _flat(self, args, lead) -> bool:
        n = lead.size
        return all(args[i].flags.c_contiguous and args[i].size == n for i in self._full_at) and all(
            args[i].flags.c_contiguous for i in self._array_at)

    def _check(self, args, lead, cols) -> None:
        """A ``ValueError`` unless every full array has the outputs' size and a row operand is a row long: the
        kernel and the loop index them by the outputs' element, unchecked."""
        n = lead.size
        if any(args[i].size != n for i in self._full_at) or (cols and (lead.shape[-1:] != (int(cols[0]),) or any(
                args[i].size != int(cols[0]) for i in self._array_at if i not in self._full_at))):
            shapes = ", ".join(f"{self.params[i]} {tuple(args[i].shape)}" for i in self._array_at)
            raise ValueError(f"{self.name}: the arrays' sizes do not match ({shapes})")

    def _flatten(self, args):
        return [a.reshape(-1) if array else a for a, array in zip(args, self._is_array)]

    def _cols(self, args) -> tuple:
        """(cols,) for an op with row operands: the length of a row (the row operands' size)."""
        if not self._rows:
            return ()
        row = next(args[i] for i in self._array_at if i not in self._full_at)
        return (_i(row.size),)
