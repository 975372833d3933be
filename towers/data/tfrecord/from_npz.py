"""Write tf.train.Example (or SequenceExample) records from an npz in the converter's layout (the library half
of ``towers-npz-to-tfrecord``; its command line is :mod:`towers.npz_to_tfrecord`).

The npz must follow the layout :mod:`tools.tfrecord_to_npz` writes: for each
feature ``F.present``, ``F.row_lengths``, ``F.values`` (and
``F.value_lengths`` for bytes); with ``context/`` and ``feature_lists/``
prefixes (``.step_counts`` per record, ``.row_lengths`` per step) the records
are SequenceExamples.  Dense keys, ``x``/``y`` and anything else are ignored:
the flat arrays alone define the records, so TFRecord -> npz -> TFRecord ->
npz gives the same npz.  The kind comes from the dtype of ``F.values``:
uint8 with ``value_lengths`` is bytes, floating is float (written as float32),
integer is int64.

The output is written as :mod:`towers.files` describes (never over the input,
no partial output or temporaries on failure, Ctrl-C or SIGTERM).  An input that
is damaged or is no zip at all is :class:`NpzError` (the command line's status 1),
as a damaged TFRecord is for ``tools.tfrecord_to_npz``: a file cut short and a
file of another kind look the same from its bytes.  A layout mistake is
:class:`LayoutError`; a missing input, a folder, a ``.npy`` (one array) and an
output path that cannot be a file are :class:`UsageError` (both status 2),
found before anything is read.

A present feature with no values is written as an empty list of its kind (as
TensorFlow writes it); an absent one is left out of the record.  Limits: the
npz arrays are loaded into memory (the records are written one at a time).
"""

import os
import zipfile
import zlib

import numpy as np
from numpy.lib import format as npy

from towers.files import atomic_path, check_new_output, output_folder, refuse_overwriting_inputs
from towers.data.tfrecord.framing import TFRecordWriter
from towers.data.tfrecord.proto import SequenceExample
from towers.data.tfrecord.schema import UsageError

class LayoutError(Exception):
    """The npz does not follow the converter's layout (exit status 2)."""


class NpzError(Exception):
    """The input cannot be read as an npz: damaged, cut short or another kind of file (exit status 1)."""


def _offsets(lengths):
    return np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).tolist()


class _Feature:
    """One feature's flat arrays, sliced per record as Python lists."""

    def __init__(self, npz, key, is_list):
        def need(suffix):
            if key + suffix not in npz:
                raise LayoutError(f"{key}{suffix} is missing; the npz must come from tools.tfrecord_to_npz")
            return npz[key + suffix]

        self.name = key.split("/", 1)[1] if "/" in key else key
        self.present = need(".present").astype(bool).tolist()
        values = need(".values")
        if key + ".value_lengths" in npz:
            self.kind, data = "bytes_list", values.astype(np.uint8).tobytes()
            ends = _offsets(npz[key + ".value_lengths"])
            self.values = [data[a:b] for a, b in zip(ends[:-1], ends[1:])]
            if ends[-1] != len(data):
                raise LayoutError(f"{key}.value_lengths add up to {ends[-1]} bytes, {key}.values has {len(data)}")
        elif values.dtype.kind == "f":
            self.kind, self.values = "float_list", values.astype(np.float32).tolist()
        elif values.dtype.kind in "iub":
            self.kind, self.values = "int64_list", values.astype(np.int64).tolist()
        else:
            raise LayoutError(f"{key}.values has dtype {values.dtype}; expected uint8, float32 or int64")
        # Per record: [start, end) into the per-step lengths (lists) or into the values.
        self.steps = _offsets(need(".step_counts")) if is_list else None
        self.value_ends = _offsets(need(".row_lengths"))
        if self.value_ends[-1] != len(self.values):
            raise LayoutError(f"{key}.row_lengths add up to {self.value_ends[-1]}, but there are "
                              f"{len(self.values)} values")
        if is_list and self.steps[-1] != len(self.value_ends) - 1:
            raise LayoutError(f"{key}.step_counts add up to {self.steps[-1]}, but {key}.row_lengths has "
                              f"{len(self.value_ends) - 1} steps")
        # A damaged npz would otherwise fail mid-write (an IndexError) or slice values wrongly.
        rows, counts = (self.steps, ".step_counts") if is_list else (self.value_ends, ".row_lengths")
        if len(rows) - 1 != len(self.present):
            raise LayoutError(f"{key}{counts} has {len(rows) - 1} entries, {key}.present {len(self.present)}")
        for suffix, ends in {".row_lengths": self.value_ends, counts: rows}.items():
            if (np.diff(ends) < 0).any():
                raise LayoutError(f"{key}{suffix} holds a negative length")

    def fill(self, feature, i):
        """Set ``feature`` (a Feature message) to the values of row ``i`` of the flat arrays."""
        typed = getattr(feature, self.kind)
        typed.SetInParent()  # an empty list still records the kind
        typed.value.extend(self.values[self.value_ends[i]:self.value_ends[i + 1]])


def load_features(npz):
    """(context features, feature lists) found in an opened npz."""
    if not npz.files:  # what tools.tfrecord_to_npz writes for files of no records: no records again
        return [], [], 0
    stems = sorted(k[: -len(".present")] for k in npz.files if k.endswith(".present"))
    if not stems:
        raise LayoutError("no F.present keys: the npz does not follow the tools.tfrecord_to_npz layout")
    sequence = any(s.startswith("feature_lists/") for s in stems)
    context = [_Feature(npz, s, False) for s in stems
               if not s.startswith("feature_lists/") and (s.startswith("context/") or not sequence)]
    lists = [_Feature(npz, s, True) for s in stems if s.startswith("feature_lists/")]
    counts = {len(f.present) for f in context + lists}
    if len(counts) != 1:
        raise LayoutError(f"features disagree on the number of records: {sorted(counts)}")
    return context, lists, counts.pop()


def read_features(path):
    """:func:`load_features` of the npz at ``path``; every way it can fail is one error naming ``path``."""
    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder, not an npz; give the npz file")
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file; give an npz written by tools.tfrecord_to_npz")
    fix = "give an npz written by tools.tfrecord_to_npz"
    with open(path, "rb") as f:
        head = f.read(len(npy.MAGIC_PREFIX))
    if head.startswith(npy.MAGIC_PREFIX):
        raise UsageError(f"{path} is a .npy file (one array), not an npz; {fix}")
    fix += ", or write it again if it was cut short"
    if not head.startswith((b"PK\x03\x04", b"PK\x05\x06")):  # a member first, or no member (an empty archive)
        raise NpzError(f"{path}: damaged or not an npz ({'empty' if not head else 'no zip header'}); {fix}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return load_features(npz)
    except LayoutError as exc:
        raise LayoutError(f"{path}: {exc}") from None
    except (zipfile.BadZipFile, EOFError, ValueError, zlib.error) as exc:  # the zip or a member's .npy is damaged
        raise NpzError(f"{path}: damaged or not an npz ({exc}); {fix}") from None


def records(context, lists, n):
    """Serialized records, one per row (Example wire format when there are no lists)."""
    for i in range(n):
        record = SequenceExample()
        for f in context:
            if f.present[i]:
                f.fill(record.context.feature[f.name], i)
        for f in lists:
            if f.present[i]:
                steps = record.feature_lists.feature_list[f.name].feature
                for step in range(f.steps[i], f.steps[i + 1]):
                    f.fill(steps.add(), step)
        yield record.SerializeToString()


def write_examples(out_path, x, y, compression="none", x_feature="image_raw", y_feature="label"):
    """Examples as the original MNIST script writes them: ``x_feature`` (each row's bytes), ``y_feature``
    and ``pixels`` (int64); written atomically.  Returns the record count."""
    with output_folder(out_path) as folder, atomic_path(out_path, folder) as tmp:
        with open(tmp, "wb") as f, TFRecordWriter(f, compression) as writer:
            for xi, yi in zip(x, y):
                record = SequenceExample()
                features = record.context.feature
                features[x_feature].bytes_list.value.append(np.ascontiguousarray(xi).tobytes())
                features[y_feature].int64_list.value.append(int(yi))
                features["pixels"].int64_list.value.append(int(np.size(xi)))
                writer.write(record.SerializeToString())
    return len(y)


def write(npz_path, out_path, compression="none", removed=None):
    """Write the records of ``npz_path`` to ``out_path`` atomically; return the record count.

    Paths of dead runs' temporary folders removed on the way are appended to ``removed``.
    The output path is checked before the input is read.
    """
    refuse_overwriting_inputs(out_path, [npz_path])
    check_new_output(out_path, "npz_to_tfrecord", "-o", "out.tfrecords")
    context, lists, n = read_features(npz_path)
    with output_folder(out_path, removed, "-o") as folder, atomic_path(out_path, folder) as tmp:
        with open(tmp, "wb") as f, TFRecordWriter(f, compression) as writer:
            for payload in records(context, lists, n):
                writer.write(payload)
    return n

