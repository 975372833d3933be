"""Training straight from TFRecord files: a record index, its cache, and parse workers behind an array.

Uncompressed TFRecord files are read at random, so training from them shuffles
exactly as training from an npz does (a seeded permutation of all records of
all shards per epoch, ``towers.data.batches``) and gives the same weights as
training from the file's ``tools.tfrecord_to_npz`` conversion.

1. **Index** (:func:`file_index`): one pass over each file with the
   converter's reader and parser (:class:`~towers.data.tfrecord.framing.TFRecordReader`
   checks the framing and both CRCs, :class:`~towers.data.tfrecord.columns.ColumnStore`
   parses every record) records each record's byte offset and payload length,
   the statistics of every feature, and the values of every int64 feature with
   one value per record (the label candidates: 8 bytes a record), and each
   record's masked payload CRC (its footer, 4 bytes a record).  Memory is
   the reader's 8 MiB chunk plus those arrays; the examples stay on disk.  The
   index is cached (``.NAME.towers-index.npz`` beside the file, else under
   ``$XDG_CACHE_HOME/towers``), keyed by the file's path, size and mtime_ns and
   by ``on_error``, and rebuilt when any of them changes.  Size and mtime do not
   prove the records are the same (``cp -p``, ``touch -d``, coarse timestamps,
   and every MNIST record is 860 bytes), so a cached index is used only when
   the footers of ``SPOT_CHECKS`` records spread over the file are the ones it
   holds (a few 4-byte reads), and every record read later is checked against
   its indexed CRC too (:class:`~towers.data.tfrecord.gather.IndexStale`):
   a record's bytes are never paired with another record's label.  A file that
   changes while it is indexed (still being written) is a one-line error.  With
   ``on_error="skip"`` records whose payload CRC fails are left out of the
   index and counted.
2. **Features** (:func:`load_split`): the examples are ``x_key`` (a bytes
   feature read as ``decode``'s dtype and shape, or a dense bytes/float
   feature), the labels ``y_key`` (int64, one per record); a missing or
   ambiguous choice is a one-line error listing the features.
3. **Reading** (:class:`RecordArray`): an array-like (``shape``, ``dtype``,
   ``len``, ``x[index array]``, ``x[a:b]``) whose ``submit(indices)`` reads one
   global batch, in the calling thread (``workers=0``, the input thread) or in
   a pool of worker processes.  Either way a
   :class:`~towers.data.tfrecord.gather.Gatherer` turns the positions into the
   examples array: one gather from the mapped files, every CRC checked, and
   the protobuf parse skipped for records whose layout it has already seen
   parse.  The caller only waits for the result (``result()``, a sync point).
   Memory is bounded by the batches in flight
   (``towers.data.batches.Prefetcher``) and by the Gatherer's window of mapped
   pages, whatever the file size.

Limits: gzip/zlib files cannot be read at random and are refused with a
one-line error that says how to convert them.  Only context features are read
(not feature lists).  A record damaged or replaced after its file was indexed
(same size and mtime) and missed by the spot check stops the run when a batch
meets it: a ``TrainingError`` with the converter's one-line report (for a
replaced record the cached index is removed, so the next run indexes the
file anew); ``on_error="skip"`` drops damaged records only when the index is
built.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import signal
import threading
import weakref

import numpy as np

from towers.data.dataset import OnDemand
from towers.data.tfrecord.columns import ColumnStats, ColumnStore
from towers.data.inputs import expand_inputs
from towers.data.orphans import watch_parent
from towers.data.spawning import spawn_context
from towers.data.tfrecord.framing import FOOTER, HEADER, TFRecordError, TFRecordReader, header_intact
from towers.data.tfrecord.gather import Gatherer, IndexStale
from towers.data.tfrecord.proto import KIND_FLOAT
from towers.data.tfrecord.schema import UsageError, decoded_shape, parse_decode
from towers.errors import TrainingError, UserError
from towers.output.files import DiskError, atomic_save_npz

INDEX_FORMAT = 2  # 2: the records' CRCs
ON_ERROR = ("stop", "skip")
SPOT_CHECKS = 64  # records whose footers a cached index must still match, spread over the file



# -- the index ---------------------------------------------------------------------------------------------


class FileIndex:
    """One file's records: ``offsets``, ``lengths`` (payload bytes), ``numbers`` (record index in the file) and
    ``crcs`` (masked payload CRCs, uint32), the features' :class:`ColumnStats` by name, the label candidates'
    values by name, and ``skipped``."""

    def __init__(self, path, offsets, lengths, numbers, crcs, columns, scalars, skipped):
        self.path, self.offsets, self.lengths, self.numbers, self.crcs = path, offsets, lengths, numbers, crcs
        self.columns, self.scalars, self.skipped = columns, scalars, skipped


def _stamp(path, on_error):
    st = os.stat(path)
    return {"format": INDEX_FORMAT, "path": os.path.abspath(path), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "on_error": on_error}


def build_index(path, on_error="stop") -> FileIndex:
    """One pass over ``path``: framing, both CRCs and the protobuf parse, as the converter does."""
    reader = TFRecordReader(path, "auto", on_error)
    if reader.compression != "none":
        raise UserError(
            f"{path} is {reader.compression}-compressed: training reads records at random, which a compressed "
            f"stream cannot give; decompress it first ("
            + ("gzip -dc FILE > FILE.tfrecords, or " if reader.compression == "gzip" else "")
            + "python -m tools.tfrecord_to_npz FILE -o FILE.npz --decode ... and train from the npz)")
    store = ColumnStore(None, keep_scalars=True)
    offsets, lengths, numbers, crcs = [], [], [], []
    for batch in reader:
        store.add(batch, path)
        offsets += batch.offsets
        lengths += map(len, batch.payloads)
        numbers += batch.indices
        crcs += batch.crcs
    kept = {name: c.values.array() for name, c in store.context.items()
            if c.values is not None and c.values.parts is not None and c.dense_shape(store.rows) == (store.rows,)}
    return FileIndex(path, np.array(offsets, np.int64), np.array(lengths, np.int64), np.array(numbers, np.int64),
                     np.array(crcs, np.uint32),
                     {name: ColumnStats.from_dict(c.as_dict()) for name, c in store.context.items()},
                     kept, reader.skipped)


def index_cache_paths(path):
    """Where the index of ``path`` is cached: beside it, else in the user's cache folder."""
    folder, name = os.path.split(os.path.abspath(path))
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    return [os.path.join(folder, f".{name}.towers-index.npz"),
            os.path.join(home, "towers", "tfrecord-index", f"{name}.{digest}.npz")]


def _read_cached(cache, stamp):
    try:
        with np.load(cache, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta["stamp"] != stamp:
                return None
            scalars = {k[len("scalar/"):]: z[k] for k in z.files if k.startswith("scalar/")}
            return FileIndex(stamp["path"], z["offsets"], z["lengths"], z["numbers"], z["crcs"],
                             {c["key"]: ColumnStats.from_dict(c) for c in meta["columns"]}, scalars,
                             meta["skipped"])
    except (OSError, ValueError, KeyError):
        return None  # absent, stale format or damaged: build it again


def _write_cached(index, stamp, caches) -> None:
    meta = {"stamp": stamp, "skipped": index.skipped, "columns": [c.as_dict() for c in index.columns.values()]}
    arrays = {"meta": np.array(json.dumps(meta)), "offsets": index.offsets, "lengths": index.lengths,
              "numbers": index.numbers, "crcs": index.crcs, **{"scalar/" + k: v for k, v in index.scalars.items()}}
    for cache in caches:
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            atomic_save_npz(cache, arrays)
            return
        except (OSError, DiskError):  # DiskError: a full disk, reported by the atomic writer
            continue  # a read-only or full data folder: try the next place; without any, index every run


def _spot_check(index) -> bool:
    """Whether the footers of ``SPOT_CHECKS`` records spread over the file are still the index's CRCs.

    One 4-byte read each: a file rewritten in another order with the same
    size and mtime fails it (unless the records sampled did not move);
    records changed elsewhere are caught when they are read.
    """
    n = len(index.offsets)
    picks = np.unique(np.linspace(0, n - 1, min(n, SPOT_CHECKS)).astype(np.int64)) if n else []
    fd = os.open(index.path, os.O_RDONLY)
    try:
        for i in picks:
            at = int(index.offsets[i]) + HEADER + int(index.lengths[i])
            if int.from_bytes(os.pread(fd, FOOTER, at), "little") != int(index.crcs[i]):
                return False
    finally:
        os.close(fd)
    return True


def forget_index(path) -> None:
    """Remove the cached indexes of ``path`` (its records are not the ones indexed): the next run rebuilds."""
    for cache in index_cache_paths(path):
        with contextlib.suppress(OSError):
            os.unlink(cache)


def file_index(path, on_error="stop", say=None) -> FileIndex:
    """The index of ``path``, from its cache when the file has not changed since, else built (and cached)."""
    stamp = _stamp(path, on_error)
    caches = index_cache_paths(path)
    for cache in caches:
        index = _read_cached(cache, stamp)
        if index is not None and _spot_check(index):
            return index
        if index is not None:
            if say:
                say(f"{path} holds other records than when it was indexed (same size and modification time): "
                    "indexing it again")
            break
    if say and _framed(path):  # else build_index says what the file is, with no "indexing" before it
        say(f"indexing {path} ({stamp['size']:,} bytes; cached for the next runs)")
    try:
        index = build_index(path, on_error)
    except TFRecordError:
        _unchanged_since(path, on_error, stamp)  # a file still being written says so, not "truncated"
        raise
    if _stamp(path, on_error) == stamp:  # not if the file changed while it was read
        _write_cached(index, stamp, caches)
    return index


def _framed(path) -> bool:
    """Whether ``path`` is empty or starts with an intact TFRecord header (not a PNG, not compressed)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER)
    except OSError:
        return True  # build_index names the problem
    return not head or header_intact(head)


def _unchanged_since(path, on_error, stamp) -> None:
    """A UserError if ``path`` is no longer as ``stamp`` saw it when indexing began."""
    try:
        now = _stamp(path, on_error)
    except OSError as e:
        raise UserError(f"{path} changed while it was being indexed ({e.strerror or e}): run again once nothing "
                        "writes it any more") from None
    if now != stamp:
        grew = (f"{stamp['size']:,} bytes when indexing began, {now['size']:,} now" if now["size"] != stamp["size"]
                else "its modification time moved")
        raise UserError(f"{path} changed while it was being indexed ({grew}): is it still being written? Run "
                        "again once it is complete")


# -- choosing the features ----------------------------------------------------------------------------------


def _merged(indexes):
    """Feature name -> ColumnStats over all files (the same feature must keep its kind)."""
    out = {}
    for index in indexes:
        for name, c in index.columns.items():
            m = out.get(name)
            if m is None:
                out[name] = ColumnStats.from_dict(c.as_dict())
                continue
            if c.kind is not None and m.kind is not None and c.kind != m.kind:
                raise UserError(f"{index.path}: feature {name!r} is {c.kind_name} here but {m.kind_name} in "
                                "earlier files; a feature must keep one kind")
            m.kind = m.kind if m.kind is not None else c.kind
            m.present_count += c.present_count
            for stat, pick in (("min_count", min), ("max_count", max), ("min_bytes", min), ("max_bytes", max)):
                values = [v for v in (getattr(m, stat), getattr(c, stat)) if v is not None]
                setattr(m, stat, pick(values) if values else None)
    return out


def _listing(columns, n):
    return "; ".join(f"{name} ({c.describe(n)})" for name, c in sorted(columns.items())) or "none"


def _choose(where, columns, n, key, default, candidates, what, setting):
    """The feature called ``key``, or with the default name absent, the one candidate."""
    key = key[len("context/"):] if key.startswith("context/") else key
    if key in columns:
        return key
    if key == default and len(candidates) == 1:
        return candidates[0]
    why = (f"no feature {key!r}" if key != default or not candidates
           else f"no feature {key!r} and {len(candidates)} candidates ({', '.join(sorted(candidates))})")
    raise UsageError(f"{where}: {why} for the {what}; pick one with `{setting}` from the features: "
                     f"{_listing(columns, n)}")


def index_split(path, on_error="stop", say=None):
    """(indexes, record count, merged features) of the TFRecord file or glob ``path``; a UserError when a file
    is damaged or there are no records."""
    if on_error not in ON_ERROR:
        raise UserError(f"`on_error` {on_error!r} is unknown: use one of {', '.join(ON_ERROR)}")
    paths = expand_inputs([path])
    try:
        indexes = [file_index(p, on_error, say) for p in paths]
    except TFRecordError as e:
        raise UserError(str(e)) from None
    skipped = sum(i.skipped for i in indexes)
    if skipped and say:
        say(f"{path}: left out {skipped} record(s) whose payload CRC fails (`on_error` skip)")
    n = sum(len(i.offsets) for i in indexes)
    if n == 0:
        raise UserError(f"{path}: the dataset is empty (no records)")
    return indexes, n, _merged(indexes)


def load_split(path, x_key="x", y_key="y", decode=None, on_error="stop", workers=2, say=None):
    """(RecordArray of examples, int32 labels) of the TFRecord file or glob ``path``."""
    indexes, n, columns = index_split(path, on_error, say)
    spec = parse_decode(decode) if decode else None
    x_candidates = [spec[0]] if spec and spec[0] in columns else [
        k for k, c in columns.items() if c.fixed_bytes(n) or (c.kind == KIND_FLOAT and c.dense_shape(n))]
    xname = _choose(path, columns, n, x_key, "x", x_candidates, "examples", "x_key")
    y_candidates = [k for k, c in columns.items() if all(k in i.scalars for i in indexes) and k != xname]
    yname = _choose(path, columns, n, y_key, "y", y_candidates, "labels", "y_key")
    x_column = columns[xname]
    if spec and spec[0] != xname:
        raise UsageError(f"`decode` {decode} names {spec[0]!r} but the examples are {xname!r}: decode the "
                         "examples' feature, or pick it with `x_key`")
    if spec:
        dtype, shape = spec[1], decoded_shape(x_column, n, spec[1], spec[2], decode)
        if dtype != np.uint8 and dtype.kind != "f":
            raise UsageError(f"`decode` {decode}: examples are uint8 pixels or floats, not {dtype}")
    elif x_column.fixed_bytes(n):
        dtype, shape = np.dtype(np.uint8), (x_column.fixed_bytes(n),)
    elif x_column.kind == KIND_FLOAT and x_column.dense_shape(n):
        dtype, shape = np.dtype(np.float32), (x_column.min_count,)
    else:
        raise UsageError(f"{path}: feature {xname!r} ({x_column.describe(n)}) cannot be examples: give one "
                         "string of fixed length per record with `decode`, or a fixed-length float feature")
    if not all(yname in i.scalars for i in indexes):
        raise UsageError(f"{path}: feature {yname!r} ({columns[yname].describe(n)}) cannot be labels: "
                         "labels are one int64 per record")
    y = np.concatenate([i.scalars[yname] for i in indexes])
    if y.min() < 0 or y.max() > np.iinfo(np.int32).max:
        raise UsageError(f"{path}: labels in {yname!r} run from {int(y.min())} to {int(y.max())}; "
                         "labels are 0..C-1")
    x = RecordArray(path, indexes, xname, x_column.kind, dtype, shape, workers)
    return x, y.astype(np.int32)


# -- reading batches in worker processes ---------------------------------------------------------------------


_READER = None  # the worker process's reader


def _start_worker(*args):
    global _READER
    # Ctrl-C reaches the whole process group: the main process stops the run
    # and then these workers; a worker raising KeyboardInterrupt itself would
    # print its own traceback and could leave the pool hanging.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent()  # and end with the main process, even after its kill -9
    _READER = Gatherer(*args)


def _read_in_worker(*args):
    return _READER.read(*args)


class _Result:
    """A batch of examples being read: ``result()`` waits for it and reports damage as a TrainingError."""

    def __init__(self, future):
        self._future = future

    def result(self):
        try:
            return self._future.result()
        except IndexStale as e:
            forget_index(e.path)  # the next run indexes the file anew
            raise TrainingError(f"{e}") from None
        except TFRecordError as e:
            raise TrainingError(f"{e}") from None
        except concurrent.futures.process.BrokenProcessPool:
            raise TrainingError("an input worker process died (out of memory? killed?); "
                                "resume from the last checkpoint with `resume`") from None


class RecordArray(OnDemand):
    rows = "records"

    """The examples of TFRecord files, read on demand: ``shape``, ``dtype``, ``len``, ``x[indices]``, ``x[a:b]``.

    ``submit(indices)`` starts reading those records (global row numbers, any
    order) in the worker pool and returns an object whose ``result()`` is the
    ``(len(indices), *shape)`` array.  ``workers=0`` reads in the calling
    thread.  The pool starts on the first read and ends with :meth:`close`
    (or when the array is collected).
    """

    def __init__(self, name, indexes, feature, kind, dtype, shape, workers=2):
        self.name, self.workers = name, int(workers)
        self._paths = [i.path for i in indexes]
        self._files = np.concatenate([np.full(len(i.offsets), k, np.int32) for k, i in enumerate(indexes)])
        self._offsets = np.concatenate([i.offsets for i in indexes])
        self._lengths = np.concatenate([i.lengths for i in indexes])
        self._numbers = np.concatenate([i.numbers for i in indexes])
        self._crcs = np.concatenate([i.crcs for i in indexes])
        self._spec = (self._paths, feature, kind, np.dtype(dtype).str, tuple(shape))
        self._reader = Gatherer(*self._spec)
        self.dtype = self._reader.out_dtype
        self.shape = (len(self._offsets),) + tuple(shape)
        self.ndim = len(self.shape)
        self._pool = None
        self._finalizer = None
        self._pool_lock = threading.Lock()  # the input thread and the main thread may both start it

    def __len__(self):
        return self.shape[0]

    def __getstate__(self):
        # Pickled to other processes (Ray hosts): the positions and the spec
        # travel; this process's worker pool and open descriptors do not.
        state = dict(self.__dict__, _pool=None, _finalizer=None)
        state["_reader"] = state["_pool_lock"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reader = Gatherer(*self._spec)
        self._pool_lock = threading.Lock()

    def submit(self, indices):
        idx = np.asarray(indices, np.int64)
        args = (self._files[idx], self._offsets[idx], self._lengths[idx], self._numbers[idx], self._crcs[idx])
        if self.workers > 0:
            return _Result(self._executor().submit(_read_in_worker, *args))
        done = concurrent.futures.Future()  # read here and now, reported as a worker's read would be
        try:
            done.set_result(self._reader.read(*args))
        except TFRecordError as e:
            done.set_exception(e)
        return _Result(done)

    def _executor(self):
        with self._pool_lock:
            if self._pool is None:
                # spawn, not fork: the trainer's threads (towers, input, BLAS) must not be forked mid-flight.
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self.workers, spawn_context(), _start_worker, self._spec)
                self._finalizer = weakref.finalize(self, self._pool.shutdown, False, cancel_futures=True)
            return self._pool

    def close(self) -> None:
        """Stop the worker processes and close the files read in this process (a later read reopens)."""
        try:
            self._reader.close()
        finally:
            with self._pool_lock:
                pool, self._pool = self._pool, None
                if pool is not None:
                    self._finalizer.detach()
                    pool.shutdown(wait=True, cancel_futures=True)
