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
process's choice (``towers.ops.backend``).

``host_rng(ctx, path)`` is the generator a layer at ``path`` draws its masks
from: ``numpy.random.default_rng([seed, tower, step, *path])``, drawn on the
host so that a CPU and a GPU tower of the same index draw the same mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy


@dataclass
class StepContext:
    training: bool = True
    step: int = 0
    tower: int = 0
    seed: int = 0
    sync: TowerSync | None = None


@dataclass(frozen=True)
class TowerSync:
    """One tower's handle on the cross-tower average (see the module doc)."""

    average: Callable  # average(array): in place, across every tower; a barrier
    index: int  # this tower's place, 0 .. towers - 1
    towers: int


def host_rng(ctx: StepContext, path: tuple) -> numpy.random.Generator:
    """The generator of the layer at ``path`` (its indices in the model) for this step and tower."""
    return numpy.random.default_rng([int(ctx.seed), int(ctx.tower), int(ctx.step), *map(int, path)])
