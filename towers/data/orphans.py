"""Input worker processes that end with their parent.

A worker of a pool (``concurrent.futures.ProcessPoolExecutor``: the TFRecord
readers) blocks on its task queue and outlives a parent killed with SIGKILL
(the OOM killer), for minutes, together with multiprocessing's resource
tracker, whose pipe the workers hold open; an image worker
(``towers.data.image.workers``) sees its pipe close, but only once it has
made the chunks already sent to it.  :func:`watch_parent`, called in a worker's initializer,
starts a daemon thread that exits the worker as soon as its parent is gone:

- a process started by multiprocessing waits on its parent's *sentinel*, a
  pipe the kernel closes when the parent dies, so there is no polling and no
  race with a parent that died while the worker was still starting;
- any other process polls its parent pid every ``WATCH_SECONDS`` (an orphan is
  re-parented to init or a subreaper).

A thread, not Linux's ``PR_SET_PDEATHSIG``: that signal follows the parent
*thread* that spawned the worker, and pools spawn workers from whichever
thread submits first (the input thread, which ends before the run does).
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

WATCH_SECONDS = 0.25  # how often a worker without a sentinel checks its parent pid


def watch_parent(parent: int | None = None) -> None:
    """Exit this process (status 1, no cleanup: there is no one left to report to) once its parent is gone.

    ``parent``: the parent's pid, for a process not started by multiprocessing (default: the parent now).
    """
    started_by = multiprocessing.parent_process()
    if started_by is not None:
        target, args = _wait_sentinel, (started_by,)
    else:
        target, args = _poll, (os.getppid() if parent is None else parent,)
    threading.Thread(target=target, args=args, daemon=True, name="towers-parent-watch").start()


def _wait_sentinel(parent) -> None:
    parent.join()  # returns when the parent's sentinel pipe closes: the parent has exited
    os._exit(1)


def _poll(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_SECONDS)
    os._exit(1)
