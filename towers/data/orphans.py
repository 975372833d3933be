"""Input worker processes that end with their parent.

A worker of a process pool (the input pool, ``towers.data.workers``, or the
converter's ``concurrent.futures.ProcessPoolExecutor``) would outlive a parent
killed with SIGKILL (the OOM killer): an input worker sees its pipe close only
once it has made the chunks already sent to it, and a pool worker blocked on
its task queue waits for minutes, together with multiprocessing's resource
tracker, whose pipe the workers hold open.  :func:`watch_parent`, called in a worker's initializer,
starts a daemon thread that exits the worker as soon as its parent is gone:

- a process started by multiprocessing waits on its parent's *sentinel*, a
  pipe the kernel closes when the parent dies, so there is no polling and no
  race with a parent that died while the worker was still starting;
- any other process polls its parent pid every ``WATCH_SECONDS`` (an orphan is
  re-parented to init or a subreaper).

A thread, not Linux's ``PR_SET_PDEATHSIG``: that signal follows the parent
*thread* that spawned the worker, and pools spawn workers from whichever
thread submits first (the input thread, which ends before the run does).

Shared memory left by a dead parent: the image workers' blocks are named
:func:`block_prefix` (parent pid) + a random part and kept off
multiprocessing's resource tracker (:func:`untracked_block`).  The tracker would
unlink them after a ``kill -9`` as well, but it also prints ``There appear to
be N leaked shared_memory objects`` for every run killed so; instead the
watching thread of each worker unlinks its parent's blocks (by that prefix,
in ``/dev/shm``) before it exits, and so does a worker whose pipe closed
because its parent died (:func:`exit_if_orphaned`: its main thread may see
the pipe close first and end the process before the watching thread runs).  Where there is no ``/dev/shm`` to look in
(not Linux), the blocks stay with the tracker.  Limit: a parent and all its
workers killed at once (the whole process group) leave their blocks behind,
as they would the tracker's.
"""
from __future__ import annotations

import contextlib
import glob
import multiprocessing
import os
import sys
import threading
import time
from multiprocessing import shared_memory

WATCH_SECONDS = 0.25  # how often a worker without a sentinel checks its parent pid
PIPE_TO_SENTINEL_SECONDS = 1.0  # how long a worker whose pipe closed waits to see its parent gone
SHM_DIR = "/dev/shm"  # where POSIX shared memory shows as files (Linux)


def watch_parent(parent: int | None = None, blocks: str | None = None) -> None:
    """Exit this process (status 1: there is no one left to report to) once its parent is gone.

    ``parent``: the parent's pid, for a process not started by multiprocessing (default: the parent now).
    ``blocks``: a name prefix of the parent's shared-memory blocks (:func:`block_prefix`), unlinked first.
    """
    started_by = multiprocessing.parent_process()
    if started_by is not None:
        target, args = _wait_sentinel, (started_by, blocks)
    else:
        target, args = _poll, (os.getppid() if parent is None else parent, blocks)
    threading.Thread(target=target, args=args, daemon=True, name="towers-parent-watch").start()


def _wait_sentinel(parent, blocks) -> None:
    parent.join()  # returns when the parent's sentinel pipe closes: the parent has exited
    _orphaned(blocks)


def _poll(parent: int, blocks) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_SECONDS)
    _orphaned(blocks)


def exit_if_orphaned(blocks: str | None = None) -> None:
    """Exit as the watching thread would, unlinking the ``blocks``, if the parent is gone: for a worker whose
    pipe to its parent just closed (its main thread would otherwise end the process, and the watching
    daemon thread with it, before that thread has cleaned up)."""
    started_by = multiprocessing.parent_process()
    if started_by is not None:
        # A dying parent closes its pipes and its sentinel in one sweep, not at one instant: wait a moment.
        started_by.join(PIPE_TO_SENTINEL_SECONDS)
        if not started_by.is_alive():
            _orphaned(blocks)


def _orphaned(blocks) -> None:
    if blocks and os.path.isdir(SHM_DIR):
        for path in glob.glob(os.path.join(SHM_DIR, glob.escape(blocks) + "*")):
            with contextlib.suppress(OSError):  # another worker of the same parent was first
                os.unlink(path)
    os._exit(1)


def block_prefix(pid: int) -> str:
    """The name prefix of the image workers' shared-memory blocks made by process ``pid``."""
    return f"towers-{pid}-batch-"


_UNTRACKED = threading.Lock()


class _NoTracker:
    """Stands in for ``multiprocessing.resource_tracker`` inside ``shared_memory`` while a block is opened."""

    @staticmethod
    def register(name, rtype) -> None:
        pass


def untracked_block(name: str, create: bool = False, size: int = 0):
    """A ``SharedMemory`` made (``create``) or attached that the resource tracker never hears of.

    The orphaned workers unlink it instead (module doc).  Python >= 3.13 says
    so with ``track=False``; before, every block is registered, even one only
    attached, and registering then unregistering leaves a window: a process
    killed between the two leaves the name with the tracker, which prints its
    warning.  So ``shared_memory``'s tracker is stood in for while the block
    opens (under a lock: towers' own blocks only come through here).  Without
    ``/dev/shm`` (not Linux) the block stays with the tracker.
    """
    if not os.path.isdir(SHM_DIR):
        return shared_memory.SharedMemory(name, create=create, size=size)
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, create=create, size=size, track=False)
    with _UNTRACKED:
        tracker, shared_memory.resource_tracker = shared_memory.resource_tracker, _NoTracker
        try:
            return shared_memory.SharedMemory(name, create=create, size=size)
        finally:
            shared_memory.resource_tracker = tracker


def unlink(block) -> None:
    """Unlink a ``block`` kept off the tracker (``SharedMemory.unlink`` would tell the tracker to forget a
    name it never had, and the tracker prints a traceback for that)."""
    if os.path.isdir(SHM_DIR):
        os.unlink(os.path.join(SHM_DIR, block.name))
    else:
        block.unlink()
