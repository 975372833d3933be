"""Reducers: one interface for averaging buffers across towers, several implementations.

In the spirit of DDP's communication hooks, the step engine
(``towers.step.engine``) knows one call: ``reducer.average(buffers)`` takes one
flat buffer per tower (gradients in grads mode; weights, optimizer state and
model buffers in weights mode) and leaves in EVERY buffer the mean over all
towers, of every host.  Which bytes move where is the reducer's business:

* ``DeviceMean``: towers grouped by device; each group's first tower (its
  leader) sums the group's buffers and scales the sum, then hands the result
  back to the group.  Alone, for towers that all share one device (every CPU
  tower, or GPUs sharing one), it is the whole average.
* ``NcclMean``: one grouped NCCL ``NCCL_AVG`` over one buffer per rank (one
  rank per GPU; ``towers.parallel.allreduce``), optionally over every host's
  GPUs (``NcclWorld``).
* ``Hierarchical(local, across)``: the composition: ``local`` sums into the
  leaders, ``across`` averages the leaders' buffers (NCCL across GPUs, or the
  cluster's cross-host mean), ``local`` hands the result back.
* The cross-host mean of CPU hosts lives with the cluster
  (``towers.cluster.reduce``) and plugs in as ``across``.

``make_reducer`` picks one from the placement.  Tests hand the ``Trainer`` a
reducer built over the NCCL stand-in (``Trainer(..., reducer=...)``); nothing
in the library knows about stand-ins.

Arithmetic: the group sum is scaled by ``ranks / towers`` before NCCL's
average over ``ranks`` leaders, so the result is the mean over every tower
whatever the group sizes; every tower ends with the same bytes, which keeps
replicas bit-identical.

``Counted(reducer)`` is the one place all-reduces are counted (the
communication report's ``all_reduces``): the step engine's replica keeper
(``towers.parallel.sync``) reduces through it; sync-BN's small statistic
averages go to the wrapped reducer and are not counted.

``reducer.on_streams(streams)`` is the same reducer (the same communicators,
the same count) queuing its work on other streams, one per tower: the
gradient buckets' all-reduce streams (``towers.parallel.overlap``).  On the
CPU, where there are no streams, it is the reducer itself.

Limits: only ``DeviceMean`` on the host (``splittable``) may be called on
slices of the buffers from several threads at once (concurrent CPU tower
threads each reduce their share); NCCL and cross-host reducers take whole
buffers from one thread.
"""
from __future__ import annotations

import copy

from towers.devices.placement import on_stream
from towers.ops.mean2 import mean2
from towers.parallel.allreduce import NcclAllReduce, NcclWorld


class Reducer:
    """Averages one buffer per tower in place, across all towers (every host's)."""

    #: whether ``average`` may be called on slices, from several threads at once
    splittable = False
    #: whether ``average`` does nothing (one tower on one host)
    noop = False
    #: whether ``average`` waits on the host for other processes (the cross-host mean of CPU hosts): the gradient
    #: buckets then run it on a thread of their own (``towers.parallel.overlap``)
    waits = False

    def average(self, buffers: list) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def on_streams(self, streams: list) -> "Reducer":
        """This reducer with its work queued on ``streams`` (one per tower); the default, a reducer that
        queues nothing on streams (a host mean), is itself."""
        return self

    def wait(self, timeout: float) -> None:
        """Return when the averages queued on streams are done (the step engine's host sync points, with
        ``nccl_timeout``); a reducer that can fail asynchronously (NCCL) raises ``TrainingError`` within
        ``timeout`` seconds instead of hanging.  Default: nothing queued."""

    def close(self) -> None:
        """Release communicators (idempotent)."""


class DeviceMean(Reducer):
    """Towers grouped by device: sum into each group's leader, scale by ``scale``, hand back.

    ``groups``: tower indices per device; ``devices``/``streams``: per tower.
    Alone (one group, ``scale`` = 1 / towers) it is the mean of towers sharing
    a device; inside ``Hierarchical`` its two halves surround the leaders' mean.
    Two towers alone take one op (``towers.ops.mean2``): one kernel on a GPU,
    one compiled loop or NumPy's passes on the CPU (the current ``towers.ops.forms``),
    with the same roundings in every form.
    """

    def __init__(self, groups: list[list[int]], devices: list, streams: list, scale: float):
        self.groups, self.devices, self.streams, self.scale = groups, devices, streams, scale
        self.noop = all(len(g) == 1 for g in groups) and scale == 1.0
        self.splittable = not any(d.is_gpu for d in devices)

    @property
    def leaders(self) -> list[int]:
        return [g[0] for g in self.groups]

    def on_streams(self, streams: list) -> "DeviceMean":
        return DeviceMean(self.groups, self.devices, streams, self.scale)

    def average(self, buffers: list) -> None:
        if len(self.groups) == 1 and len(buffers) == 2 and self.devices[0].is_gpu:
            # Two GPU towers sharing the only device: sum, scale and hand-back
            # in one kernel (the arithmetic of gather and scatter, fused).
            a, b = self.streams
            with self.devices[0].scope(), on_stream(a):
                _after(a, b)
                mean2(buffers[0], buffers[1], self.scale)
                _after(b, a)
            return
        if len(self.groups) == 1 and len(buffers) == 2:  # two CPU towers: one op
            mean2(buffers[0], buffers[1], self.scale)
            return
        self.gather(buffers)
        self.scatter(buffers)

    def gather(self, buffers: list) -> None:
        """Each group's scaled sum into its leader's buffer, on the leader's device and stream."""
        for g in self.groups:
            if len(g) == 1 and self.scale == 1.0:
                continue
            lead, stream = buffers[g[0]], self.streams[g[0]]
            with self.devices[g[0]].scope(), on_stream(stream):
                for j in g[1:]:
                    _after(stream, self.streams[j])
                    lead += buffers[j]
                if self.scale != 1.0:
                    lead *= lead.dtype.type(self.scale)

    def scatter(self, buffers: list) -> None:
        """Each leader's buffer to the other towers of its group."""
        for g in self.groups:
            lead, stream = buffers[g[0]], self.streams[g[0]]
            with self.devices[g[0]].scope(), on_stream(stream):
                for j in g[1:]:
                    buffers[j][...] = lead
                    _after(self.streams[j], stream)


class NcclMean(Reducer):
    """One grouped in-place ``NCCL_AVG`` of one buffer per rank, each on its rank's stream."""

    def __init__(self, rank_ids: list[int], devices: list, streams: list, nccl=None,
                 world: NcclWorld | None = None):
        self.comm = NcclAllReduce(rank_ids, nccl, world, devices)
        self.stream_ptrs = [int(s.ptr) if s is not None else 0 for s in streams]

    def average(self, buffers: list) -> None:
        self.comm.average(buffers, self.stream_ptrs)

    def wait(self, timeout: float) -> None:
        self.comm.wait(timeout)

    def on_streams(self, streams: list) -> "NcclMean":
        """The same communicators on ``streams`` (one per rank); closing either closes them."""
        view = copy.copy(self)
        view.stream_ptrs = [int(s.ptr) if s is not None else 0 for s in streams]
        return view

    def close(self) -> None:
        self.comm.close()


class Hierarchical(Reducer):
    """``local`` gathers into its leaders, ``across`` averages the leaders, ``local`` scatters back."""

    def __init__(self, local: DeviceMean, across: Reducer):
        self.local, self.across = local, across
        self.waits = across.waits

    def average(self, buffers: list) -> None:
        self.local.gather(buffers)
        self.across.average([buffers[i] for i in self.local.leaders])
        self.local.scatter(buffers)

    def wait(self, timeout: float) -> None:
        self.across.wait(timeout)

    def on_streams(self, streams: list) -> "Hierarchical":
        return Hierarchical(self.local.on_streams(streams),
                            self.across.on_streams([streams[i] for i in self.local.leaders]))

    def close(self) -> None:
        try:
            self.across.close()
        finally:
            self.local.close()


class Counted(Reducer):
    """``reducer`` with a count of the all-reduces issued through it (``count``).

    Rule: one all-reduce is one call over whole buffers, or over slice 0 of
    them; threads reducing the other slices of the same buffers at the same
    time add nothing, so a sliced all-reduce counts once.  A ``noop`` reducer
    is not called and counts nothing.  Only the thread of slice 0 counts.
    A gradient bucket's range is a call of its own (``part`` None): each
    counts one (``towers.parallel.overlap``).  ``on_streams`` gives a view
    that adds to the same count.
    """

    def __init__(self, reducer: Reducer, tally: list | None = None):
        self.reducer = reducer
        self._tally = tally if tally is not None else [0]  # shared with the views of on_streams
        self.splittable, self.noop, self.waits = reducer.splittable, reducer.noop, reducer.waits

    @property
    def count(self) -> int:
        return self._tally[0]

    def average(self, buffers: list, part: slice | None = None) -> None:
        """Average ``buffers`` (``part``: the slice of the whole buffers they are, or None)."""
        if self.noop:
            return
        self.reducer.average(buffers)
        if part is None or part.start == 0:
            self._tally[0] += 1

    def on_streams(self, streams: list) -> "Counted":
        return Counted(self.reducer.on_streams(streams), self._tally)

    def wait(self, timeout: float) -> None:
        self.reducer.wait(timeout)

    def close(self) -> None:
        self.reducer.close()


def make_reducer(placement, streams: list, nccl=None, world: NcclWorld | None = None,
                 across: Reducer | None = None, total_towers: int | None = None) -> Reducer:
    """The reducer for ``placement``'s towers (``streams``: one per tower, None on the CPU).

    * one device group, alone on its host: ``DeviceMean``;
    * several GPUs, or a ``world`` spanning hosts: ``Hierarchical(DeviceMean, NcclMean)``;
    * ``across`` (the cluster's cross-host mean of CPU hosts): ``Hierarchical(DeviceMean, across)``,
      the local sum scaled by 1 / (this host's towers) and ``across`` weighting hosts by their towers.

    ``nccl`` replaces ``cupy.cuda.nccl``; ``total_towers`` is every host's towers (``world``).
    """
    devices, groups = list(placement.towers), placement.groups
    n = len(devices)
    if across is not None:
        return Hierarchical(DeviceMean([list(range(n))], devices, streams, 1.0 / n), across)
    if world is None and len(groups) == 1:
        return DeviceMean(groups, devices, streams, 1.0 / n)
    ranks = len(groups) if world is None else world.n_ranks
    towers = n if world is None else world.total_towers
    local = DeviceMean(groups, devices, streams, ranks / towers)
    leaders = [g[0] for g in groups]
    return Hierarchical(local, NcclMean([devices[i].index for i in leaders], [devices[i] for i in leaders],
                                        [streams[i] for i in leaders], nccl, world))


def _after(waiter, producer) -> None:
    """Order ``waiter`` after the work queued so far on ``producer`` (GPU only)."""
    if waiter is not None and producer is not None and waiter is not producer:
        waiter.wait_event(producer.record())
