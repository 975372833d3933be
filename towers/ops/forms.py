"""Which form of the ops runs, as one value per tower: ``Forms``, current inside its ``active`` scope.

Every op has a form per backend (``towers.ops``); device (CuPy) arrays take
the GPU form, so an op tells its form from the arrays it gets and from the
current ``Forms``: on host arrays numba's compiled loops or NumPy's passes
(``compiled``), on device arrays a convolution on cuDNN or by im2col and
cuBLAS (``cudnn``; ``gpu_conv``, ``GPU_CONVS``: ``towers.ops.conv``
dispatches), and whose cuBLAS binding the device GEMMs call (``gemm``:
CuPy's, or nvmath-python's for ``cuda_graphs``, whose captures CuPy's
refuses; ``towers.ops.gemm`` hands it to ``towers.devices.matmul``).

A ``Forms`` is made once per run by ``choose`` (``towers.step.tower.choose_forms``
calls it from the ``cpu_kernels``, ``gpu_conv`` and ``cuda_graphs`` settings,
the model and whether any tower is on the CPU) and handed to every ``Tower``
(``build_towers``), whose ``scope`` makes it current, as it makes the tower's
device and stream current; so do the step engine's calls, the executor's
evaluation and a loaded run's (``towers.step.engine``, ``towers.run.local``,
``towers.inference.Predictor``, the parameter server of
``towers.cluster.ps``), for what they run outside a tower (the reducers,
weights mode's average and EMA, evaluation).  ``current`` is the one reader: the ops, the optimizers
and the reducers ask it, no flag is handed through their calls.  Outside any
scope the forms are ``NUMPY``: NumPy's passes, im2col, CuPy's binding.  The
current forms are a context variable (``contextvars``): a thread starts
without any (``NUMPY``), and the tower threads (``towers.devices.cpu_threads``)
and the bucket thread of ``towers.parallel.overlap`` run in a copy of their
caller's context.  So two ``Trainer`` objects, in one thread or two, each run
their own forms, and nothing is left behind in a thread after a call.

Settings (``MODES``): ``"auto"`` gives the compiled loops when numba imports
and the model is ``worth_loading`` them, ``"numba"`` requires numba,
``"numpy"`` never loads it.  A numba that is missing or fails to import (a
release that does not support this NumPy) leaves NumPy in charge under
``auto``, with a notice when it is installed but broken.

The compiled loops give NumPy's bits, but for batch norm's statistics (float64
sums) and a convolution's input gradient by col2im (another order of sums):
a model with such layers depends on the choice (``rounds_otherwise``), and a
checkpoint records which form ran (``Forms.name``, ``towers.output.checkpoint``).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from towers.devices import matmul
from towers.errors import UserError, notice
from towers.ops.numba_jit import numba_module, warm_up

MODES = ("auto", "numba", "numpy")
#: The values of ``gpu_conv``: ``cudnn`` requires the cuDNN frontend, ``auto`` takes it where it starts.
GPU_CONVS = ("im2col", "cudnn", "auto")
#: The values of ``Forms.gemm``: whose cuBLAS binding the device GEMMs call.
GEMM_BINDINGS = ("cupy", "nvmath")

#: ``auto`` loads the compiled loops for models of this many parameters or more: the update, L2 and all-reduce
#: passes they fuse grow with the model (the MLP 784-500-10, 0.4 M: 0.4-0.5 ms of a 3.4 ms step saved; the
#: default digits MLP, 37.5 k: about 0.12 ms, so numba's start, 0.75 s, costs its 2,000-step run more than it saves).
WORTH_PARAMS = 100_000


@dataclasses.dataclass(frozen=True)
class Forms:
    """The forms a tower's ops run: ``compiled`` (host arrays: numba's loops, else NumPy's passes), ``cudnn``
    (device convolutions on cuDNN, else im2col and cuBLAS), ``gemm`` (the device GEMMs' cuBLAS binding:
    ``"cupy"`` or ``"nvmath"``)."""

    compiled: bool = False
    cudnn: bool = False
    gemm: str = "cupy"

    def __post_init__(self):
        if self.gemm not in GEMM_BINDINGS:
            raise ValueError(f"GEMM binding {self.gemm!r}: use one of {', '.join(GEMM_BINDINGS)}")

    @property
    def name(self) -> str:
        """What runs the CPU's kernels, as a checkpoint records it: ``"numba"`` or ``"numpy"``."""
        return "numba" if self.compiled else "numpy"

    @contextlib.contextmanager
    def active(self):
        """These forms current inside the block (in this thread, and in the threads that copy its context); the
        ones current before after it."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


#: The forms outside any scope: NumPy's passes, im2col, CuPy's binding.
NUMPY = Forms()
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("towers_ops_forms", default=NUMPY)


def current() -> Forms:
    """The forms the ops run now: the innermost ``Forms.active`` scope's, else ``NUMPY``."""
    return _CURRENT.get()


def host(mode: str) -> Forms:
    """The forms of ``mode`` for host arrays (``"numba"`` requires numba; ``"auto"``: numba where it imports),
    the rest as ``NUMPY``: for tests, tools and a ``Replica`` made by hand."""
    return Forms(compiled=available(mode))


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


def choose(mode: str, model, cpu_towers: bool, gpu_conv: str = "im2col", gpu=None, cuda_graphs: bool = False) -> Forms:
    """The ``Forms`` of a run (module doc): nothing is made current.

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
    if on:
        with Forms(compiled=True).active():
            warm_up()
    convolves = any(layer.convolves() for layer in model.layers)
    cudnn = gpu is not None and gpu_conv != "im2col" and convolves and _cudnn_starts(gpu_conv, gpu)
    gemm = "nvmath" if gpu is not None and cuda_graphs and _nvmath_starts(gpu) else "cupy"
    return Forms(compiled=on, cudnn=cudnn, gemm=gemm)


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


def _numpy_version() -> str:
    import numpy

    return numpy.__version__
