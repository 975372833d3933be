"""The watchdog of a local Ray instance: when the driver dies, even by SIGKILL, Ray's processes die too.

``python -m towers.cluster.watchdog DRIVER_PID PID...`` runs in its own
session, started by ``towers.cluster.session`` right after ``ray.init``
started Ray's processes (the GCS, the raylet, ...) as the driver's children.
It polls every ``POLL_S`` whether its parent is still the driver, and notes
every process those started meanwhile (the raylet's workers and agents, found
through ``/proc``); once the driver is gone it kills them all, which
otherwise linger for minutes.  A driver that ends normally stops Ray itself and then
terminates the watchdog.

Limits: Linux (``/proc``); processes that left their parent's tree
(daemonized twice) are not found.
"""
from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5


def children_of(pids: set[int]) -> set[int]:
    """Every live descendant of ``pids`` (read from ``/proc/*/stat``)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), set(pids)
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier and p not in found}
        found |= frontier
    return found


def kill_tree(pids: set[int]) -> None:
    """SIGKILL ``pids`` and their descendants (children first found, then all at once)."""
    for pid in children_of(pids) | pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    driver, pids = int(argv[0]), {int(p) for p in argv[1:]}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the driver, which then stops Ray itself
    seen, me = set(pids), os.getpid()
    while os.getppid() == driver:
        # Ray starts more processes after ray.init (agents, workers): remember every one that ever
        # was below Ray's first processes, since killing the raylet orphans its children.
        seen |= children_of(pids | seen) - {me}
        time.sleep(POLL_S)
    kill_tree(seen)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
