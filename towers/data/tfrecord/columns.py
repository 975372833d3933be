"""Turn parsed records into columns, spilled to disk batch by batch.

Every record is parsed as a ``tf.train.SequenceExample`` (an Example is one
with no feature lists, see :mod:`towers.data.tfrecord.proto`).  For each feature a
column keeps, for the current batch only, the batch positions of the records
that have it, the value count of each, and the values as a flat Python list.
At the end of a batch the column becomes NumPy arrays (``present``,
``row_lengths``, ``values`` and, for bytes, ``value_lengths``; feature lists
also ``step_counts``) that are appended to one raw spill file per array.  A
feature first seen late gets zero-filled ``present``/``row_lengths`` for the
records before it.  Memory is one batch plus one small object per feature,
whatever the number of records.

:meth:`ColumnStore.entries` then names the spill files in the npz convention
of ``shared/tfrecord-samples/README.md`` (``F.present``, ``F.row_lengths``,
``F.values``, ``F.value_lengths``, the dense ``F`` when every record has the
same count; ``context/`` and ``feature_lists/`` prefixes once any record has
feature lists) as :class:`~towers.files.ArrayBytes` objects, without
reading them.  Per-column statistics (presence, min/max values per record,
min/max byte lengths) are kept on the fly for the dense decision and for
``--schema``.

Limits: a feature whose kind changes between records is an error; a feature
that is only ever an empty ``Feature`` (no kind set) is written as float32.
"""

import os

import numpy as np
from google.protobuf.message import DecodeError

from towers.files import ArrayBytes
from towers.data.tfrecord.framing import TFRecordError
from towers.data.tfrecord.proto import KIND_BYTES, KIND_FLOAT, KIND_INT64, KIND_NAMES, KIND_OF_FIELD, SequenceExample

_VALUE_DTYPES = {KIND_BYTES: np.dtype(np.uint8), KIND_FLOAT: np.dtype(np.float32)}
_ZERO_BLOCK = 1 << 20
MAX_TEXT = 256  # bytes: the longest value of a kept text feature (``ColumnStore.keep_texts``)


class _Spill:
    """One array, appended to a raw file batch by batch (or only counted)."""

    def __init__(self, directory, name, dtype, memory=False):
        self.path = None if directory is None else os.path.join(directory, name)
        self.dtype = np.dtype(dtype)
        self.size = 0
        self.parts = [] if memory else None  # kept in memory instead (label candidates)
        if self.path is not None:
            open(self.path, "wb").close()

    def append(self, array):
        self.size += array.size
        if self.parts is not None:
            self.parts.append(np.array(array, self.dtype))
        if self.path is not None and array.size:
            with open(self.path, "ab") as f:
                # f.write, not ndarray.tofile: a full disk must raise OSError with its errno (ENOSPC)
                f.write(np.ascontiguousarray(array, self.dtype).data)

    def append_zeros(self, count):
        while count > 0:
            n = min(count, _ZERO_BLOCK)
            self.append(np.zeros(n, self.dtype))
            count -= n

    def source(self, dtype=None, shape=None):
        return ArrayBytes(dtype or self.dtype, shape or (self.size,), self.path)

    def array(self):
        """The values kept in memory (None when they were not kept)."""
        return None if self.parts is None else np.concatenate(self.parts or [np.zeros(0, self.dtype)])


class ColumnStats:
    """What is known of one feature without its values: kind and per-record counts and sizes.

    ``count`` is values per record (steps per record for a feature list),
    ``bytes`` the length of each bytes value; min/max are None until seen.
    The converter's columns carry these; the training index stores them
    (:meth:`as_dict` / :meth:`from_dict`) so that a cached index needs no
    pass over the data.
    """

    FIELDS = ("key", "is_list", "kind", "present_count", "min_count", "max_count", "min_bytes", "max_bytes")

    def as_dict(self):
        return {name: getattr(self, name) for name in self.FIELDS}

    @classmethod
    def from_dict(cls, fields):
        stats = cls.__new__(cls)
        for name in cls.FIELDS:
            setattr(stats, name, fields[name])
        return stats

    @property
    def kind_name(self):
        return KIND_NAMES.get(self.kind, "unknown")

    def fixed_bytes(self, n):
        """The byte length if every one of ``n`` records has one bytes value of one length, else None."""
        if (self.kind == KIND_BYTES and not self.is_list and self.present_count == n and n > 0
                and self.min_count == self.max_count == 1 and self.min_bytes == self.max_bytes):
            return self.min_bytes
        return None

    def dense_shape(self, n):
        """Shape of the dense form (None if there is none), per the npz convention."""
        if self.is_list or self.kind is None or self.present_count != n or n == 0 or self.min_count != self.max_count:
            return None
        if self.kind == KIND_BYTES:
            width = self.fixed_bytes(n)
            return None if width is None else (n, width)
        return (n,) if self.min_count == 1 else (n, self.min_count)

    def describe(self, n):
        """``kind, a..b values in p/n records[, a..b bytes each]`` for messages."""
        text = f"{self.kind_name}, {self.min_count}..{self.max_count} values in {self.present_count}/{n} records"
        if self.kind == KIND_BYTES:
            text += f", {self.min_bytes}..{self.max_bytes} bytes each"
        return text


class _Column(ColumnStats):
    """Values of one feature: its kind, the batch buffers and the running statistics.

    ``rows``/``counts`` are per record for a context feature; a feature list
    also keeps per-step ``step_lengths`` (its ``counts`` are step counts).
    """

    def __init__(self, store, key, done_rows, is_list):
        self.key, self.is_list, self.field, self.kind = key, is_list, None, None
        self._dir, self._stem = store.spill_dir, f"c{len(store.columns):05d}"
        self._keep = store.keep_scalars
        self._keep_text = key in store.keep_texts and not is_list
        self.rows, self.counts, self.step_lengths, self.vals = [], [], [], []
        self.present_count, self.min_count, self.max_count = 0, None, None
        self.min_bytes = self.max_bytes = None
        self.present = _Spill(self._dir, self._stem + ".present", np.bool_)
        self.row_counts = _Spill(self._dir, self._stem + ".counts", np.int64)
        self.step_lens = _Spill(self._dir, self._stem + ".steplens", np.int64) if is_list else None
        self.values = self.value_lengths = None
        self.present.append_zeros(done_rows)
        self.row_counts.append_zeros(done_rows)

    def set_field(self, field):
        """Fix the kind on first sight of a typed Feature; return False on a conflict."""
        if self.field is None:
            self.field, self.kind = field, KIND_OF_FIELD[field]
            text = self._keep_text and self.kind == KIND_BYTES
            self.values = _Spill(self._dir, self._stem + ".values", _VALUE_DTYPES.get(self.kind, np.int64),
                                 memory=text or (self._keep and self.kind == KIND_INT64 and not self.is_list))
            if self.kind == KIND_BYTES:
                self.value_lengths = _Spill(self._dir, self._stem + ".valuelens", np.int64, memory=text)
            return True
        return field is self.field

    def take(self, feature):
        """Buffer the values of one Feature message; return how many there are.

        ``ListFields`` returns the one set member of the ``kind`` oneof as
        (descriptor, list) in a single C call; comparing descriptors by
        identity keeps the per-value cost to one ``extend``.
        """
        fields = feature.ListFields()
        if not fields:
            return 0  # a Feature with no kind set: an empty list
        (field, typed), = fields
        if field is not self.field and not self.set_field(field):
            raise _KindChange(self.key, field, self)
        values = typed.value
        self.vals.extend(values)
        return len(values)

    def flush(self, batch_size):
        """Append this batch's arrays to the spill files and reset the buffers."""
        present = np.zeros(batch_size, np.bool_)
        counts = np.zeros(batch_size, np.int64)
        if self.rows:
            rows = np.array(self.rows, np.intp)
            present[rows] = True
            counts[rows] = self.counts
            self.present_count += len(self.rows)
            self._widen("count", counts[rows])
        self.present.append(present)
        self.row_counts.append(counts)
        if self.is_list:
            self.step_lens.append(np.array(self.step_lengths, np.int64))
        vals = self.vals
        if self.kind == KIND_BYTES:
            lengths = np.fromiter(map(len, vals), np.int64, len(vals))
            self._widen("bytes", lengths)
            self.value_lengths.append(lengths)
            self.values.append(np.frombuffer(b"".join(vals), np.uint8))
            if self.values.parts is not None and ((self.max_count or 0) > 1 or (self.max_bytes or 0) > MAX_TEXT):
                self.values.parts = self.value_lengths.parts = None  # not one short text per record: memory bounded
        elif self.kind is not None:
            self.values.append(np.array(vals, self.values.dtype))
            if self.values.parts is not None and (self.max_count or 0) > 1:
                self.values.parts = None  # not one value per record: no label, and memory stays bounded
        self.rows, self.counts, self.step_lengths, self.vals = [], [], [], []

    def _widen(self, what, array):
        if array.size:
            low, high = int(array.min()), int(array.max())
            old_low, old_high = getattr(self, "min_" + what), getattr(self, "max_" + what)
            setattr(self, "min_" + what, low if old_low is None else min(low, old_low))
            setattr(self, "max_" + what, high if old_high is None else max(high, old_high))

    def entries(self, n, prefix):
        """The npz keys of this column as (key, ArrayBytes)."""
        key = prefix + self.key
        values = self.values or _Spill(None, "", np.float32)
        out = [(key + ".present", self.present.source())]
        if self.is_list:
            out += [(key + ".step_counts", self.row_counts.source()),
                    (key + ".row_lengths", self.step_lens.source())]
        else:
            out.append((key + ".row_lengths", self.row_counts.source()))
        out.append((key + ".values", values.source()))
        if self.kind == KIND_BYTES:
            out.append((key + ".value_lengths", self.value_lengths.source()))
        shape = self.dense_shape(n)
        if shape is not None:
            out.append((key, values.source(shape=shape)))
        return out


class ColumnStore:
    """Accumulates parsed records into spilled columns (``spill_dir=None``: statistics only).

    ``keep_scalars``: also keep in memory the values of int64 features that
    have at most one value in every record so far (the label candidates of
    :mod:`towers.data.tfrecord.records`); ``_Column.values.array()`` returns them.
    ``keep_texts``: names of bytes features whose values are kept so too
    (``values`` and ``value_lengths``), while each record has at most one of at
    most ``MAX_TEXT`` bytes (a class name).
    """

    def __init__(self, spill_dir=None, keep_scalars=False, keep_texts=()):
        self.spill_dir, self.keep_scalars, self.keep_texts = spill_dir, keep_scalars, frozenset(keep_texts)
        self.columns = []
        self.context, self.lists = {}, {}
        self.rows = 0
        self.sequence = False

    def _column(self, table, name, is_list):
        column = table[name] = _Column(self, name, self.rows, is_list)
        self.columns.append(column)
        return column

    def add(self, batch, path):
        """Parse and add one :class:`~towers.data.tfrecord.framing.RecordBatch` read from ``path``."""
        parse, context = SequenceExample.FromString, self.context
        j = -1
        try:
            for j, payload in enumerate(batch.payloads):
                record = parse(payload)
                for name, feature in record.context.feature.items():
                    column = context.get(name) or self._column(context, name, False)
                    column.rows.append(j)
                    column.counts.append(column.take(feature))
                # Field 2 (feature_lists) with entries is what makes a SequenceExample.
                if record.HasField("feature_lists") and record.feature_lists.feature_list:
                    self.sequence = True
                    self._add_lists(record.feature_lists.feature_list, j)
        except DecodeError as exc:
            raise TFRecordError(path, batch.indices[j], batch.offsets[j],
                                f"the payload is not a tf.train.Example or SequenceExample ({exc}); "
                                "convert only files of Example records") from None
        except _KindChange as exc:
            raise TFRecordError(path, batch.indices[j], batch.offsets[j], str(exc)) from None
        for column in self.columns:
            column.flush(len(batch.payloads))
        self.rows += len(batch.payloads)

    def _add_lists(self, feature_lists, j):
        for name, feature_list in feature_lists.items():
            column = self.lists.get(name) or self._column(self.lists, name, True)
            steps = feature_list.feature
            column.rows.append(j)
            column.counts.append(len(steps))
            for feature in steps:
                column.step_lengths.append(column.take(feature))

    def find(self, name):
        """The context column called ``name`` (also accepted with its ``context/`` prefix)."""
        if self.sequence and name.startswith("context/"):
            name = name[len("context/"):]
        return self.context.get(name)

    def prefixes(self):
        return ("context/", "feature_lists/") if self.sequence else ("", "feature_lists/")

    def entries(self):
        """All (key, ArrayBytes) pairs in the npz convention, sorted by feature name."""
        context_prefix, list_prefix = self.prefixes()
        out = []
        for name in sorted(self.context):
            out += self.context[name].entries(self.rows, context_prefix)
        for name in sorted(self.lists):
            out += self.lists[name].entries(self.rows, list_prefix)
        return out

    def schema_lines(self):
        """One line per feature: key, kind, values (or steps) per record min..max, presence."""
        context_prefix, list_prefix = self.prefixes()
        lines = []
        for table, prefix, per in ((self.context, context_prefix, "values"), (self.lists, list_prefix, "steps")):
            for name in sorted(table):
                c = table[name]
                span = "-" if c.min_count is None else f"{c.min_count}..{c.max_count}"
                line = (f"{prefix + name:30s} {c.kind_name:7s} {per}/record {span:>9s}  "
                        f"in {c.present_count}/{self.rows} records")
                if c.kind == KIND_BYTES and c.min_bytes is not None:
                    line += f"  bytes/value {c.min_bytes}..{c.max_bytes}"
                shape = c.dense_shape(self.rows)
                if shape is not None:
                    line += f"  dense {c.values.dtype.name}{list(shape)}"
                lines.append(line)
        return lines


class _KindChange(Exception):
    def __init__(self, name, field, column):
        super().__init__(f"feature {name!r} is {KIND_NAMES[KIND_OF_FIELD[field]]} here but "
                         f"{column.kind_name} in earlier records; a feature must keep one kind")
