"""The cross-host mean of CPU hosts, through Ray's object store, never through the driver.

``CrossHostMean.average(buffers)`` runs inside each host actor's step, after
its towers were averaged locally (``buffers[0]`` holds the host's mean):

1. reduce-scatter: the host scales its mean by its share of all towers
   (``towers_h / towers_total``), cuts it into one chunk per host and
   ``ray.put``s the chunks; host h fetches chunk h of every host and sums
   them in host order;
2. all-gather: each host puts its summed chunk; every host fetches all of them
   and writes the concatenation into every tower's buffer.

Each chunk is summed by one host only and every host gets the same bytes, so
the hosts' replicas stay bit-identical.  The chunk data moves between the
hosts' object stores; the ``Exchange`` actor only passes the ObjectRefs
(a few hundred bytes) between hosts, as a rendezvous.  Each host sends and
receives about 2 x (H-1)/H of the buffer per average, as a ring all-reduce.

Sync points: both phases wait for every host (a barrier per phase).  A host
that dies leaves the others waiting; the driver sees the death and stops the
run (``towers.cluster.driver``).
"""
from __future__ import annotations

import asyncio

import numpy

from towers.devices.placement import to_host


class Exchange:
    """Rendezvous for ObjectRefs: ``swap(key, rank, item)`` returns every rank's item once all gave theirs.

    An async Ray actor, so many hosts can wait in it at once; an entry is
    dropped once every rank has read it.
    """

    def __init__(self, n_ranks: int):
        self.n = n_ranks
        self.slots: dict = {}

    async def swap(self, key, rank: int, item):
        items, done, reads = self.slots.setdefault(key, ([None] * self.n, asyncio.Event(), [0]))
        items[rank] = item
        if all(i is not None for i in items):
            done.set()
        await done.wait()
        reads[0] += 1
        if reads[0] == self.n:
            del self.slots[key]
        return items


class CrossHostMean:
    """A host's side of the cross-host mean (see the module docstring)."""

    def __init__(self, exchange, rank: int, towers_per_host: list[int]):
        import ray

        self.ray, self.exchange, self.rank = ray, exchange, rank
        self.n = len(towers_per_host)
        self.share = numpy.float32(towers_per_host[rank] / sum(towers_per_host))
        self.calls = 0  # every host averages in the same order, so this is the rendezvous key
        self.seconds = 0.0  # time spent here, for the benchmark

    def average(self, buffers: list) -> None:
        import time

        t0 = time.perf_counter()
        ray, key = self.ray, self.calls
        self.calls += 1
        mine = to_host(buffers[0]) * self.share
        chunks = numpy.array_split(mine, self.n)
        scattered = ray.get(self.exchange.swap.remote((key, 0), self.rank, [ray.put(c) for c in chunks]))
        parts = ray.get([refs[self.rank] for refs in scattered])
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        gathered = ray.get(self.exchange.swap.remote((key, 1), self.rank, [ray.put(total)]))
        full = numpy.concatenate(ray.get([refs[0] for refs in gathered]))
        for b in buffers:
            b[...] = _to_like(b, full)
        self.seconds += time.perf_counter() - t0


def _to_like(buf, host: numpy.ndarray):
    """``host`` on ``buf``'s device (NumPy stays as is; CuPy copies to the GPU)."""
    if isinstance(buf, numpy.ndarray):
        return host
    import cupy

    return cupy.asarray(host)
