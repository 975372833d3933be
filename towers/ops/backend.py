"""Which form of the ops runs: on host arrays NumPy's passes or numba's compiled loops, and on device arrays
how a convolution runs (im2col or cuDNN) and through which binding cuBLAS runs: one choice per thread.

Every op has a form per backend (``towers.ops``); device (CuPy) arrays take
the GPU form, so an op tells its form from the arrays it gets and, for host
arrays, from this module's choice.  A convolution on device arrays has two
GPU forms, im2col + cuBLAS or cuDNN (``gpu_conv``, ``GPU_CONVS``), chosen
here too, as is the binding of the GPU GEMMs (``gemm_binding``: CuPy's, or
nvmath-python's for ``cuda_graphs``, whose captures CuPy's refuses).  The choice is made once, when a
``Trainer`` builds its towers (``towers.step.tower.build_towers`` calls
``choose`` with the ``cpu_kernels`` setting, the model and whether any tower
is on the CPU), and holds for the thread that made it until its next
``choose``; the ops, the optimizers and the reducers read it (``compiled``),
no flag is handed through their calls.  ``using`` sets it for a block (tests,
tools, a ``Replica`` made by hand, which otherwise runs whatever its thread
last chose, or, in a thread that chose nothing, whatever the process last
chose: NumPy's passes in a process that built no ``Trainer``).

Settings (``MODES``): ``"auto"`` gives the compiled loops when numba imports
and the model is ``worth_loading`` them, ``"numba"`` requires numba,
``"numpy"`` never loads it.  A numba that is missing or fails to import (a
release that does not support this NumPy) leaves NumPy in charge under
``auto``, with a notice when it is installed but broken.

The compiled loops give NumPy's bits, but for batch norm's statistics (float64
sums) and a convolution's input gradient by col2im (another order of sums):
a model with such layers depends on the choice (``rounds_otherwise``), and a
checkpoint records which form ran (``towers.output.checkpoint``).

One choice per thread: the choice of the CPU forms and of cuDNN is a
context variable (``contextvars``), so two ``Trainer`` objects fitting in two
threads of one process each run their own; a ``Trainer``'s executor records
its choice and makes it its thread's again at each step (another ``Trainer``
may have chosen since in the same thread), in training, evaluation and
prediction, and its tower threads run in a copy of the calling thread's
context (``towers.devices.cpu_threads``, the bucket thread of
``towers.parallel.overlap``).  The GEMM binding stays one per process
(``towers.devices.matmul``).
"""
from __future__ import annotations

import contextlib
import contextvars

from towers.devices import matmul
from towers.errors import UserError, notice
from towers.ops.numba_jit import numba_module, warm_up

MODES = ("auto", "numba", "numpy")
#: The values of ``gpu_conv``: ``cudnn`` requires the cuDNN frontend, ``auto`` takes it where it starts.
GPU_CONVS = ("im2col", "cudnn", "auto")

#: ``auto`` loads the compiled loops for models of this many parameters or more: the update, L2 and all-reduce
#: passes they fuse grow with the model (the MLP 784-500-10, 0.4 M: 0.4-0.5 ms of a 3.4 ms step saved; the
#: default digits MLP, 37.5 k: about 0.12 ms, so numba's start, 0.75 s, costs its 2,000-step run more than it saves).
WORTH_PARAMS = 100_000

# The choice, (whether host arrays take the compiled loops, whether device convolutions run on cuDNN
# (towers.devices.cudnn)): the thread's own (None: it made none), else the last one made in the process.
_CHOICE: contextvars.ContextVar = contextvars.ContextVar("towers_ops_forms", default=None)
_LAST = [(False, False)]


def _choice() -> tuple:
    return _CHOICE.get() or _LAST[0]


def _set(compiled_loops: bool, cudnn: bool) -> None:
    _LAST[0] = choice = (bool(compiled_loops), bool(cudnn))
    _CHOICE.set(choice)


def compiled() -> bool:
    """Whether ops on host arrays run their compiled (numba) form."""
    return _choice()[0]


def cudnn_conv() -> bool:
    """Whether convolutions on device arrays run on cuDNN (else im2col and cuBLAS)."""
    return _choice()[1]


def gemm_binding() -> str:
    """Whose cuBLAS binding the device GEMMs call: ``"cupy"``, or ``"nvmath"`` (nvmath-python's, which a CUDA graph
    capture accepts: ``towers.devices.matmul``, which holds this part of the choice)."""
    return matmul.binding()


def name() -> str:
    """The choice as a checkpoint records it: ``"numba"`` or ``"numpy"``."""
    return "numba" if compiled() else "numpy"


def worth_loading(model) -> bool:
    """Whether ``auto`` loads numba for ``model`` (built): ``WORTH_PARAMS`` or more parameters, or results
    that depend on the compiled loops (``rounds_otherwise``: a model's results never depend on its size)."""
    return model.size >= WORTH_PARAMS or rounds_otherwise(model)


def rounds_otherwise(model) -> bool:
    """Whether the compiled loops change ``model``'s (built) results: a layer's ``compiled_rounding``, where
    layers after the first with trainable parameters take their input gradient (``Replica._backward``)."""
    first = min((li for li, _, prm in model.params if prm.trainable), default=0)
    return any(layer.compiled_rounding(input_grad=i > first) for i, layer in enumerate(model.layers))


def available(mode: str) -> bool:
    """Whether ``mode`` can have the compiled loops: numba imports (``"numpy"``: never).

    ``"numba"`` without numba is a ``UserError``; ``"auto"`` with a broken
    numba, a notice.  Imports numba (about 0.25 s) on the first call.
    """
    if mode not in MODES:
        raise UserError(f"`cpu_kernels` {mode!r} is unknown: use one of {', '.join(MODES)}")
    if mode == "numpy":
        return False
    try:
        numba_module()
        return True
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name == "numba"
        why = "numba is not installed" if missing else f"numba does not import ({e})"
        if mode == "numba":
            raise UserError(f"`cpu_kernels` numba: {why}; install a numba that supports NumPy "
                            f"{_numpy_version()} (pip install -U numba) or set `cpu_kernels` to auto or numpy") from None
        if not missing:
            notice(f"CPU kernels: {why}; NumPy's array operations run instead")
        return False


def choose(mode: str, model, cpu_towers: bool, gpu_conv: str = "im2col", gpu=None, cuda_graphs: bool = False) -> str:
    """Make the thread's choice for a run (module doc) and return it as ``name`` does.

    With the compiled loops, every kernel is loaded from numba's disk cache
    (or compiled: about a second a kernel, once per machine) now, not in the
    first step.  ``gpu``: a GPU device of the run (None: no GPU towers), on
    which ``gpu_conv`` ``cudnn`` or ``auto`` starts cuDNN now, for a model
    with convolutions (others never import it): ``cudnn`` without it is a
    ``UserError``, ``auto`` then runs im2col; and where ``cuda_graphs`` asks
    for graphs of GPU towers, every device GEMM goes through nvmath-python's
    cuBLAS binding (its absence a ``UserError``), in the steps captured and
    in the eager ones alike, so both run the same GEMMs.
    """
    if mode not in MODES:
        raise UserError(f"`cpu_kernels` {mode!r} is unknown: use one of {', '.join(MODES)}")
    if gpu_conv not in GPU_CONVS:
        raise UserError(f"`gpu_conv` {gpu_conv!r} is unknown: use one of {', '.join(GPU_CONVS)}")
    on = cpu_towers and (mode != "auto" or worth_loading(model)) and available(mode)
    use(on)
    if on:
        warm_up()
    convolves = any(layer.convolves() for layer in model.layers)
    _set(on, gpu is not None and gpu_conv != "im2col" and convolves and _cudnn_starts(gpu_conv, gpu))
    matmul.use_binding("nvmath" if gpu is not None and cuda_graphs and _nvmath_starts(gpu) else "cupy")
    return name()


def _nvmath_starts(gpu) -> bool:
    with gpu.scope():
        why = matmul.nvmath_available()
    if why is not None:
        raise UserError(f"`cuda_graphs`: {why}; or drop `cuda_graphs`")
    return True


def _cudnn_starts(gpu_conv: str, gpu) -> bool:
    from towers.devices import cudnn

    with gpu.scope():
        why = cudnn.available()
    if why is not None and gpu_conv == "cudnn":
        raise UserError(f"`gpu_conv` cudnn: {why}; or set `gpu_conv` to auto or im2col")
    return why is None


def current() -> tuple:
    """The whole choice, for ``restore``."""
    return (*_choice(), matmul.binding())


def restore(choice: tuple) -> None:
    """Make ``choice`` (from ``current``) the thread's again."""
    _set(*choice[:2])
    matmul.use_binding(choice[2])


def use(on: bool) -> None:
    """Set the thread's choice: the compiled loops (``on``) or NumPy's passes."""
    _set(on, cudnn_conv())


@contextlib.contextmanager
def using(mode: str):
    """The choice for ``mode`` (``"numba"`` requires numba; ``"auto"``: numba where it imports) inside the
    block, the previous one after it."""
    before = compiled()
    use(available(mode))
    try:
        yield
    finally:
        use(before)


def _numpy_version() -> str:
    import numpy

    return numpy.__version__
