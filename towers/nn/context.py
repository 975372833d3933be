"""The step context: what a layer may need to know about the step it runs in.

One ``StepContext`` per replica (``Replica.context``), shared by all its
layers through their workspaces (``ws.ctx``):

``training``
    True inside ``loss_and_grads`` (batch statistics, dropout), False for
    prediction and evaluation (moving statistics, no dropout).
``step``
    Updates done so far.  The engine sets it before each ``loss_and_grads``;
    batch norm's moving averages warm up with it and dropout masks are drawn
    from it, so a resumed run redraws the masks of an uninterrupted one.
``tower``, ``seed``
    The global tower index and the run's seed: dropout masks differ per tower
    and per seed.  With ``accumulate`` K, micro-batch k of tower i draws as
    tower ``i * K + k`` (``towers.step.tower.Tower.compute`` sets it).
``scalars``
    The replica's ``StepScalars``: per-step numbers a layer's device kernels
    read from device memory (batch norm's moving-statistics step, which
    depends on ``step``), so that a step captured as a CUDA graph
    (``towers.devices.cuda_graphs``) reads each step's value when replayed.
``sync``
    None, or a ``TowerSync``: ``sync.average(array)`` averages ONE contiguous
    1-D array in place across every tower of the step and returns when every
    tower has called it (a barrier); ``sync.index`` is this tower's place among
    the ``sync.towers`` towers (batch norm gathers the towers' means through
    the average by filling only its own rows).  Set by the engine with
    ``sync_bn``; every tower then runs its ``loss_and_grads`` concurrently,
    and every tower makes the same sequence of calls (one per batch-norm layer
    forward, one per backward), so the calls pair up.

Which form of each op runs (NumPy's passes, numba's compiled loops, CUDA)
is not part of the context: the ops tell it from their arrays and the
current forms (``towers.ops.forms``).

``host_rng(ctx, path)`` is the generator a layer at ``path`` draws its masks
from: ``numpy.random.default_rng([seed, tower, step, *path])``, drawn on the
host so that a CPU and a GPU tower of the same index draw the same mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy

from towers.arrays import empty_pinned, on_host


class StepScalars:
    """Per-step float32 numbers of one replica, on the host and in one device array the kernels read.

    ``device(key, value, xp, step)`` returns the number for step ``step``
    (``value(step)``, a function of the step count, registered under ``key``
    on first use) as a 1-element float32 view of the array on ``xp`` (CuPy
    on a GPU, the replica's array module: every call of one replica gives the
    same), refreshing every number first when ``step`` is not the last one
    refreshed.  ``refresh(step)`` recomputes every registered number for a
    new step and, when one changed, copies them to the device in ONE
    asynchronous copy on the current stream, from one of two page-locked
    buffers taken in turn (a buffer is refilled once its copy of two
    refreshes ago has finished, as the stager's are).  The replica refreshes before each training step's forward
    (``Replica.start_step``), outside any CUDA graph capture, so a replayed
    graph reads the step's values.  A key first seen while a graph is being
    captured is refused (``RuntimeError``): its first value would be copied
    inside the capture.  At most ``SLOTS`` numbers: the device array is never
    reallocated (a captured graph holds its address).
    """

    SLOTS = 64

    def __init__(self):
        self.xp = None
        self.step = 0
        self.capturing = False  # set while a graph is captured (towers.devices.cuda_graphs)
        self._fns: list = []
        self._index: dict = {}
        self._host = numpy.zeros(self.SLOTS, dtype=numpy.float32)
        self._device = None
        self._pinned = None  # GPU: two page-locked buffers and the events of their last copies
        self._k = 0

    def device(self, key, value: Callable[[int], float], xp, step: int):
        if step != self.step:
            if self.capturing:
                raise RuntimeError(f"step scalars of step {step} asked for inside a capture of step {self.step}")
            self.refresh(step)
        if self.xp is None:
            self.xp = xp
        elif xp is not self.xp:
            raise ValueError(f"step scalars of one replica on {self.xp.__name__} and {xp.__name__}")
        i = self._index.get(key)
        if i is None:
            if self.capturing:
                raise RuntimeError(f"step scalar {key!r} first asked for inside a CUDA graph capture")
            if len(self._fns) == self.SLOTS:
                raise RuntimeError(f"more than {self.SLOTS} step scalars")
            i = self._index[key] = len(self._fns)
            self._fns.append(value)
            self._host[i] = value(self.step)
            if self._device is None:
                self._device = self.xp.zeros(self.SLOTS, dtype=numpy.float32)
            self._upload(i + 1)
        return self._device[i: i + 1]

    def refresh(self, step: int) -> None:
        """The numbers of ``step``, on the host and (one copy, if any changed) on the device."""
        self.step = step
        if not self._fns:
            return
        new = numpy.array([f(step) for f in self._fns], dtype=numpy.float32)
        n = len(new)
        if not numpy.array_equal(new, self._host[:n]):
            self._host[:n] = new
            self._upload(n)

    def _upload(self, n: int) -> None:
        if on_host(self._device):
            self._device[:n] = self._host[:n]
            return

        if self._pinned is None:
            self._pinned = [[empty_pinned((self.SLOTS,), numpy.float32), None] for _ in range(2)]
        buf = self._pinned[self._k]
        self._k ^= 1
        if buf[1] is not None:
            buf[1].synchronize()  # its copy of two uploads ago has finished
        buf[0][:n] = self._host[:n]
        self._device[:n].set(buf[0][:n])  # async from page-locked memory, on the current stream
        buf[1] = self.xp.cuda.get_current_stream().record()


@dataclass
class StepContext:
    training: bool = True
    step: int = 0
    tower: int = 0
    seed: int = 0
    sync: TowerSync | None = None
    scalars: StepScalars = field(default_factory=StepScalars)


@dataclass(frozen=True)
class TowerSync:
    """One tower's handle on the cross-tower average (see the module doc)."""

    average: Callable  # average(array): in place, across every tower; a barrier
    index: int  # this tower's place, 0 .. towers - 1
    towers: int


def host_rng(ctx: StepContext, path: tuple) -> numpy.random.Generator:
    """The generator of the layer at ``path`` (its indices in the model) for this step and tower."""
    return numpy.random.default_rng([int(ctx.seed), int(ctx.tower), int(ctx.step), *map(int, path)])
