"""Files written whole or not at all: the atomic writer and the deterministic npz writer.

``atomic_write(path, write)``: ``write(f)`` fills a temporary file in the same
directory, which is flushed and fsynced, renamed over ``path``, and the
directory is fsynced.  A crash (even SIGKILL) at any moment leaves the old file
or the complete new one, never a torn one; an exception removes the temporary.
The file gets the mode a plain ``open`` would give (0666 less the umask), not
``mkstemp``'s 0600.

npz members get a fixed timestamp, so equal arrays give byte-identical files.
"""
from __future__ import annotations

import os
import tempfile
import zipfile

import numpy

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
