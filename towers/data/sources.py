"""Sources, the first part of the data pipeline: random access to examples by row number.

A source is small and picklable (paths and per-row positions, no open
files), so the input workers (``towers.data.workers``) rebuild it once
and then read rows themselves.  ``refs(rows)`` picks what a chunk of rows
needs to travel to a worker, ``read(ref)`` turns one of them into the
example, ``where(ref)`` names it in a message; a source of rows made a chunk
at a time has ``read_rows(refs, out)`` and ``example_shape`` instead.  A job
(``towers.data.jobs``) runs the transforms (``towers.data.image.augment``)
on what ``read`` returns, or gathers with ``read_rows``.  ``encoded`` says
whether rows are encoded images (the decoded-image cache applies).  Which
source a path gets is its kind's choice (``towers.data.kinds``).

- :class:`RecordSource`: one bytes feature of TFRecord records (``image/encoded``),
  located by the record index (``towers.data.tfrecord.index``): each read goes
  through the one record reader (``towers.data.tfrecord.gather.RecordReader``:
  framing, both CRCs, the record against its index), then parses it;
- :class:`RawRecordSource`: examples stored raw in TFRecord records; no
  per-example transform: ``read_rows(refs, out)`` makes a whole chunk (a
  ``Gatherer``: the same reader's checks, batch-wise);
- :class:`FileSource`: one file per row (an image folder);
- :class:`ArraySource`: rows of a uint8 (N, H, W, C) array (an npz to augment),
  sent with the chunk.

Each source also says what its examples are stored as: ``dtype`` (encoded
images decode to uint8 pixels) and ``fingerprint(h)``, which feeds a hash
what identifies its rows' contents cheaply (``towers.data.fingerprint``).

Limits: files are opened once per process and kept open (one descriptor a
TFRecord shard); an image folder opens each file per read.
"""
from __future__ import annotations

import os

import numpy as np
from google.protobuf.message import DecodeError

from towers.data.fingerprint import hash_rows, sample_rows

from towers.data.tfrecord.framing import TFRecordError
from towers.data.tfrecord.gather import Gatherer, RecordReader
from towers.data.tfrecord.proto import SequenceExample


class SourceError(Exception):
    """A row that cannot be read (the file is gone or damaged); the message names it."""


def _hash_records(h, feature: str, crcs) -> None:
    """A TFRecord source's fingerprint: the feature's name and every record's payload CRC (from the index,
    which every read is checked against): all records' bytes count, and nothing is read."""
    h.update(feature.encode())
    h.update(memoryview(np.ascontiguousarray(crcs, "<i8")).cast("B"))


class RecordSource:
    """Feature ``feature`` (one bytes value a record) of the records at the index's positions."""

    encoded = True
    dtype = np.dtype(np.uint8)  # the decoded pixels

    def __init__(self, paths, feature, files, offsets, lengths, numbers, crcs):
        self.paths, self.feature = list(paths), feature
        self._pos = np.stack([files, offsets, lengths, numbers, crcs], axis=1).astype(np.int64)
        self._reader = RecordReader(self.paths)

    def __getstate__(self):
        return dict(self.__dict__, _reader=None)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reader = RecordReader(self.paths)

    def __len__(self):
        return len(self._pos)

    def refs(self, rows):
        return np.asarray(rows, np.int64)  # a worker has the positions: only row numbers travel

    def where(self, ref) -> str:
        f, offset, _, number, _ = self._pos[ref].tolist()
        return f"{self.paths[f]}: record {number} at byte offset {offset}: feature {self.feature!r}"

    def read(self, ref) -> bytes:
        f, offset, length, number, crc = self._pos[ref].tolist()
        payload = self._reader.payload(f, offset, length, number, crc)
        try:
            values = SequenceExample.FromString(payload).context.feature[self.feature].bytes_list.value
        except DecodeError:
            values = ()
        if len(values) != 1:
            raise TFRecordError(self.paths[f], number, offset, f"feature {self.feature!r} is not one bytes value "
                                "as the index says: the file changed since it was indexed; re-copy it")
        return values[0]

    def fingerprint(self, h) -> None:
        _hash_records(h, self.feature, self._pos[:, 4])

    def close(self) -> None:
        self._reader.close()


class RawRecordSource:
    """Examples stored raw in TFRecord records (a bytes feature read as ``dtype`` and ``shape``, or a float
    list), made a chunk at a time by a :class:`~towers.data.tfrecord.gather.Gatherer` (``read_rows``):
    the records of a chunk are gathered and checked together, and parsed only when their layout is new."""

    encoded = False

    def __init__(self, paths, feature, kind, dtype, shape, files, offsets, lengths, numbers, crcs):
        self.paths, self.feature = list(paths), feature
        self._spec = (self.paths, feature, kind, np.dtype(dtype).str, tuple(shape))
        self._pos = (files, offsets, lengths, numbers, crcs)
        self._gatherer = Gatherer(*self._spec)
        self.example_shape, self.dtype = tuple(shape), self._gatherer.out_dtype

    def __getstate__(self):
        return dict(self.__dict__, _gatherer=None)  # no open files or learned frames travel

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._gatherer = Gatherer(*self._spec)

    def __len__(self):
        return len(self._pos[0])

    def refs(self, rows):
        return np.asarray(rows, np.int64)  # a worker has the positions: only row numbers travel

    def where(self, ref) -> str:
        f, offset, number = int(self._pos[0][ref]), int(self._pos[1][ref]), int(self._pos[3][ref])
        return f"{self.paths[f]}: record {number} at byte offset {offset}: feature {self.feature!r}"

    def read_rows(self, refs, out) -> None:
        self._gatherer.read(*(a[refs] for a in self._pos), into=out)

    def fingerprint(self, h) -> None:
        _hash_records(h, self.feature, self._pos[4])

    def close(self) -> None:
        """Close the files read so far (a later read opens them again)."""
        self._gatherer.close()


class FileSource:
    """One encoded image file per row."""

    encoded = True
    dtype = np.dtype(np.uint8)  # the decoded pixels

    def __init__(self, paths):
        self.paths = list(paths)

    def __len__(self):
        return len(self.paths)

    def refs(self, rows):
        return np.asarray(rows, np.int64)  # a worker has the paths: only row numbers travel

    def where(self, ref) -> str:
        return str(self.paths[ref])

    def read(self, ref) -> bytes:
        try:
            with open(self.paths[ref], "rb") as f:
                return f.read()
        except OSError as e:
            raise SourceError(f"{self.paths[ref]}: cannot be read ({e.strerror or e})") from None

    def fingerprint(self, h) -> None:
        """Every file's name under the folder (``<class>/<file>``, in row order) and the bytes of a sample of
        the files as stored (not decoded)."""
        root = len(os.path.dirname(os.path.dirname(self.paths[0]))) + 1 if self.paths else 0
        h.update("\n".join(p[root:] for p in self.paths).encode("utf-8", "surrogateescape"))
        for row in sample_rows(len(self.paths)).tolist():
            try:
                h.update(self.read(row))
            except SourceError:  # read (and reported) as such when trained on
                h.update(b"\0unreadable")

    def close(self) -> None:
        pass


class ArraySource:
    """Rows of a uint8 (N, H, W, C) array (in memory or mapped); a chunk carries its rows."""

    encoded = False

    def __init__(self, array, name="x"):
        self.array, self.name = array, name

    def __getstate__(self):
        return dict(self.__dict__, array=None)  # the rows travel with each chunk

    def __len__(self):
        return len(self.array)

    def refs(self, rows):
        rows = np.asarray(rows, np.int64)
        return list(zip(rows.tolist(), self.array[rows]))

    def where(self, ref) -> str:
        return f"{self.name}[{ref[0]}]"

    def read(self, ref) -> np.ndarray:
        return ref[1]

    @property
    def dtype(self):
        return self.array.dtype

    def fingerprint(self, h) -> None:
        hash_rows(h, self.array)

    def close(self) -> None:
        pass
