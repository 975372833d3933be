"""Training straight from TFRecord files: the features chosen, and the records as an examples array.

Uncompressed TFRecord files are read at random, so training from them shuffles
exactly as training from an npz does (a seeded permutation of all records of
all shards per epoch, ``towers.data.batches``) and gives the same weights as
training from the file's ``tools.tfrecord_to_npz`` conversion.

1. **Index** (``towers.data.tfrecord.index``): each record's position, its
   CRC and the label candidates, cached and spot-checked.
2. **Features** (:func:`load_split`): the examples are ``x_key`` (a bytes
   feature read as ``decode``'s dtype and shape, or a dense bytes/float
   feature), the labels ``y_key`` (int64, one per record); a missing or
   ambiguous choice is a one-line error listing the features.
3. **Reading** (:func:`record_examples`): the one examples array
   (``towers.data.examples.Examples``) over a ``Gather`` job, whose
   ``submit(indices)`` reads one global batch, in the calling thread
   (``workers=0``, the input thread) or in the input workers
   (``towers.data.workers``: the one pool, which decodes and augments images
   too).  Either way its source
   (``towers.data.sources.RawRecordSource``) has a
   :class:`~towers.data.tfrecord.gather.Gatherer` turn the positions into the
   examples, written straight into the batch's shared memory: one gather from
   the mapped files, every CRC checked (framing, payload, and the record
   against its index), and the protobuf parse skipped for records whose
   layout it has already seen parse.  The caller only waits for the result
   (``result()``, a sync point).  Memory is bounded by the batches in flight
   (``towers.data.batches.Prefetcher``) and by the Gatherer's window of mapped
   pages, whatever the file size.

Limits: only context features are read (not feature lists).  A record
damaged or replaced after its file was indexed (same size and mtime) and
missed by the spot check stops the run when a batch meets it: a
``TrainingError`` with the converter's one-line report (for a replaced record
the cached index is removed, so the next run indexes the file anew);
``on_error="skip"`` drops damaged records only when the index is built.
Each worker holds the record positions (36 bytes a record).
"""
from __future__ import annotations

import numpy as np

from towers.data.examples import Examples
from towers.data.sources import RawRecordSource, RecordSource
from towers.data.jobs import Gather
from towers.data.workers import Workers
from towers.data.tfrecord.index import (  # noqa: F401  (file_index, index_cache_paths: the index's API, here too)
    CLASS_TEXT, file_index, index_cache_paths, index_split, positions)
from towers.data.tfrecord.proto import KIND_BYTES, KIND_FLOAT
from towers.data.tfrecord.schema import UsageError, decoded_shape, parse_decode


# -- choosing the features ----------------------------------------------------------------------------------


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


def label_feature(path, x_key="x", y_key="y", on_error="stop", say=None) -> str | None:
    """The feature ``load_split`` takes the labels of the TFRecord file or glob ``path`` from (``y_key``, else the
    one int64 scalar feature besides the examples'), or None: the records hold no labels (no ``y_key``, and for
    the default ``y`` no int64 scalar feature either).  Several candidates for the default are the
    ``UsageError`` that ``load_split`` gives: records with labels, which it cannot tell."""
    indexes, n, columns = index_split(path, on_error, say)
    x = x_key[len("context/"):] if x_key.startswith("context/") else x_key
    candidates = [k for k, c in columns.items() if all(k in i.scalars for i in indexes) and k != x]
    try:
        return _choose(path, columns, n, y_key, "y", candidates, "labels", "y_key")
    except UsageError:
        if y_key == "y" and len(candidates) > 1:
            raise
        return None


def load_split(path, x_key="x", y_key="y", decode=None, on_error="stop", workers=2, say=None):
    """(examples read on demand, ``record_examples``; int32 labels) of the TFRecord file or glob ``path``;
    ``y_key`` None: records without labels (the labels are zeros)."""
    indexes, n, columns = index_split(path, on_error, say)
    spec = parse_decode(decode) if decode else None
    x_candidates = [spec[0]] if spec and spec[0] in columns else [
        k for k, c in columns.items() if c.fixed_bytes(n) or (c.kind == KIND_FLOAT and c.dense_shape(n))]
    xname = _choose(path, columns, n, x_key, "x", x_candidates, "examples", "x_key")
    y_candidates = [k for k, c in columns.items() if all(k in i.scalars for i in indexes) and k != xname]
    yname = None if y_key is None else _choose(path, columns, n, y_key, "y", y_candidates, "labels", "y_key")
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
    y = np.zeros(n, np.int32) if yname is None else _labels(path, indexes, columns, n, yname)
    return record_examples(path, indexes, xname, x_column.kind, dtype, shape, workers, y), y


def encoded_images(path, x_key, y_key, feature, on_error, say=None):
    """(``RecordSource`` of the encoded-image feature ``feature``, int32 labels ``y_key``, class names or None)
    of the TFRecord file or glob ``path``: what the ``Images`` op decodes (``towers.data.kinds``).  The class
    names are the records' ``image/class/text`` (:func:`class_names`); ``y_key`` None: records without labels
    (zeros, no class names)."""
    indexes, n, columns = index_split(path, on_error, say)
    if x_key not in ("x", feature):
        raise UsageError(f"`decode` names {feature!r} but `x_key` is {x_key!r}: drop `x_key`, or make them agree")
    column = columns.get(feature)
    if column is None or column.kind != KIND_BYTES or column.is_list or column.present_count != n \
            or column.min_count != 1 or column.max_count != 1:
        what = "no such feature" if column is None else column.describe(n)
        raise UsageError(f"{path}: `decode` {feature}:image needs one encoded image (bytes) in every record, but "
                         f"{feature!r} is {what}; the features: " + "; ".join(
                             f"{k} ({c.describe(n)})" for k, c in sorted(columns.items())))
    labels = [k for k in columns if all(k in i.scalars for i in indexes) and k != feature]
    source = RecordSource([i.path for i in indexes], feature, *positions(indexes))
    if y_key is None:
        return source, np.zeros(n, np.int32), None
    yname = _choose(path, columns, n, y_key, "y", labels, "labels", "y_key")
    labels = _labels(path, indexes, columns, n, yname)
    return source, labels, class_names(indexes, labels)


def class_names(indexes, labels) -> list[str] | None:
    """Label k's class name at k, from the records' ``image/class/text`` (``towers.data.tfrecord.index.CLASS_TEXT``,
    which ``towers.data.image.to_tfrecord`` writes from an image folder's class folders), or None: names
    only when every record has one, every label 0..max has one name, no name is empty and no two labels
    share one (anything else says nothing sure about the labels)."""
    if not all(CLASS_TEXT in i.texts for i in indexes):
        return None
    pairs, start = set(), 0
    for i in indexes:
        table, numbers = i.texts[CLASS_TEXT]
        part = labels[start:start + len(numbers)]
        start += len(numbers)
        for label, number in np.unique(np.stack([part.astype(np.int64), numbers.astype(np.int64)]), axis=1).T:
            pairs.add((int(label), table[int(number)]))
    names = dict(pairs)
    if len(names) != len(pairs) or sorted(names) != list(range(len(names))):
        return None
    found = [names[k] for k in range(len(names))]
    return found if all(found) and len(set(found)) == len(found) else None


def _labels(path, indexes, columns, n, yname) -> np.ndarray:
    """The int32 labels of feature ``yname``: one int64 per record, 0 .. 2**31 - 1."""
    if not all(yname in i.scalars for i in indexes):
        raise UsageError(f"{path}: feature {yname!r} ({columns[yname].describe(n)}) cannot be labels: "
                         "labels are one int64 per record")
    y = np.concatenate([i.scalars[yname] for i in indexes])
    if y.min() < 0 or y.max() > np.iinfo(np.int32).max:
        raise UsageError(f"{path}: labels in {yname!r} run from {int(y.min())} to {int(y.max())}; "
                         "labels are 0..C-1")
    return y.astype(np.int32)


# -- the examples array ------------------------------------------------------------------------------------


def record_examples(name, indexes, feature, kind, dtype, shape, workers=2, labels=None) -> Examples:
    """The examples stored raw in feature ``feature`` of the records of ``indexes``, read on demand: an
    ``Examples`` array over a ``Gather`` of a ``RawRecordSource``, with a pool of its own (``workers``; 0:
    read in the calling thread) that starts on the first read, ends with ``close`` (or when the array is
    collected) and starts again on a read after ``close``."""
    source = RawRecordSource([i.path for i in indexes], feature, kind, dtype, shape, *positions(indexes))
    return Examples(name, Gather(source), Workers(int(workers)), labels, rows="records", own_workers=True)
