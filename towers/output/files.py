"""Files in the logdir: written whole or not at all, write failures as one error, the logdir lock.

``atomic_write(path, write)``: ``write(f)`` fills a temporary file in the same
directory, which is flushed and fsynced, renamed over ``path``, and the
directory is fsynced.  A crash (even SIGKILL) at any moment leaves the old file
or the complete new one, never a torn one; an exception removes the temporary.
The file gets the mode a plain ``open`` would give (0666 less the umask), not
``mkstemp``'s 0600.

npz members get a fixed timestamp, so equal arrays give byte-identical files.

``writing(path)`` turns an ``OSError`` (a full disk, a read-only filesystem, an
I/O error) into a ``DiskError`` naming the file and the OS error, which the
command line prints as one line.

``lock_logdir(logdir)``: a logdir belongs to one live run.  The lock is an
``flock`` on ``<logdir>/lock``, held for the run's life; the kernel drops it
when the process dies, however it dies, so a dead run's lock file never blocks.
The file holds the owner's pid and host, for the message a second run gets.
The file is never deleted: unlinking a lock file lets a third process lock a
new inode while the second still holds the old one.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import tempfile
import time
import zipfile

import numpy

from towers.errors import TrainingError, UserError

_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: no wall clock in the bytes


def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (a no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save_npz(path: str, arrays: dict) -> None:
    """Write ``arrays`` to ``path`` as an uncompressed, deterministic npz, atomically."""
    atomic_write(path, lambda f: _write_npz(f, arrays))


def atomic_write_text(path: str, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def _write_npz(f, arrays: dict) -> None:
    # numpy.savez stamps each member with the current time; a fixed stamp makes
    # the file a function of the arrays alone (byte-identical resume test).
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=_ZIP_EPOCH)
            with zf.open(info, "w", force_zip64=True) as member:
                numpy.lib.format.write_array(member, numpy.asanyarray(value), allow_pickle=False)


def atomic_write(path: str, write) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp's 0600 would hide it from other readers
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it: put it straight back
    os.umask(mask)
    return mask


# -- write failures ---------------------------------------------------------------------


class DiskError(TrainingError):
    """Writing ``path`` failed with ``error`` (an OSError): disk full, read-only, I/O error.

    ``at(step, last_checkpoint)`` adds where training stopped and what is kept.
    """

    def __init__(self, path: str, error: OSError, verb: str = "write", step: int | None = None,
                 kept: str | None = None):
        self.path, self.error, self.verb, self.step, self.kept = path, error, verb, step, kept
        code = errno.errorcode.get(error.errno or 0)
        what = f"cannot {verb} {path}: {error.strerror or error}" + (f" [{code}]" if code else "")
        if step is None:
            advice = "; free space on its disk or make `logdir` writable, then run again"
        else:
            keep = f"the last complete checkpoint is {kept}" if kept else "no checkpoint was written"
            advice = (f"; training stopped at step {step} ({keep}): free space on its disk or make "
                      "`logdir` writable, then `resume`")
        super().__init__(what + advice)

    def at(self, step: int, kept: str | None) -> "DiskError":
        return DiskError(self.path, self.error, self.verb, step, kept)


@contextlib.contextmanager
def writing(path: str, verb: str = "write"):
    """Within it, an OSError becomes a ``DiskError`` naming ``path``."""
    try:
        yield
    except OSError as e:
        raise DiskError(path, e, verb) from None


# -- one live run per logdir ---------------------------------------------------------------

LOCK = "lock"


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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"`logdir` {logdir} is in use by another run ({_owner(fd)}, see {path}): "
                            "wait for it to end, or choose another `logdir`") from None
        with writing(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
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
