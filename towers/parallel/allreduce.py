"""The all-reduce: average one flat buffer per tower, in place, on every tower.

This is where a step's gradients are averaged (``TowerAllReduce.average``,
called once per step by ``towers.trainer.Trainer``).

Algorithm, for towers grouped by device (``Placement.groups``):

1. Within each device group, the group's first tower (its leader) accumulates
   the sum of the group's buffers, scaled by ``n_groups / n_towers``.
2. Across groups (distinct GPUs) one grouped NCCL all-reduce with ``NCCL_AVG``
   over the leaders' whole buffers, each on its leader's stream.  The result is
   ``sum(all towers) / n_towers`` whatever the group sizes.
3. Leaders copy the result to the other towers of their group.

CPU towers form a single group, so only steps 1 and 3 run (an on-device mean);
so do towers that all share one GPU.  Every tower ends with bit-identical
values, which keeps the replicas bit-identical after the update.

Limits: one process drives every GPU, so every collective of a step sits inside
one ``groupStart()``/``groupEnd()`` pair (a plain loop would block on the first
rank).  Two ranks on one GPU are refused by NCCL, so towers sharing a GPU are
reduced on the device first.  NCCL's AVG multiplies by 1/N before summing, so
results can differ from ``sum / N`` in the last bit when N is not a power of two.

The NCCL module is injected at one place: the ``nccl`` argument (default
``cupy.cuda.nccl``).  Tests pass a host-memory stand-in with the same call
signatures; with CPU towers and a stand-in, each tower becomes its own rank.

Across hosts (``NcclWorld``, ``towers.cluster``): one communicator spans every
host's GPU leaders.  Host h's leaders are ranks ``first_rank ..`` of ``n_ranks``;
rank 0's host made the ``unique_id`` and every host got it from the driver.
Each host builds its communicators with ``NcclCommunicator(n_ranks, id, rank)``
inside ``groupStart()``/``groupEnd()`` (the calls of all ranks of one process
must be grouped, like the all-reduce).  Step 1's scale becomes
``n_ranks / total_towers`` so NCCL's average over all leaders is the mean over
every tower of every host, whatever each host's tower count.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy

from towers.errors import UserError
from towers.devices.placement import Device, on_stream
from towers.nn import kernels


def nccl_module():
    """The real ``cupy.cuda.nccl`` (imported lazily: the CPU path never needs it)."""
    from cupy.cuda import nccl

    return nccl


def data_ptr(array) -> int:
    """Address of an array's first element: CuPy ``.data.ptr``, NumPy ``.ctypes.data``."""
    data = getattr(array, "data", None)
    ptr = getattr(data, "ptr", None)
    return int(ptr) if ptr is not None else int(array.ctypes.data)


@dataclass(frozen=True)
class NcclWorld:
    """This host's share of a communicator over several hosts (see the module docstring)."""

    unique_id: bytes  # from nccl.get_unique_id() on the host of rank 0
    n_ranks: int  # GPU leaders over all hosts
    first_rank: int  # this host's first leader's rank
    total_towers: int  # towers over all hosts


def world_layout(leaders_per_host: list[int], towers_per_host: list[int], unique_id: bytes) -> list[NcclWorld]:
    """Each host's ``NcclWorld``: ranks numbered host by host, in host order."""
    firsts = [sum(leaders_per_host[:h]) for h in range(len(leaders_per_host))]
    return [NcclWorld(unique_id, sum(leaders_per_host), f, sum(towers_per_host)) for f in firsts]


class NcclAllReduce:
    """One communicator per rank (``initAll``, or a ``NcclWorld``'s ranks) and a grouped in-place average."""

    def __init__(self, device_ids: list[int], nccl=None, world: NcclWorld | None = None, on_gpus: bool = True):
        if len(set(device_ids)) != len(device_ids):
            raise UserError(
                f"NCCL needs distinct GPUs, got {device_ids}: towers sharing a GPU are reduced on it first"
            )
        self.nccl = nccl or nccl_module()
        self.device_ids = list(device_ids)
        self._dtypes = {
            numpy.dtype(numpy.float32): self.nccl.NCCL_FLOAT32,
            numpy.dtype(numpy.float64): self.nccl.NCCL_FLOAT64,
        }
        if world is None:
            # initAll takes an int or a list (a tuple raises ValueError).
            self.comms = self.nccl.NcclCommunicator.initAll(list(self.device_ids))
        else:
            self.comms = self._join(world, on_gpus)

    def _join(self, world: NcclWorld, on_gpus: bool) -> list:
        """This host's ranks of ``world``: one communicator per local GPU, grouped."""
        comms = []
        self.nccl.groupStart()
        try:
            for k, dev in enumerate(self.device_ids):
                with Device("gpu", dev).scope() if on_gpus else contextlib.nullcontext():
                    comms.append(self.nccl.NcclCommunicator(world.n_ranks, world.unique_id, world.first_rank + k))
        finally:
            self.nccl.groupEnd()
        return comms

    def average(self, buffers: list, stream_ptrs: list[int]) -> None:
        """In-place ``NCCL_AVG`` of ``buffers[r]`` on rank r, on ``stream_ptrs[r]``."""
        nccl = self.nccl
        if len(buffers) != len(self.comms) or len(stream_ptrs) != len(self.comms):
            raise ValueError(f"{len(self.comms)} ranks, got {len(buffers)} buffers and {len(stream_ptrs)} streams")
        # Build and check every argument before groupStart: an exception between
        # groupStart and the last rank's call would leave a half-built collective.
        count, dtype = buffers[0].size, buffers[0].dtype
        calls = []
        for comm, buf, stream in zip(self.comms, buffers, stream_ptrs):
            if buf.size != count or buf.dtype != dtype or buf.ndim != 1 or not buf.flags.c_contiguous:
                raise ValueError(
                    f"all-reduce buffers must be contiguous 1-D arrays of one size and dtype; "
                    f"got {buf.shape} {buf.dtype} against ({count},) {dtype}"
                )
            if dtype not in self._dtypes:
                raise ValueError(f"NCCL all-reduce of {dtype} is not supported here")
            ptr = data_ptr(buf)
            calls.append((comm, ptr, int(stream)))
        nccl_dtype = self._dtypes[dtype]
        nccl.groupStart()
        try:
            for comm, ptr, stream in calls:
                comm.allReduce(ptr, ptr, count, nccl_dtype, nccl.NCCL_AVG, stream)
        finally:
            nccl.groupEnd()  # nothing is enqueued before this returns

    def close(self) -> None:
        for comm in self.comms:
            comm.destroy()
        self.comms = []


class TowerAllReduce:
    """Averages one buffer per tower across all towers (see the module docstring)."""

    def __init__(self, placement, streams=None, nccl=None, host_groups=None, world: NcclWorld | None = None):
        self.devices = list(placement.towers)
        self.n = len(self.devices)
        self.streams = list(streams) if streams is not None else [None] * self.n
        all_cpu = not any(d.is_gpu for d in self.devices)
        if all_cpu and nccl is not None:
            # Stand-in over host memory: CPU towers play GPUs, grouped as
            # ``host_groups`` says (default: each tower its own rank).
            self.groups = host_groups or [[i] for i in range(self.n)]
            rank_ids = list(range(len(self.groups)))
        else:
            self.groups = placement.groups
            rank_ids = [self.devices[g[0]].index for g in self.groups]
        if world is None:
            self.nccl = NcclAllReduce(rank_ids, nccl) if len(self.groups) > 1 else None
            self._scale = len(self.groups) / self.n  # step 1's factor, see the docstring
        else:  # one communicator over every host's leaders
            self.nccl = NcclAllReduce(rank_ids, nccl, world, on_gpus=not all_cpu)
            self._scale = world.n_ranks / world.total_towers

    @property
    def uses_nccl(self) -> bool:
        return self.nccl is not None

    def _stream_ptr(self, i: int) -> int:
        s = self.streams[i]
        return int(s.ptr) if s is not None else 0

    def average(self, buffers: list) -> None:
        """In place: every ``buffers[i]`` becomes the mean over all towers."""
        if self.n == 1 and self.nccl is None:
            return
        leaders = [g[0] for g in self.groups]
        # Two GPU towers sharing the only device: sum, scale and hand-back are one
        # kernel (the same arithmetic as steps 1 and 3, which it replaces).
        if self.nccl is None and len(self.groups) == 1 and self.n == 2 and self.devices[0].is_gpu:
            a, b = self.streams
            with self.devices[0].scope(), on_stream(a):
                _after(a, b)
                kernels.mean2(buffers[0], buffers[1], self._scale)
                _after(b, a)
            return
        # 1. Sum each group into its leader, on the leader's device and stream.
        for g in self.groups:
            if len(g) == 1 and self._scale == 1.0:
                continue
            lead = buffers[g[0]]
            with self.devices[g[0]].scope(), on_stream(self.streams[g[0]]):
                for j in g[1:]:
                    _after(self.streams[g[0]], self.streams[j])
                    lead += buffers[j]
                if self._scale != 1.0:
                    lead *= lead.dtype.type(self._scale)
        # 2. Average the leaders across GPUs: the one collective of the step.
        if self.nccl is not None:
            self.nccl.average([buffers[i] for i in leaders], [self._stream_ptr(i) for i in leaders])
        # 3. Hand the result to the other towers of each group.
        for g in self.groups:
            lead = buffers[g[0]]
            with self.devices[g[0]].scope(), on_stream(self.streams[g[0]]):
                for j in g[1:]:
                    buffers[j][...] = lead
                    _after(self.streams[j], self.streams[g[0]])

    def close(self) -> None:
        if self.nccl is not None:
            self.nccl.close()


def _after(waiter, producer) -> None:
    """Order ``waiter`` after the work queued so far on ``producer`` (GPU only)."""
    if waiter is not None and producer is not None and waiter is not producer:
        waiter.wait_event(producer.record())
