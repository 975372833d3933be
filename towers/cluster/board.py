"""A shared-memory board: the hosts of one node exchange arrays through it at memory speed.

The driver creates one segment per run (``multiprocessing.shared_memory``, in
``/dev/shm``); every host actor (and the parameter server) attaches to it by
name, which Ray hands out with the actor's arguments: Ray is the rendezvous,
the bytes never go through a socket, the object store or the driver.

Layout: a control block of int64 cells, then named float32 (or float64)
arrays, laid out by the ``spec`` every process receives:

* ``ctl[0]`` is the abort flag: the driver sets it when a host died or the run
  stops, and every wait on the board raises ``Aborted`` within a millisecond
  instead of waiting for a host that will never come;
* ``counter(name, h)`` cells: each is written by ONE process only (its
  owner), read by all, so no atomic instruction is needed: a process publishes
  data, then bumps its counter; readers wait for the counter, then read the
  data.  On x86-64 stores are seen in program order (TSO); the NumPy writes
  and the counter store come from separate C calls, which the compiler cannot
  reorder.

Waits spin on ``sched_yield`` for a short while (a peer on another core
usually arrives within microseconds), then sleep in 50 us steps, so a waiting
process leaves its core to the others on a small machine.

Limits: one node only (the driver checks that every host actor landed on its
own node before using a board); processes on other nodes use the object store
(``towers.cluster.reduce.ObjectStoreMean``).
"""
from __future__ import annotations

import os
import time
import uuid
from multiprocessing import resource_tracker, shared_memory

import numpy

from towers.errors import TrainingError

CTL_CELLS = 64
SPIN = 2000  # sched_yield rounds before sleeping: ~50-200 us on an idle core
NAP_S = 50e-6


class Aborted(TrainingError):
    """The driver stopped the run while this process waited on the board."""


class Board:
    """A shared segment of counters and arrays (see the module docstring).

    ``spec``: {name: (shape, dtype)} of the arrays; ``counters``: {name: count}
    of int64 cells.  ``Board.create(spec, counters)`` in the driver,
    ``Board.attach(board.handle)`` in each actor.
    """

    def __init__(self, shm, spec: dict, counters: dict, owner: bool):
        self.shm, self.spec, self.counters, self.owner = shm, spec, counters, owner
        buf = shm.buf
        self.ctl = numpy.ndarray((CTL_CELLS + sum(counters.values()),), numpy.int64, buf, 0)
        self._cells, at = {}, CTL_CELLS
        for name, n in counters.items():
            self._cells[name] = self.ctl[at: at + n]
            at += n
        offset = self.ctl.nbytes
        self.arrays = {}
        for name, (shape, dtype) in spec.items():
            dtype = numpy.dtype(dtype)
            offset = -(-offset // 64) * 64  # cache-line aligned: no false sharing between arrays
            a = numpy.ndarray(shape, dtype, buf, offset)
            self.arrays[name] = a
            offset += a.nbytes

    @staticmethod
    def size_of(spec: dict, counters: dict) -> int:
        n = (CTL_CELLS + sum(counters.values())) * 8
        for shape, dtype in spec.values():
            n = -(-n // 64) * 64 + int(numpy.prod(shape, dtype=numpy.int64)) * numpy.dtype(dtype).itemsize
        return max(n, 1)

    @classmethod
    def create(cls, spec: dict, counters: dict) -> "Board":
        name = f"towers-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=cls.size_of(spec, counters))
        board = cls(shm, spec, counters, owner=True)
        board.ctl[...] = 0
        return board

    @classmethod
    def attach(cls, handle: tuple) -> "Board":
        name, spec, counters = handle
        shm = shared_memory.SharedMemory(name=name)
        # The driver owns the segment: an actor's exit must not unlink it (Python < 3.13 registers
        # every attached segment with the resource tracker, which unlinks it at exit).
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - the tracker's own key
        return cls(shm, spec, counters, owner=False)

    @property
    def handle(self) -> tuple:
        """What an actor needs to attach: (segment name, spec, counters)."""
        return self.shm.name, self.spec, self.counters

    def __getitem__(self, name: str) -> numpy.ndarray:
        return self.arrays[name]

    def cell(self, name: str) -> numpy.ndarray:
        return self._cells[name]

    # -- waiting -----------------------------------------------------------------------------

    def abort(self) -> None:
        self.ctl[0] = 1

    @property
    def aborted(self) -> bool:
        return bool(self.ctl[0])

    def wait(self, ready) -> None:
        """Return once ``ready()`` is true; ``Aborted`` if the driver stops the run meanwhile."""
        spins = 0
        while not ready():
            if self.ctl[0]:
                raise Aborted("stopped by the driver (another host failed or the run ended)")
            spins += 1
            if spins < SPIN:
                os.sched_yield()
            else:
                time.sleep(NAP_S)

    def close(self) -> None:
        """Detach; the owner (the driver) also removes the segment (idempotent)."""
        if self.shm is None:
            return
        shm, self.shm = self.shm, None
        self.arrays, self._cells, self.ctl = {}, {}, None
        try:
            shm.close()
        except BufferError:  # a view still alive in this process: the mapping goes with it
            pass
        if self.owner:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


class Barrier:
    """A barrier of ``n`` processes on a board: each bumps its own cell, then waits for all cells to reach it."""

    def __init__(self, board: Board, name: str, rank: int):
        self.board, self.cells, self.rank = board, board.cell(name), rank
        self.n = len(self.cells)

    def wait(self) -> None:
        cells, me = self.cells, self.cells[self.rank] + 1
        cells[self.rank] = me
        self.board.wait(lambda: int(cells.min()) >= me)
