"""The cross-host mean of CPU hosts: a ``Reducer`` that plugs into each host's ``Hierarchical`` as ``across``.

Each host's ``Trainer`` is built with ``make_reducer(placement, streams,
across=...)``: its towers are first summed into the host's leader and scaled
by 1 / (host towers); ``average([leader])`` below then leaves in the leader the
mean over every host, weighted by tower counts, and the host's ``DeviceMean``
hands it back to its towers.  The step engine calls it for gradients (grads
mode) and for weights, optimizer slots and model buffers (weights mode), in
the same order on every host.

``BoardMean`` (hosts on one node; ``towers.cluster.board``):

1. each host writes ``leader * towers_h / towers_total`` into its row of the
   board's ``slots`` and waits at a barrier;
2. host h sums chunk h of every row, in host order, into the board's
   ``result`` and waits at a second barrier;
3. each host copies ``result`` into its leader.

Each chunk is summed by one host and every host copies the same bytes, so the
hosts stay bit-identical; each host reads (H-1)/H of the buffer from the other
rows and writes 1/H, as a ring all-reduce would.  Two barriers suffice: a host
can write its row of the next call only after every host has passed the
second barrier, i.e. finished summing.

``ObjectStoreMean`` (hosts on several nodes): the same reduce-scatter and
all-gather through Ray's object store, with an ``Exchange`` actor passing the
ObjectRefs as the rendezvous (never the bytes, never the driver).

Sync points: both wait for every host.  A host that dies leaves the others
waiting until the driver aborts the board (``Aborted``) or kills them.
"""
from __future__ import annotations

import asyncio
import time

import numpy

from towers.arrays import on_host, to_host
from towers.cluster.board import Barrier, Board
from towers.parallel.reducers import Reducer


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (start, stop) ranges covering ``n`` (the first ``n % parts`` one longer)."""
    q, r = divmod(n, parts)
    starts = [k * q + min(k, r) for k in range(parts + 1)]
    return list(zip(starts[:-1], starts[1:]))


def board_spec(n_hosts: int, size: int) -> tuple[dict, dict]:
    """The board a ``BoardMean`` of ``n_hosts`` needs for buffers of up to ``size`` floats."""
    return ({"slots": ((n_hosts, size), numpy.float32), "result": ((size,), numpy.float32)},
            {"mean": n_hosts})


class _Timed(Reducer):
    seconds = 0.0  # time spent in average(), for the benchmark
    calls = 0
    waits = True  # for the other hosts, at barriers or in the object store

    def average(self, buffers: list) -> None:
        t0 = time.perf_counter()
        for b in buffers:  # one leader per host in practice
            self._average(b)
        self.seconds += time.perf_counter() - t0
        self.calls += 1


class BoardMean(_Timed):
    """A host's side of the shared-memory mean (see the module docstring)."""

    def __init__(self, board: Board, rank: int, towers_per_host: list[int]):
        self.board, self.rank = board, rank
        self.n = len(towers_per_host)
        self.share = numpy.float32(towers_per_host[rank] / sum(towers_per_host))
        self.barrier = Barrier(board, "mean", rank)
        self.slots, self.result = board["slots"], board["result"]

    def _average(self, buf) -> None:
        n = buf.size
        slots, result = self.slots[:, :n], self.result[:n]
        numpy.multiply(to_host(buf), self.share, out=slots[self.rank])
        self.barrier.wait()  # every host's row is written
        lo, hi = chunk_bounds(n, self.n)[self.rank]
        numpy.add(slots[0, lo:hi], slots[1, lo:hi], out=result[lo:hi])  # hosts >= 2
        for h in range(2, self.n):
            result[lo:hi] += slots[h, lo:hi]
        self.barrier.wait()  # every chunk is summed
        _copy_into(buf, result)

    def close(self) -> None:
        self.board.close()


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


class ObjectStoreMean(_Timed):
    """A host's side of the object-store mean (hosts on several nodes; see the module docstring)."""

    def __init__(self, exchange, rank: int, towers_per_host: list[int]):
        import ray

        self.ray, self.exchange, self.rank = ray, exchange, rank
        self.n = len(towers_per_host)
        self.share = numpy.float32(towers_per_host[rank] / sum(towers_per_host))
        self.key = 0  # every host averages in the same order, so a call count is the rendezvous key

    def _average(self, buf) -> None:
        ray, key = self.ray, self.key
        self.key += 1
        mine = to_host(buf) * self.share
        chunks = [mine[lo:hi] for lo, hi in chunk_bounds(mine.size, self.n)]
        scattered = ray.get(self.exchange.swap.remote((key, 0), self.rank, [ray.put(c) for c in chunks]))
        parts = ray.get([refs[self.rank] for refs in scattered])
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        gathered = ray.get(self.exchange.swap.remote((key, 1), self.rank, [ray.put(total)]))
        _copy_into(buf, numpy.concatenate(ray.get([refs[0] for refs in gathered])))


def _copy_into(buf, host: numpy.ndarray) -> None:
    """``buf[...] = host``, onto ``buf``'s device when it is a CuPy array."""
    if on_host(buf):
        buf[...] = host
    else:
        buf.set(host)
