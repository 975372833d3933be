"""Files written whole or not at all, never over the user's data: the one writer of towers and tools/.

The lowest layer of file output: it imports nothing of towers but ``towers.errors``, so the data
converters (``towers.data``), a run's output (``towers.output``) and the commands all write through it.

Atomic outputs
--------------
A run keeps every temporary file (the column spill files, the output being written) in one *owned
folder* beside the output (:func:`output_folder`), not in ``/tmp``: :func:`os.replace` is atomic only
within one file system, and ``/tmp`` is often a small tmpfs the spill would fill.

Ownership is proven by the kernel: the folder holds a lock file on which its run takes an exclusive
``flock`` (:func:`try_lock`) for its life.  The kernel drops the lock when the process ends, however it
ends, so the next run in the same folder removes exactly the folders whose lock it can take; a live
owner's folder is never touched, whatever its pid namespace or host (over NFS the server holds the lock).
The same lock proves a logdir's live run (``towers.output.logdir.lock_logdir``); the file holds nothing.
Limits: folders with our name but no lock file are left alone (a run killed between creating and locking
its folder leaves an empty one); without ``fcntl`` (Windows) nothing is removed; folders another user
owns are left to that user.

:func:`atomic_path` creates the partial output with ``O_CREAT | O_EXCL`` and mode 0o666, so the umask
gives it the mode ``open()`` would (not ``mkstemp``'s 0600).  When the caller has written it, the file
is fsynced, renamed over the output, and the output's folder fsynced so the rename survives a power cut:
readers see no output (or the old one) or the complete new one.

Sync points: those two fsyncs at the end of a successful write.  A failure or interruption anywhere (any
``BaseException``: Ctrl-C, a command line's SIGTERM) removes the owned folder.  ``writing(path)`` turns
an ``OSError`` (full disk or quota, read-only file system, I/O error) into a :class:`DiskError` naming
the file and what was being written, the one type for a failed write (exit status 1).
:func:`refuse_overwriting_inputs` stops an output that is one of the inputs.

npz files
---------
:func:`write_npz` writes each member of the zip archive as an ``.npy`` header followed by the raw bytes
of an :class:`ArrayBytes`, copied in blocks, so a 10 GB output costs a few MiB of memory (``numpy.savez``
needs every array in memory).  The result is an ordinary npz (ZIP64 where needed); members carry a fixed
timestamp, so identical arrays give byte-identical files (the byte-identical resume relies on it).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import zipfile

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no flock, so no proof of a dead owner
    fcntl = None

from towers.errors import TrainingError, UserError

_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: no wall clock in the bytes

LOCK = "lock"  # the one lock file (see "Write failures and the lock")
_TAG = ".tmp-"
_OWNED = re.compile(r"\..*\.tmp-\d+-[a-z0-9_]{8}\Z")  # mkdtemp's 8 random characters
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # disk full, quota exceeded


def refuse_overwriting_inputs(output, inputs):
    """Raise a ``UserError`` (status 2) if ``output`` is, by any path or link, one of ``inputs``.

    Files are compared by (st_dev, st_ino) after following symlinks, so
    another spelling, a symlink, a hard link and a glob match are all caught.
    Only stats files: call it before reading anything.
    """
    try:
        target = os.stat(output)
    except OSError:
        return  # no such file yet: it cannot be an input
    for path in inputs:
        with contextlib.suppress(OSError):
            if os.path.samestat(os.stat(path), target):
                raise UserError(f"{output} is the same file as the input {path}: writing it would destroy "
                                "the input; choose another output path")


def _full_disk(output, verb, exc):
    where = os.path.dirname(os.path.abspath(output))
    return DiskError(output, exc, verb, advice=f"free some space in {where} or choose another output folder")


def remove_stale(directory):
    """Remove owned folders in ``directory`` whose owner is dead (their lock is free); return their paths."""
    if fcntl is None:
        return []
    removed = []
    with os.scandir(directory) as entries:
        candidates = [e.path for e in entries if _OWNED.match(e.name) and e.is_dir(follow_symlinks=False)]
    for path in candidates:
        fd = None
        for name in (LOCK, ".owner.lock"):  # (.owner.lock: the name before version 0.2's one lock file)
            try:  # read-write: where flock is emulated by fcntl locks (NFS) an exclusive lock needs it
                fd = os.open(os.path.join(path, name), os.O_RDWR | os.O_NOFOLLOW)
                break
            except OSError:
                continue  # no lock file (not ours, or not yet locked) or not ours to open
        if fd is None:
            continue
        try:
            if try_lock(fd):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except OSError:
            pass  # no locks on this file system (ENOLCK): no proof the owner is dead, keep the folder
        finally:
            os.close(fd)
    return removed


def try_lock(fd: int) -> bool:
    """Take the exclusive lock on ``fd`` without waiting: False when a live process holds it."""
    try:
        if fcntl is not None:  # (Windows: no flock, so no proof of an owner)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def output_folder(output, removed=None, flag=None):
    """Yield a new owned folder beside ``output`` for all of a run's temporaries; remove it on exit.

    Dead runs' folders are removed first (their paths are appended to
    ``removed`` when a list is given).  An ENOSPC/EDQUOT raised in the body
    becomes a :class:`DiskError` naming ``output``.  ``flag``: the command-line
    option that names ``output``; a folder that cannot take the temporaries
    (read-only, no permission) is then the ``UserError`` of :func:`not_writable`,
    naming ``output``, not the hidden temporary folder.
    """
    directory = os.path.dirname(os.path.abspath(output))
    stale = remove_stale(directory)
    if removed is not None:
        removed += stale
    try:
        folder = tempfile.mkdtemp(prefix=f".{os.path.basename(output)[:100]}{_TAG}{os.getpid()}-", dir=directory)
    except OSError as exc:
        if flag is not None and exc.errno in NOT_WRITABLE:
            raise not_writable(output, exc, flag) from None
        raise
    lock = None
    try:
        lock = os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try_lock(lock)  # a new folder: nobody else can hold it (nobody asks who holds it: no pid written)
        yield folder
    except OSError as exc:
        if exc.errno in _FULL:
            raise _full_disk(output, "write the temporary files of", exc) from None
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the lock file goes too, while still held
        if lock is not None:
            os.close(lock)


@contextlib.contextmanager
def atomic_path(output, folder=None):
    """Yield a path in ``folder`` (an :func:`output_folder`) to write; on success it becomes ``output``.

    Without ``folder`` a new owned folder is made for this one file.  The
    file is created with the mode ``open()`` would give; it is fsynced before
    the rename and the output's folder after it.
    """
    if folder is None:
        with output_folder(output) as own, atomic_path(output, own) as path:
            yield path
        return
    partial = os.path.join(folder, "output.partial")
    try:
        os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        yield partial
        _fsync(partial, os.O_RDONLY)
        os.replace(partial, output)
        _fsync(os.path.dirname(os.path.abspath(output)), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        if exc.errno in _FULL:
            raise _full_disk(output, "write", exc) from None
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def _fsync(path, flags):
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- npz files ----------------------------------------------------------------------

_BLOCK = 8 << 20


class ArrayBytes:
    """An array to write: a dtype, a shape and where its C-order bytes come from.

    Either ``array`` (in memory) or ``path`` (a raw file of exactly
    ``prod(shape) * itemsize`` bytes, such as a column spill file).
    """

    def __init__(self, dtype, shape, path=None, array=None):
        self.dtype, self.shape, self.path, self.array = np.dtype(dtype), tuple(shape), path, array

    @classmethod
    def of(cls, array):
        array = np.asanyarray(array)
        array = array if array.flags.c_contiguous else array.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
        return cls(array.dtype, array.shape, array=array)

    def blocks(self):
        if self.array is not None:
            yield memoryview(self.array.reshape(-1).view(np.uint8))
            return
        expected = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        if expected == 0:
            return
        with open(self.path, "rb") as f:
            while expected > 0:
                block = f.read(min(_BLOCK, expected))
                if not block:
                    raise OSError(f"{self.path}: spill file is shorter than its array")
                expected -= len(block)
                yield block

    def load(self):
        """The whole array in memory (for small arrays and for tests)."""
        data = b"".join(bytes(b) for b in self.blocks())
        return np.frombuffer(data, self.dtype).reshape(self.shape)


class _Cutoff:
    """The file object a zip archive writes through; after :meth:`cut` every write goes nowhere.

    A write that fails or is interrupted (Ctrl-C, SIGTERM) leaves an archive
    that its caller throws away, but zipfile still finishes it: the open
    member and the archive write their headers when closed or collected, and
    ``ZipFile.close`` raises ``ValueError`` while a member is open -- which
    replaced the KeyboardInterrupt of a signal that landed inside a member's
    write.  Cut off, those late writes land nowhere (the position still
    moves, so zipfile's offsets stay valid) and cannot hide the first error.
    """

    def __init__(self, f):
        self._f, self._pos = f, 0

    def write(self, data):
        if self._f is not None:
            return self._f.write(data)
        n = memoryview(data).nbytes
        self._pos += n
        return n

    def tell(self):
        return self._f.tell() if self._f is not None else self._pos

    def seek(self, offset, whence=os.SEEK_SET):
        if self._f is not None:
            return self._f.seek(offset, whence)
        self._pos = offset if whence == os.SEEK_SET else self._pos + offset
        return self._pos

    def flush(self):
        if self._f is not None:
            self._f.flush()

    def cut(self):
        if self._f is not None:
            with contextlib.suppress(Exception):  # a closed or failing file: the position is lost, not needed
                self._pos = self._f.tell()
            self._f = None


class _Archive(zipfile.ZipFile):
    """A ZipFile that is quiet when collected: the one on which ``write_npz`` failed is thrown away.

    ``ZipFile.__del__`` closes the archive, which raises (printed as "Exception
    ignored") when an interruption left a member open, or landed inside
    ``ZipFile.__init__``.  A completed archive was closed already, so this
    ``__del__`` has nothing to do for it.
    """

    def __del__(self):
        with contextlib.suppress(Exception):
            super().__del__()


def write_npz(path, entries, compress=False):
    """Write ``entries``, ``(key, ArrayBytes or array)`` pairs, to the npz file ``path`` (or file object).

    Members carry a fixed timestamp, so equal arrays give byte-identical files.
    Any exception, a KeyboardInterrupt or another BaseException included,
    leaves the write as it is raised (the file is incomplete: write through
    :func:`atomic_path`, which removes it).
    """
    if not hasattr(path, "write"):
        with open(path, "wb") as f:
            write_npz(f, entries, compress)
        return
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    out = _Cutoff(path)
    try:
        # Not ``with ZipFile``: its close on the way out would write (or fail) after an error.
        archive = _Archive(out, "w", method, allowZip64=True)
        for key, source in entries:
            if not isinstance(source, ArrayBytes):
                source = ArrayBytes.of(np.asanyarray(source))
            if source.dtype.hasobject:
                raise ValueError(f"{key}: object arrays would need pickles, which npz files here never hold")
            header = {"descr": np.lib.format.dtype_to_descr(source.dtype), "fortran_order": False,
                      "shape": source.shape}
            info = zipfile.ZipInfo(key + ".npy", date_time=_ZIP_EPOCH)
            info.compress_type = method
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, header)
                for block in source.blocks():
                    member.write(block)
        archive.close()
    except BaseException:
        out.cut()
        raise


def atomic_write(path, write) -> None:
    """``write(f)`` fills a binary file object that becomes ``path`` only when complete."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)


def atomic_save_npz(path, arrays: dict) -> None:
    """Write ``arrays`` to ``path`` as an uncompressed, deterministic npz, atomically."""
    atomic_write(path, lambda f: write_npz(f, arrays.items()))


def atomic_write_text(path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


# -- a command's output file -------------------------------------------------------------

#: Errors that say the chosen folder cannot take a file (the user's choice: exit 2), not that the disk failed (exit 1).
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR)


def names_folder(out: str) -> bool:
    """Whether the path ``out`` can only name a folder (it ends with a separator, ``.`` or ``..``)."""
    return os.path.basename(out) in ("", ".", "..")


def check_new_output(out: str, command: str, flag: str, example: str = "out.npz") -> None:
    """A ``UserError`` unless ``out`` can be a new file: a path, not a folder, none there yet, in a folder that
    exists (or a ``UserError`` naming the file that stands where a folder of the path should be).

    Checked before the work that makes it (``command`` writes no file over
    another; it never asks to overwrite); ``flag`` is the option that names it,
    in the advice, and ``example`` a file name for the advice when ``out`` is a
    folder.  Every command that writes one output (``towers.export``,
    ``towers.eval --predict``, the converters) asks here.
    """
    if not out:
        raise UserError(f"{flag} is empty: give the output file's path")
    if os.path.isdir(out):
        raise UserError(f"{flag} {out} is a directory: give a file path, for example {os.path.join(out, example)}")
    if names_folder(out):  # new/ or new/.: a folder that is not there (yet)
        raise UserError(f"{flag} {out} names a folder, not a file: give a file path, for example "
                        f"{os.path.join(os.path.normpath(out), example)}")
    if os.path.lexists(out):
        raise UserError(f"{out} exists: {command} writes no file over another; remove it or choose another {flag}")
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(folder):
        try:
            limit = os.pathconf(folder, "PC_NAME_MAX")
        except (OSError, ValueError):  # a file system that does not say: the write names what fails
            return
        size = len(os.fsencode(os.path.basename(out)))
        if limit and size > limit:
            raise UserError(f"cannot write {out}: its name is {size} bytes, more than the {limit} that {folder} "
                            f"takes; choose a shorter {flag}")
        return
    blocker = folder
    while not os.path.lexists(blocker) and os.path.dirname(blocker) != blocker:
        blocker = os.path.dirname(blocker)  # the nearest part of the path that exists
    if os.path.isdir(blocker):
        raise UserError(f"cannot write {out}: {folder} does not exist; choose another {flag}")
    raise UserError(f"cannot write {out}: {blocker} is a file, not a folder; choose another {flag}")


def not_writable(out: str, error: OSError, flag: str) -> UserError:
    """The ``UserError`` for a folder that cannot take ``out`` (``NOT_WRITABLE``: read-only, no permission, gone):
    the user's choice of ``flag``, not a failed disk."""
    code = errno.errorcode.get(error.errno, "")
    folder = os.path.dirname(os.path.abspath(out))
    return UserError(f"cannot write {out}: {error.strerror or error} [{code}]: choose another {flag}, or make "
                     f"{folder} writable")


def write_new_output(out: str, write, flag: str) -> None:
    """``atomic_write(out, write)`` for a command's output named by ``flag``, its failures in one line each.

    A folder that cannot take the file (read-only, no permission, gone) is a
    ``UserError``; a full disk or an I/O error a ``DiskError``.  Either way no
    file and no temporary remain.
    """
    folder = os.path.dirname(os.path.abspath(out))
    try:
        atomic_write(out, write)
    except DiskError as e:  # a full disk or quota (``atomic_path`` names them), with this flag's advice
        raise DiskError(out, e.error, advice=f"free some space in {folder} or choose another {flag}") from None
    except OSError as e:
        if e.errno in NOT_WRITABLE:  # the folder the user chose cannot take a file: a user mistake
            raise not_writable(out, e, flag) from None
        raise DiskError(out, e, advice=f"check that disk, or choose another {flag}") from None  # EIO, EFBIG, ...


# -- write failures ---------------------------------------------------------------------


class DiskError(TrainingError):
    """Writing ``path`` failed with ``error`` (an OSError): disk full, read-only, I/O error.

    ``at(step, last_checkpoint)`` adds where training stopped and what is kept;
    ``advice`` replaces the run's advice (a converter's output, say).
    """

    def __init__(self, path: str, error: OSError, verb: str = "write", step: int | None = None,
                 kept: str | None = None, advice: str | None = None):
        self.path, self.error, self.verb, self.step, self.kept = path, error, verb, step, kept
        code = errno.errorcode.get(error.errno or 0)
        what = f"cannot {verb} {path}: {error.strerror or error}" + (f" [{code}]" if code else "")
        if advice is not None:
            advice = "; " + advice
        elif step is None:
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
