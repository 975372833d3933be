"""Sources: random access to examples by row number, as encoded bytes or as stored arrays.

A source is small and picklable (paths and per-row positions, no open
files), so the input workers rebuild it once and then read rows themselves.
``refs(rows)`` picks what a chunk of rows needs to travel to a worker,
``read(ref)`` turns one of them into the example, ``where(ref)`` names it in a
message.  The transforms (``towers.data.image.augment``) run on what ``read``
returns.

- :class:`RecordSource`: one bytes feature of TFRecord records (``image/encoded``),
  located by the record index (``towers.data.tfrecord.records.file_index``):
  each read checks the record's framing and both CRCs, then parses it;
- :class:`FileSource`: one file per row (an image folder);
- :class:`ArraySource`: rows of a uint8 (N, H, W, C) array (an npz to augment),
  sent with the chunk.

Limits: files are opened once per process and kept open (one descriptor a
TFRecord shard); an image folder opens each file per read.
"""
from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError

from towers.data.tfrecord.framing import FOOTER, HEADER, TFRecordError, check_record
from towers.data.tfrecord.gather import RecordFile
from towers.data.tfrecord.proto import SequenceExample


class SourceError(Exception):
    """A row that cannot be read (the file is gone or damaged); the message names it."""


class RecordSource:
    """Feature ``feature`` (one bytes value a record) of the records at the index's positions."""

    encoded = True

    def __init__(self, paths, feature, files, offsets, lengths, numbers):
        self.paths, self.feature = list(paths), feature
        self._pos = np.stack([files, offsets, lengths, numbers], axis=1).astype(np.int64)
        self._open: dict[int, RecordFile] = {}

    def __getstate__(self):
        return dict(self.__dict__, _open={})

    def __len__(self):
        return len(self._pos)

    def refs(self, rows):
        return np.asarray(rows, np.int64)  # a worker has the positions: only row numbers travel

    def where(self, ref) -> str:
        f, offset, _, number = self._pos[ref].tolist()
        return f"{self.paths[f]}: record {number} at byte offset {offset}: feature {self.feature!r}"

    def read(self, ref) -> bytes:
        f, offset, length, number = self._pos[ref].tolist()
        file = self._open.get(f)
        if file is None:
            file = self._open[f] = RecordFile(self.paths[f], mapped=False)
        payload = check_record(file.read(offset, HEADER + length + FOOTER, None), length)
        if isinstance(payload, str):
            raise TFRecordError(self.paths[f], number, offset, payload)
        try:
            values = SequenceExample.FromString(payload).context.feature[self.feature].bytes_list.value
        except DecodeError:
            values = ()
        if len(values) != 1:
            raise TFRecordError(self.paths[f], number, offset, f"feature {self.feature!r} is not one bytes value "
                                "as the index says: the file changed since it was indexed; re-copy it")
        return values[0]

    def close(self) -> None:
        for file in self._open.values():
            file.close()
        self._open = {}


class FileSource:
    """One encoded image file per row."""

    encoded = True

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

    def close(self) -> None:
        pass
