"""Input worker processes that end with their parent.

A worker of a pool (``concurrent.futures.ProcessPoolExecutor``) blocks on its
task queue and outlives a parent killed with SIGKILL (the OOM killer), for
minutes, together with multiprocessing's resource tracker, whose pipe the
workers hold open.  :func:`watch_parent`, called in a worker's initializer,
starts a daemon thread that polls the parent pid every ``WATCH_SECONDS``: an
orphan is re-parented (to init or a subreaper), so a changed parent pid means
the parent is gone, and the worker exits at once.  A thread, not Linux's
``PR_SET_PDEATHSIG``: that signal follows the parent *thread* that spawned the
worker, and pools spawn workers from whichever thread submits first (the
input thread, which ends before the run does).
"""
from __future__ import annotations

import os
import threading
import time

WATCH_SECONDS = 0.25  # how often a worker checks that its parent is alive


def watch_parent(parent: int | None = None) -> None:
    """Exit this process (status 1, no cleanup: there is no one left to report to) once ``parent`` (default:
    the parent now) is no longer its parent."""
    parent = os.getppid() if parent is None else parent
    threading.Thread(target=_watch, args=(parent,), daemon=True, name="towers-parent-watch").start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_SECONDS)
    os._exit(1)
