"""The record index of TFRecord files: where each record lies, what it holds, and its cache.

:func:`file_index` makes one pass over each file with the converter's reader
and parser (:class:`~towers.data.tfrecord.framing.TFRecordReader` checks the
framing and both CRCs, :class:`~towers.data.tfrecord.columns.ColumnStore`
parses every record) and records each record's byte offset and payload
length, the statistics of every feature, the values of every int64 feature
with one value per record (the label candidates: 8 bytes a record), and each
record's masked payload CRC (its footer, 4 bytes a record), and the class text
of TensorFlow's ImageNet layout (``image/class/text``, when every record has
one short text: the distinct texts and 4 bytes a record).  Memory is the
reader's 8 MiB chunk plus those arrays; the examples stay on disk.

The index is cached (``.NAME.towers-index.npz`` beside the file, else under
``$XDG_CACHE_HOME/towers``), keyed by the file's path, size and mtime_ns and
by ``on_error``, and rebuilt when any of them changes.  Size and mtime do not
prove the records are the same (``cp -p``, ``touch -d``, coarse timestamps,
and every MNIST record is 860 bytes), so a cached index is used only when the
footers of ``SPOT_CHECKS`` records spread over the file are the ones it holds
(a few 4-byte reads), and every record read later, by every path (raw
examples and encoded images alike), is checked against its indexed CRC by the
one record reader (:class:`~towers.data.tfrecord.gather.RecordReader`): a
record's bytes are never paired with another record's label.  The reader that
meets a record not indexed forgets the cached index (:func:`forget_index`), so
the next run indexes the file anew.  A file that changes while it is indexed
(still being written) is a one-line error.  With ``on_error="skip"`` records
whose payload CRC fails are left out of the index and counted.

Limits: gzip/zlib files cannot be read at random and are refused with a
one-line error that says how to convert them.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os

import numpy as np

from towers.data.inputs import expand_inputs
from towers.data.tfrecord.columns import ColumnStats, ColumnStore
from towers.data.tfrecord.framing import FOOTER, HEADER, TFRecordError, TFRecordReader, header_intact
from towers.errors import UserError
from towers.files import DiskError, atomic_save_npz

INDEX_FORMAT = 3  # 2: the records' CRCs; 3: the class texts
# The bytes feature that names each record's class in TensorFlow's ImageNet layout (``build_imagenet_data.py``;
# ``towers.data.image.to_tfrecord`` writes a folder's class names there): kept as a record's text.
CLASS_TEXT = "image/class/text"
ON_ERROR = ("stop", "skip")
SPOT_CHECKS = 64  # records whose footers a cached index must still match, spread over the file


# -- the index ---------------------------------------------------------------------------------------------


class FileIndex:
    """One file's records: ``offsets``, ``lengths`` (payload bytes), ``numbers`` (record index in the file) and
    ``crcs`` (masked payload CRCs, uint32), the features' :class:`ColumnStats` by name, the label candidates'
    values by name, ``texts`` (``CLASS_TEXT``, when every record has one short text: name -> (the distinct
    texts, each record's int32 number among them)), and ``skipped``."""

    def __init__(self, path, offsets, lengths, numbers, crcs, columns, scalars, skipped, texts=None):
        self.path, self.offsets, self.lengths, self.numbers, self.crcs = path, offsets, lengths, numbers, crcs
        self.columns, self.scalars, self.skipped, self.texts = columns, scalars, skipped, texts or {}


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
    store = ColumnStore(None, keep_scalars=True, keep_texts=(CLASS_TEXT,))
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
                     kept, reader.skipped, _texts(store))


def _texts(store) -> dict:
    """name -> (distinct texts, int32 number of each record's) of the kept text features with one text in every
    record (``ColumnStore.keep_texts``)."""
    out = {}
    for name in store.keep_texts:
        c = store.context.get(name)
        if c is None or c.values is None or c.values.parts is None or c.present_count != store.rows \
                or c.min_count != 1 or c.max_count != 1:
            continue
        data, ends = c.values.array().tobytes(), np.cumsum(c.value_lengths.array())
        texts = [data[a:b].decode("utf-8", "replace") for a, b in zip(np.concatenate(([0], ends[:-1])), ends)]
        table, numbers = np.unique(np.array(texts, dtype=object).astype(str), return_inverse=True)
        out[name] = (table.tolist(), numbers.astype(np.int32).reshape(-1))
    return out


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
            texts = {name: (table, z["text/" + name]) for name, table in meta["texts"].items()}
            return FileIndex(stamp["path"], z["offsets"], z["lengths"], z["numbers"], z["crcs"],
                             {c["key"]: ColumnStats.from_dict(c) for c in meta["columns"]}, scalars,
                             meta["skipped"], texts)
    except (OSError, ValueError, KeyError):
        return None  # absent, stale format or damaged: build it again


def _write_cached(index, stamp, caches) -> None:
    meta = {"stamp": stamp, "skipped": index.skipped, "columns": [c.as_dict() for c in index.columns.values()],
            "texts": {name: table for name, (table, _) in index.texts.items()}}
    arrays = {"meta": np.array(json.dumps(meta)), "offsets": index.offsets, "lengths": index.lengths,
              "numbers": index.numbers, "crcs": index.crcs, **{"scalar/" + k: v for k, v in index.scalars.items()},
              **{"text/" + k: numbers for k, (_, numbers) in index.texts.items()}}
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


def positions(indexes):
    """(file numbers, offsets, payload lengths, record numbers, CRCs) of every record of ``indexes``, in order:
    what the record reader needs to find a record and check that it is the one indexed."""
    files = np.concatenate([np.full(len(i.offsets), k, np.int64) for k, i in enumerate(indexes)])
    columns = ("offsets", "lengths", "numbers", "crcs")
    return (files, *(np.concatenate([getattr(i, a) for i in indexes]) for a in columns))
