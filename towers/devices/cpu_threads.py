"""Concurrent CPU towers: one persistent thread per tower, BLAS threads the cores less one split among them.

NumPy releases the GIL inside BLAS calls and inside the loops of large
elementwise operations, so N CPU towers running in N threads with one BLAS
thread each (as on 2 cores; ``blas_threads`` says why a core is left over)
keep N cores busy on work that is large per call (a 100 x 784 x 500 matmul).  The alternative, towers in sequence with a multi-threaded BLAS, splits
each small matmul across cores and loses to thread start-up and spinning; the
benchmark (``tools/bench_train.py``) measures both, and the faster is the
default (``--cpu-towers threads``).

One step costs two hand-offs between threads: ``run`` wakes the workers, and a
barrier inside the step function separates compute from the all-reduce.  The
workers' tail (their share of the all-reduce and update) overlaps with the main
thread fetching the next batch; ``wait`` joins it before anyone reads weights.
"""
from __future__ import annotations

import contextvars
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from towers.errors import notice


def cpu_count() -> int:
    """Cores this process may run on (affinity-aware where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def input_workers(setting: int | None, cpu_towers: int) -> int:
    """Parse worker processes for TFRecord input: ``setting``, or as many as there are spare cores.

    Spare: cores not running a CPU tower or the main thread, at most 4.  On a
    2-core machine with CPU towers that is 0 (parsing in the input thread):
    measured there, 2 worker processes made training from TFRecord 25% slower
    than parsing in the input thread, their CPU time and the hand-off of each
    batch falling on the towers' critical path.

    A ``setting`` above the cores is capped at them, with a notice: more
    processes than cores only share them, and each costs a Python start-up
    (64 on 2 cores: 20.7 s for 3 steps).
    """
    cores = cpu_count()
    if setting is not None and setting > cores:
        notice(f"`input_workers` {setting} is more than the {cores} cores this process may use: starting {cores}")
        return cores
    if setting is not None:
        return setting
    return max(0, min(4, cores - cpu_towers - 1))


def blas_threads(towers: int, serial: bool = False, share: int = 0) -> int:
    """The BLAS threads of a process running ``towers`` CPU towers when ``blas_threads`` is 0 (auto).

    Towers in threads, and a tower alone, share the cores this process may use
    less one, at least one thread each; towers run one after another (``serial``,
    ``cpu_towers`` serial) take every core, which is that mode's purpose.
    ``share``: a cluster host's part of its machine's cores
    (``towers.cluster.driver.core_shares``, which leaves that machine's spare
    core), split among its towers as it is.

    Why a core is left over: OpenBLAS splits each product among its threads
    and the product ends when the slowest thread does, the others spinning
    meanwhile.  With a thread on every core, one other busy process takes a
    core from one of them at a time, and every product waits for it
    (docs/performance.md, CPU towers).  A spare core also keeps the input thread
    and the main thread off the towers' cores.  OpenBLAS orders some sums by its thread count, so a run's last bits depend
    on it (the MNIST MLP's 784 x 500 layer, LeNet-5; not the digits MLP's).
    """
    if serial and towers > 1:
        return share or cpu_count()
    return max(1, (share or max(1, cpu_count() - 1)) // towers)


def limit_blas(devices, setting: int, threads: bool = False, share: int = 0):
    """(BLAS threads, the limit's handle) of a process whose towers run on ``devices``; (None, None) with a
    GPU among them (the CPU then only feeds them).  The one choice of a run's ``Trainer``
    (``towers.run.local.LocalExecutor``) and of a loaded run (``towers.inference.Predictor``: one tower).

    ``setting``: `blas_threads` (0: auto, ``blas_threads``); ``threads``: the
    towers run concurrently in threads (else one after another); ``share``:
    a cluster host's cores.  Undo with the handle's ``restore_original_limits()``.
    """
    if any(d.is_gpu for d in devices):
        return None, None
    n = setting or blas_threads(len(devices), serial=not threads, share=share)
    return n, set_blas_threads(n)


def set_blas_threads(n: int):
    """Limit BLAS to ``n`` threads for the whole process; returns a handle to undo it.

    Uses threadpoolctl, which talks to the loaded OpenBLAS/MKL/BLIS directly
    (environment variables are read only when the library loads: too late here).
    """
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=int(n), user_api="blas")


class TowerThreads:
    """Runs ``fn(tower)`` for every tower at once: tower 0 on the caller's thread.

    Towers 1..N-1 run on a ``concurrent.futures.ThreadPoolExecutor`` of N-1
    threads, so all N run at the same time and ``fn`` may call
    ``barrier.wait()`` (a ``threading.Barrier`` over all towers).  An exception
    in any tower breaks the barrier (so no one hangs) and is re-raised by
    ``wait`` (or by ``run``, when tower 0 saw it).  Each runs in a copy of the
    caller's ``contextvars`` context, which holds the current forms of the
    ops (``towers.ops.forms``).
    """

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n)
        self._executor = ThreadPoolExecutor(max_workers=max(1, n - 1), thread_name_prefix="towers-cpu")
        self._futures: list = []

    def _call(self, fn, i: int) -> None:
        try:
            fn(i)
        except BaseException:
            self.barrier.abort()  # the other towers stop waiting for this one
            raise

    def run(self, fn) -> None:
        """Start ``fn`` on every tower; return when tower 0's share is done."""
        self.wait()
        # Each worker runs in a copy of the caller's context: the caller's current forms of the ops
        # (towers.ops.forms), not another thread's.
        self._futures = [self._executor.submit(contextvars.copy_context().run, self._call, fn, i)
                         for i in range(1, self.n)]
        try:
            self._call(fn, 0)
        except BaseException:
            try:
                self.wait()  # a tower thread's own error, if any, is the cause: raise that one
            except threading.BrokenBarrierError:
                pass  # only the echo of tower 0's own abort: tower 0's error is the one to raise
            finally:
                self.barrier.reset()
            raise

    def wait(self) -> None:
        """Join the workers' share of the last ``run``; re-raise their first error."""
        futures, self._futures = self._futures, []
        errors = [f.exception() for f in futures]  # waits for each
        real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        if any(errors):
            self.barrier.reset()
            raise (real or [e for e in errors if e is not None])[0]

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)


def chunks(size: int, n: int) -> list[slice]:
    """``n`` contiguous slices covering ``range(size)``, sizes differing by at most one."""
    bounds = [size * i // n for i in range(n + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(n)]


__all__ = ["TowerThreads", "blas_threads", "chunks", "cpu_count", "input_workers", "set_blas_threads"]
