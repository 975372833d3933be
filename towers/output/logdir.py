"""One live run per logdir: the logdir's lock file, held by its run for the run's life.

The lock is the one of ``towers.files`` ("Write failures and the lock"): an
``flock`` on the file ``lock``, which the kernel drops when the process dies,
however it dies.  A logdir's lock file holds its owner's pid and host, for the
message a second run gets, and is never deleted: unlinking a lock file lets a
third process lock a new inode while the second still holds the old one.
"""
from __future__ import annotations

import os
import socket
import time

from towers.errors import UserError
from towers.files import LOCK, try_lock, writing


def lock_logdir(logdir: str) -> int:
    """Lock ``logdir`` for this process; the lock file's descriptor (close it to release).

    A logdir locked by a live process is a ``UserError`` naming that process; a
    lock file that cannot be written is a ``DiskError``.
    """
    path = os.path.join(logdir, LOCK)
    with writing(path):
        # Not O_TRUNC: the owner's pid stays readable until the lock is ours.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        if not try_lock(fd):
            raise UserError(f"`logdir` {logdir} is in use by another run ({_owner(fd)}, see {path}): "
                            "wait for it to end, or choose another `logdir`")
        with writing(path):
            _claim(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _owner(fd: int, wait: float = 1.0) -> str:
    """'pid N on host H' from a held lock file (its owner may not have written it yet)."""
    deadline = time.monotonic() + wait
    while True:
        words = os.pread(fd, 256, 0).decode(errors="replace").split()
        if words or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if not words:
        return "pid unknown"
    return f"pid {words[0]}" + (f" on host {words[1]}" if len(words) > 1 else "")


def _claim(fd: int) -> None:
    """Write this process's pid and host into the held lock file ``fd`` (for the message a second owner gets)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
