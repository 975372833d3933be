"""Record positions to one examples array: mapped files, batch-wise checks, and no parse where none is needed.

Training from TFRecord files (``towers.data.tfrecord.records.RecordArray``)
asks for a global batch of records at random positions; a :class:`Gatherer`
(one per input thread or worker process) turns them into the examples array:

1. **Gather** (:class:`RecordFile`): the records of one length are copied
   out at once.  Files are mapped read-only while the mapped files fit in
   ``WINDOW`` bytes: a record is then a row of a NumPy gather (a file whose
   records of that length start at multiples of it is viewed as a 2-D array;
   otherwise one slice each).  Mapped pages stay resident once read, so files
   beyond the window are read with one ``os.pread`` a record instead, and the
   resident size does not grow with the data (random reads over a mapping
   larger than memory would also fault a page in for nearly every record).
2. **Check** (:func:`~towers.data.tfrecord.framing.framed_intact`): every
   header and payload CRC, as ``read_record`` checks them, for the whole batch.
3. **Extract without a parse** (:class:`Layouts`): the example is the content
   of one bytes field (or of one packed float list), which the protobuf parser
   does not look into.  Once a record was parsed in full and its value found
   exactly once in its payload, at byte ``start``, a record of the same length
   whose other bytes (its *frame*) are the same parses the same way with its
   value at the same place, so that value is copied out unparsed.  Up to
   ``FRAMES`` frames are kept per payload length (MNIST has one per label).
4. **Parse** the rest record by record (a frame not seen yet, damage, a file
   that shrank): ``read_record`` and the protobuf parser, which also name what
   is wrong (:class:`~towers.data.tfrecord.framing.TFRecordError`).

Steps 1-3 cost about 0.5 us a MNIST record against 3 us for step 4 alone; on
2 cores that is what lets the input thread share the cores with two CPU
towers (``python -m tools.bench_input``).

Sync points: none; a Gatherer is used by one thread at a time.  Limits: a file
truncated by another program between the per-batch size check and the gather
would end the process with SIGBUS; a float example copied unparsed keeps its
stored bits, so a signalling NaN stays signalling where the parse quiets it.
"""
from __future__ import annotations

import math
import mmap
import os

import numpy as np
from google.protobuf.message import DecodeError

from towers.data.tfrecord.framing import FOOTER, HEADER, TFRecordError, framed_intact, read_record
from towers.data.tfrecord.proto import KIND_BYTES, KIND_LIST_FIELDS, SequenceExample

WINDOW = 64 << 20  # bytes of files one Gatherer maps (their pages stay resident once read)
FRAMES = 4096  # frames remembered per payload length
LENGTHS = 64  # payload lengths with a known value start


class RecordFile:
    """One file open for reading records at random: mapped read-only if ``mapped``, else read with ``os.pread``."""

    def __init__(self, path, mapped):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self._map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ) if mapped and self.size else None
        self._bytes = np.frombuffer(self._map, np.uint8) if self._map is not None else None

    @property
    def mapped(self) -> bool:
        return self._map is not None

    def rows(self, offsets, n):
        """A (k, n) uint8 copy of the ``n`` bytes at each of ``offsets``; None if the file is now shorter."""
        if self._map is None:
            raw = b"".join([os.pread(self.fd, n, o) for o in offsets.tolist()])
            return np.frombuffer(raw, np.uint8).reshape(-1, n) if len(raw) == len(offsets) * n else None
        end = int(offsets.max()) + n
        if end > self.size or end > os.fstat(self.fd).st_size:
            return None  # pages past the end of a file that shrank would raise SIGBUS
        if not (offsets % n).any():
            return self._bytes[: self.size // n * n].reshape(-1, n)[offsets // n]
        m = self._map
        return np.frombuffer(b"".join([m[o:o + n] for o in offsets.tolist()]), np.uint8).reshape(-1, n)

    def close(self) -> None:
        self._bytes = None
        if self._map is not None:
            self._map.close()  # its own duplicate of the descriptor too
        os.close(self.fd)


class Layouts:
    """Per payload length, where the value starts, and the frames seen to parse with it there."""

    def __init__(self, width):
        self.width = width
        self._start: dict[int, int] = {}
        self._frames: dict[int, set] = {}

    def known(self, payloads):
        """(bool mask of the rows of ``payloads`` whose frame is known, the value's start or None)."""
        start = self._start.get(payloads.shape[1])
        if start is None:
            return np.zeros(len(payloads), bool), None
        frames = np.concatenate((payloads[:, :start], payloads[:, start + self.width:]), axis=1)
        keys = frames.view(np.dtype((np.void, frames.shape[1]))).ravel().tolist()  # one bytes object a row
        seen = self._frames[payloads.shape[1]]
        return np.fromiter(map(seen.__contains__, keys), bool, len(keys)), start

    def learn(self, payload, value) -> None:
        """``payload`` parsed in full to ``value``: keep its frame if the value sits there once, where expected."""
        start = self._start.get(len(payload))
        if start is None and len(self._start) >= LENGTHS:
            return
        first = payload.find(value)
        if first < 0 or (start is not None and first != start) or payload.find(value, first + 1) >= 0:
            return  # not there, elsewhere, or twice (then which copy is the field's is unknown)
        self._start[len(payload)] = first
        frames = self._frames.setdefault(len(payload), set())
        if len(frames) < FRAMES:
            frames.add(payload[:first] + payload[first + len(value):])


class Gatherer:
    """Turns record positions into one examples array (``read``); one per thread or worker process."""

    def __init__(self, paths, feature, kind, dtype, shape):
        self.paths, self.feature, self.kind = paths, feature, kind
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)
        self.out_dtype = np.dtype(np.uint8) if self.dtype == np.uint8 else np.dtype(np.float32)
        self.stored = self.dtype if kind == KIND_BYTES else np.dtype("<f4")  # an example's bytes in the file
        self.width = math.prod(self.shape) * self.stored.itemsize
        self._field = KIND_LIST_FIELDS[kind]
        self._files: dict[int, RecordFile] = {}
        self._layouts = Layouts(self.width)
        self._mapped = 0  # bytes of the files mapped

    def _file(self, f) -> RecordFile:
        file = self._files.get(f)
        if file is None:
            # Map while the mapped files fit the window: their pages stay resident once read.
            size = os.path.getsize(self.paths[f])
            file = self._files[f] = RecordFile(self.paths[f], self._mapped + size <= WINDOW)
            self._mapped += size if file.mapped else 0
        return file

    def close(self) -> None:
        """Close the files opened so far (a later read opens them again)."""
        files, self._files, self._mapped = self._files, {}, 0
        for file in files.values():
            file.close()

    def read(self, files, offsets, lengths, numbers):
        """The examples of the records at ``offsets`` (of ``files``, payload ``lengths``, record ``numbers``)."""
        out = np.empty((len(numbers), self.width), np.uint8)
        if len(numbers):
            same = lengths.min() == lengths.max()
            for rows in [slice(None)] if same else [np.flatnonzero(lengths == n) for n in
                                                                 np.unique(lengths)]:
                self._read_length(out, rows, files[rows], offsets[rows], numbers[rows], int(lengths[rows][0]))
        return out.view(self.stored).reshape((len(numbers),) + self.shape).astype(self.out_dtype, copy=False)

    def _read_length(self, out, rows, files, offsets, numbers, length) -> None:
        """Fill ``out[rows]`` with the examples of records whose payloads are all ``length`` bytes."""
        framed = self._gather(files, offsets, HEADER + length + FOOTER)
        fast, start = np.zeros(len(offsets), bool), None
        if framed is not None:
            payloads = framed[:, HEADER:HEADER + length]
            fast, start = self._layouts.known(payloads)
            fast &= framed_intact(framed, length)
            if fast.all():
                out[rows] = payloads[:, start:start + self.width]
                return
        at = np.arange(len(out))[rows]
        if start is not None:
            out[at[fast]] = payloads[fast, start:start + self.width]
        for i in np.flatnonzero(~fast).tolist():
            out[at[i]] = np.frombuffer(self._parse(int(files[i]), int(offsets[i]), length, int(numbers[i])), np.uint8)

    def _gather(self, files, offsets, n):
        """The whole records (k, n) at ``offsets`` of ``files``; None if a file shrank since it was indexed."""
        if files.min() == files.max():
            return self._file(int(files[0])).rows(offsets, n)
        framed = np.empty((len(offsets), n), np.uint8)
        for f in np.unique(files).tolist():
            at = files == f
            part = self._file(f).rows(offsets[at], n)
            if part is None:
                return None
            framed[at] = part
        return framed

    def _parse(self, f, offset, length, number) -> bytes:
        """One record read and parsed in full: its example's stored bytes (and its frame learned)."""
        payload = read_record(self._file(f).fd, offset, length)
        if isinstance(payload, str):
            raise TFRecordError(self.paths[f], number, offset, payload)
        try:
            typed = getattr(SequenceExample.FromString(payload).context.feature[self.feature], self._field).value
            if self.kind == KIND_BYTES and len(typed) != 1:
                raise ValueError
            value = typed[0] if self.kind == KIND_BYTES else np.array(typed, "<f4").tobytes()
            if len(value) != self.width:
                raise ValueError
        except (DecodeError, ValueError):
            raise TFRecordError(self.paths[f], number, offset,
                                f"feature {self.feature!r} is not what the index says: the file changed since it "
                                "was indexed; re-copy it") from None
        self._layouts.learn(payload, value)
        return value
