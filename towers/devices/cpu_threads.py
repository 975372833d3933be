"""Concurrent CPU towers: one persistent thread per tower, BLAS pinned to 1 thread each.

NumPy releases the GIL inside BLAS calls and inside the loops of large
elementwise operations, so N CPU towers running in N threads with one BLAS
thread each keep N cores busy on work that is large per call (a 100 x 784 x 500
matmul).  The alternative, towers in sequence with a multi-threaded BLAS, splits
each small matmul across cores and loses to thread start-up and spinning; the
benchmark (``tools/bench_train.py``) measures both, and the faster is the
default (``--cpu-towers threads``).

One step costs two hand-offs between threads: ``run`` wakes the workers, and a
barrier inside the step function separates compute from the all-reduce.  The
workers' tail (their share of the all-reduce and update) overlaps with the main
thread fetching the next batch; ``wait`` joins it before anyone reads weights.
"""
from __future__ import annotations

import os
import threading


def cpu_count() -> int:
    """Cores this process may run on (affinity-aware where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def set_blas_threads(n: int):
    """Limit BLAS to ``n`` threads for the whole process; returns a handle to undo it.

    Uses threadpoolctl, which talks to the loaded OpenBLAS/MKL/BLIS directly
    (environment variables are read only when the library loads: too late here).
    """
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=int(n), user_api="blas")


class TowerThreads:
    """Runs ``fn(tower)`` for every tower at once: tower 0 on the caller's thread.

    ``fn`` may call ``barrier.wait()`` (a ``threading.Barrier`` over all towers).
    An exception in any tower breaks the barrier (so no one hangs) and is
    re-raised by ``wait``.
    """

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n)
        self._fn = None
        self._errors: list = []
        self._go = [threading.Semaphore(0) for _ in range(n)]
        self._done = [threading.Semaphore(0) for _ in range(n)]
        self._busy = False
        self._closing = False
        self._threads = [
            threading.Thread(target=self._worker, args=(i,), daemon=True, name=f"towers-cpu-{i}")
            for i in range(1, n)
        ]
        for t in self._threads:
            t.start()

    def _call(self, i: int) -> None:
        try:
            self._fn(i)
        except BaseException as e:  # surfaced by wait()
            self._errors.append(e)
            self.barrier.abort()

    def _worker(self, i: int) -> None:
        while True:
            self._go[i].acquire()
            if self._closing:
                return
            self._call(i)
            self._done[i].release()

    def run(self, fn) -> None:
        """Start ``fn`` on every tower; return when tower 0's share is done."""
        self.wait()
        self._fn, self._busy = fn, True
        for i in range(1, self.n):
            self._go[i].release()
        self._call(0)
        if self._errors:  # fail now, not one step later
            self.wait()

    def wait(self) -> None:
        """Join the workers' share of the last ``run``; re-raise their first error."""
        if not self._busy:
            return
        for i in range(1, self.n):
            self._done[i].acquire()
        self._busy = False
        if self._errors:
            err, self._errors = self._errors[0], []
            self.barrier.reset()
            raise err

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._closing = True
            for i in range(1, self.n):
                self._go[i].release()
            for t in self._threads:
                t.join(timeout=5)


def chunks(size: int, n: int) -> list[slice]:
    """``n`` contiguous slices covering ``range(size)``, sizes differing by at most one."""
    bounds = [size * i // n for i in range(n + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(n)]


__all__ = ["TowerThreads", "chunks", "cpu_count", "set_blas_threads"]
