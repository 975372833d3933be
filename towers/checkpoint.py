"""Checkpoint files: npz archives written atomically.

A write goes to a temporary file in the same directory, is flushed and fsynced,
renamed over the target, and the directory is fsynced: a crash at any moment
leaves either the old file or the complete new one, never a torn file.
"""
from __future__ import annotations

import os
import tempfile

import numpy


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
    """Write ``arrays`` to ``path`` as an uncompressed npz, atomically."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            numpy.savez(f, **arrays)
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


def weights_to_host(replica) -> dict[str, numpy.ndarray]:
    """Named float32 host copies of a replica's parameters (a sync point on GPU)."""
    return {name: _host(view) for name, view in replica.param.items()}


def flat_to_named(model, flat) -> dict[str, numpy.ndarray]:
    """Split a flat buffer into named host arrays using the model's layout."""
    host = _host(flat)
    return {name: host[off : off + size].reshape(shape) for name, shape, off, size in model.layout()}


def named_to_flat(model, named: dict) -> numpy.ndarray:
    """Inverse of ``flat_to_named``: a host float32 flat buffer."""
    flat = numpy.empty(model.size, dtype=numpy.float32)
    for name, shape, off, size in model.layout():
        flat[off : off + size] = numpy.asarray(named[name], dtype=numpy.float32).reshape(-1)
    return flat


def _host(a) -> numpy.ndarray:
    return a.get() if hasattr(a, "get") else numpy.array(a, copy=True)
