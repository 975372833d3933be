"""Record positions to one examples array: mapped files, batch-wise checks, and no parse where none is needed.

Training from TFRecord files (``towers.data.tfrecord.records.record_examples``)
asks for a global batch of records at random positions; a :class:`Gatherer`
(one per process: the input thread's, or a worker process's) turns them into the examples array.
The example is the content of one bytes field (or one packed float list),
which the protobuf parser does not look into; the rest of a record's payload
is its *frame*.  Two records of the same length and the same frame parse the
same way, their values at the same place.  MNIST has one frame per label, so
after the first few records no record needs the parser:

1. **Gather** (:class:`RecordFile`), for the records of a length with a known
   value start, at least ``BATCH_MIN`` of them: copied out at once, in chunks
   of at most ``CHUNK_BYTES``.  Files are mapped read-only while the mapped
   files fit in ``WINDOW`` bytes: a record is then a row of a NumPy gather (a
   file whose records of that length start at multiples of it is viewed as a
   2-D array; otherwise one slice each).  Mapped pages stay resident once
   read, so files beyond the window are read with one ``os.pread`` a record,
   and the resident size does not grow with the data.
2. **Check** (:func:`~towers.data.tfrecord.framing.framed_intact`): every
   header and payload CRC, as ``check_record`` checks them, for the whole batch;
   and, given the CRCs the index saw (``crcs``), that each footer is still the
   one indexed: a file rewritten in another order with the same size and mtime
   passes every integrity check, but its records would be paired with the
   labels of others (:class:`IndexStale`).
3. **Copy** the value of every record whose frame is known (:class:`Layouts`).
4. **One by one**, every other record (small groups, a frame not known,
   damage, a file that shrank): :class:`RecordReader` (the one record reader,
   which the image path uses too: framing, both CRCs, the index's CRC), then
   its frame looked up,
   else the protobuf parser, which also names what is wrong
   (:class:`~towers.data.tfrecord.framing.TFRecordError`).  A parsed record's
   frame is learned (see :class:`Layouts`: a frame counts once a second
   record has it, and a second parse proves where its value lies).

Records whose frames never repeat (an id or a name in every record) cost a
parse each plus a little bookkeeping until ``TRIES`` candidates have failed to
repeat; a length whose gathered rows are mostly unknown is read one by one
(``OFF_AFTER``).  What gathering saves: ``python -m tools.bench_input``.

Memory, per Gatherer (the input thread's, and each worker process's): the
batch being read (whole records, a few copies, ``CHUNK_BYTES`` at a time),
the frames and candidates (``FRAME_BYTES``, Python's overhead included), and
the mapped files (``WINDOW``).

Sync points: ``read`` and ``close`` hold a lock (the input thread and the
main thread may read one array).  Limits: a file truncated by another program
between the per-batch size check and the gather, or a read error on a mapped
page (a failing disk, a network file system), ends the process with SIGBUS
rather than an error; a float example copied unparsed keeps its stored bits
(so does the parse with protobuf's upb backend, not with its pure-Python one,
which quiets a signalling NaN).
"""
from __future__ import annotations

import itertools
import math
import mmap
import os
import threading

import numpy as np
from google.protobuf.message import DecodeError

from towers.data.tfrecord.framing import FOOTER, HEADER, TFRecordError, check_record, framed_intact
from towers.data.tfrecord.index import forget_index
from towers.data.tfrecord.proto import KIND_BYTES, KIND_LIST_FIELDS, SequenceExample

WINDOW = 64 << 20  # bytes of files one Gatherer maps (their pages stay resident once read)
FRAME_BYTES = 16 << 20  # bytes of frames and candidates one Gatherer keeps (Python's overhead included)
LENGTHS = 64  # payload lengths with a known value start
TRIES = 1024  # candidates (less PROOF_WORTH a proof) before frames are taken not to repeat and learning stops
PROOF_WORTH = 16  # candidates a proved frame pays for: learning goes on while 1 in 16 candidates repeats
OFF_AFTER = 1024  # rows of one length gathered before a low share of known frames stops its gathers
BATCH_MIN = 32  # fewer records of one length than this are read one by one (a gather costs ~50 us)
CHUNK_BYTES = 8 << 20  # whole records copied at once by one gather
# What Python takes besides the frame's bytes (measured with tracemalloc, tests/data/tfrecord/test_gather.py):
_FRAME_OVERHEAD = 96  # a frame proved: a bytes object and its set slot
_CANDIDATE_OVERHEAD = 320  # a candidate: the bytes, its key and record tuples, their ints, a dict slot
_FAILED = object()  # a candidate whose proof failed
STALE = ("the record is not the one indexed (its CRC differs): the file was rewritten since it was indexed "
         "(same size and modification time, other records); run again: the index is built anew")


class IndexStale(TFRecordError):
    """An intact record whose CRC is not the one the index saw: the file changed after it was indexed."""


class RecordFile:
    """One file open for reading records at random: mapped read-only if ``mapped``, else read with ``os.pread``.

    A mapped file keeps one descriptor, the mapping's own.
    """

    def __init__(self, path, mapped):
        self.path = path
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if mapped and self.size else None
        except BaseException:
            os.close(fd)
            raise
        if self._map is not None:
            os.close(fd)
            fd = None
        self._fd = fd
        self._batch, self._good = None, 0
        self._bytes = np.frombuffer(self._map, np.uint8) if self._map is not None else None

    @property
    def mapped(self) -> bool:
        return self._map is not None

    def _in_file(self) -> int:
        """How many mapped bytes are still in the file (past its end they raise SIGBUS): one fstat."""
        return min(self.size, self._map.size())  # mmap.size(): the file's size now

    def read(self, offset, n, batch) -> bytes:
        """The ``n`` bytes at ``offset``, fewer where the file ends first; the file's size is looked up once
        per ``batch`` (a number that changes from one batch to the next)."""
        if self._map is None:
            return os.pread(self._fd, n, offset)
        if self._batch != batch:
            self._batch, self._good = batch, self._in_file()
        return self._map[offset:min(offset + n, self._good)]

    def rows(self, offsets, n):
        """A (k, n) uint8 copy of the ``n`` bytes at each of ``offsets``; None if the file is now shorter."""
        if self._map is None:
            raw = b"".join([os.pread(self._fd, n, o) for o in offsets.tolist()])
            return np.frombuffer(raw, np.uint8).reshape(-1, n) if len(raw) == len(offsets) * n else None
        if int(offsets.max()) + n > self._in_file():
            return None
        if not (offsets % n).any():
            return self._bytes[: self.size // n * n].reshape(-1, n)[offsets // n]
        m = self._map
        return np.frombuffer(b"".join([m[o:o + n] for o in offsets.tolist()]), np.uint8).reshape(-1, n)

    def close(self) -> None:
        self._bytes = None
        try:
            if self._map is not None:
                self._map.close()
        finally:
            if self._fd is not None:
                os.close(self._fd)


class RecordReader:
    """The one reader of indexed records: every path that reads a record at its indexed position comes here
    (raw examples: :class:`Gatherer`, one record at a time or after a gather; encoded images:
    ``towers.data.sources.RecordSource``).

    :meth:`payload` checks what a record read must: its framing and both CRCs
    (``check_record``, a :class:`TFRecordError` naming file, record and
    offset), and that it is still the record indexed (its footer is the CRC
    the index saw, else :class:`IndexStale`, after the file's cached index is
    forgotten so that the next run builds it anew).  Files open on first use,
    one per shard, kept open; mapped (``mapped``) while the files mapped fit
    ``WINDOW``, else read with ``os.pread``.  Not thread-safe (callers hold
    their own lock, or read in one thread).
    """

    def __init__(self, paths, mapped=False):
        self.paths, self._mapping = list(paths), mapped
        self._files: dict[int, RecordFile] = {}
        self._mapped = 0  # bytes of the files mapped

    def file(self, f) -> RecordFile:
        """File number ``f``, opened on first use."""
        file = self._files.get(f)
        if file is None:
            # Map while the mapped files fit the window: their pages stay resident once read.
            size = os.path.getsize(self.paths[f]) if self._mapping else 0
            file = self._files[f] = RecordFile(self.paths[f], self._mapping and self._mapped + size <= WINDOW)
            self._mapped += size if file.mapped else 0
        return file

    def payload(self, f, offset, length, number, crc, raw=None, batch=None) -> bytes:
        """The payload of record ``number`` of file ``f`` (at ``offset``, ``length`` payload bytes, ``crc`` as
        indexed), every check made; ``raw``: the framed record when already read, ``batch``: see
        :meth:`RecordFile.read`."""
        if raw is None:
            raw = self.file(f).read(offset, HEADER + length + FOOTER, batch)
        payload = check_record(raw, length)
        if isinstance(payload, str):
            raise TFRecordError(self.paths[f], number, offset, payload)
        if int.from_bytes(raw[HEADER + length:HEADER + length + FOOTER], "little") != crc:
            forget_index(self.paths[f])  # whichever process meets it: the next run indexes the file anew
            raise IndexStale(self.paths[f], number, offset, STALE)
        return payload

    def close(self) -> None:
        """Close the files opened so far (a later read opens them again)."""
        files, self._files, self._mapped = list(self._files.values()), {}, 0
        errors = []
        for file in files:
            try:
                file.close()
            except Exception as e:  # close the others all the same
                errors.append(e)
        if errors:
            raise errors[0]


class Layouts:
    """Per payload length, where the value starts and the frames known to parse with it there.

    ``value_of(payload)`` is the full parse (the value's stored bytes, or None).
    A frame is learned in two sightings: the first keeps it as a candidate
    (cheap: frames that never repeat, such as those of records with an id or
    a name, cost no more), the second proves the value's place with a second
    parse: the payload with every fourth byte of the value changed must parse
    to the changed bytes.  That rules out a value that is not one piece on the
    wire (a float list in several runs, or unpacked, which the parser joins)
    and happens to be found once elsewhere, in another feature.  (Changing the
    low byte of each float keeps finite floats finite; an infinity becomes a
    NaN, which can only make a proof fail.)  A failed proof is not tried again.
    Frames and candidates together stay within ``FRAME_BYTES``; after
    ``TRIES`` candidates that proofs did not pay back, learning stops and the
    candidates are freed.
    """

    def __init__(self, width, value_of):
        self.width, self._value_of = width, value_of
        self._start: dict[int, int] = {}  # payload length -> where its value starts (proved)
        self._frames: dict[int, set] = {}  # payload length -> frames proved
        self._seen: dict = {}  # (start, frame) -> the record it was seen in, for frames seen in one record
        self._off: set[int] = set()
        self._tries = 0  # candidates kept, less PROOF_WORTH a frame proved
        self._learning = True
        self._hits: dict[int, tuple[int, int]] = {}  # payload length -> (rows known, rows) over its gathers
        self.bytes = 0

    def start(self, length):
        """Where the value starts in payloads of ``length`` bytes; None if unknown or not worth a gather."""
        return None if length in self._off else self._start.get(length)

    def known(self, length, payloads):
        """Bool mask of the rows of ``payloads`` (all ``length`` bytes) whose frame is known."""
        start = self._start[length]
        frames = np.concatenate((payloads[:, :start], payloads[:, start + self.width:]), axis=1)
        keys = frames.view(np.dtype((np.void, frames.shape[1]))).ravel().tolist()  # one bytes object a row
        return np.fromiter(map(self._frames[length].__contains__, keys), bool, len(keys))

    def value(self, payload):
        """The value of ``payload`` if its frame is known, else None."""
        start = self._start.get(len(payload))
        if start is None or payload[:start] + payload[start + self.width:] not in self._frames[len(payload)]:
            return None
        return payload[start:start + self.width]

    def outcome(self, length, hits, total) -> None:
        """A gather of ``length`` found ``hits`` of ``total`` frames known.  Once ``OFF_AFTER`` rows of that
        length have been gathered, fewer than 1 in 4 known stops its gathers: its records are read one by
        one, their frames still looked up (a few frames repeat, most do not)."""
        h, t = self._hits.get(length, (0, 0))
        self._hits[length] = h, t = h + hits, t + total
        if t >= OFF_AFTER and 4 * h < t:
            self._off.add(length)

    def learn(self, payload, value, record) -> None:
        """``payload`` (of ``record``, any hashable name) parsed in full to ``value``: keep its frame as a
        candidate, or prove it when a second record has it."""
        if not self._learning:
            return
        length, w = len(payload), self.width
        start = self._start.get(length)
        if start is None:
            first = payload.find(value) if len(self._start) < LENGTHS else -1
        else:
            first = start if payload[start:start + w] == value else -1
        if first < 0:
            return  # not in one piece, or not where this length has it
        key = (first, payload[:first] + payload[first + w:])
        seen = self._seen.get(key)
        if seen is None:
            self._candidate(key, record)
        elif seen != record and seen is not _FAILED:  # the same record read again (a later epoch) is no repeat
            if self._proves(payload, value, first):
                del self._seen[key]
                self.bytes -= _CANDIDATE_OVERHEAD - _FRAME_OVERHEAD
                self._tries = max(0, self._tries - PROOF_WORTH)
                self._frames.setdefault(length, set()).add(key[1])
                self._start[length] = first  # after the frames exist: known() reads both
            else:
                self._seen[key] = _FAILED  # no second try for this frame

    def _candidate(self, key, record) -> None:
        """Keep a frame seen once; after ``TRIES`` candidates that did not pay for themselves, stop learning."""
        cost = len(key[1]) + _CANDIDATE_OVERHEAD
        if self.bytes + cost > FRAME_BYTES:
            return  # full: the candidates held can still be proved
        self._seen[key] = record
        self.bytes += cost
        self._tries += 1
        if self._tries >= TRIES:  # frames do not repeat here: free the candidates, keep the frames proved
            self.bytes -= sum(len(k[1]) + _CANDIDATE_OVERHEAD for k in self._seen)
            self._seen.clear()
            self._learning = False

    def _proves(self, payload, value, first) -> bool:
        """Whether ``value`` lies at ``first`` in ``payload`` as one piece: found there only, and the payload
        with every fourth byte of it changed parses to the changed bytes."""
        w = self.width
        if payload.find(value) != first or payload.find(value, first + 1) >= 0:
            return False  # twice: which copy is the field's is unknown
        changed = np.frombuffer(payload, np.uint8).copy()
        changed[first:first + w:4] ^= 1
        changed = changed.tobytes()
        return self._value_of(changed) == changed[first:first + w]


class Gatherer:
    """Turns record positions into one examples array (``read``); one per process, one read at a time (a lock)."""

    def __init__(self, paths, feature, kind, dtype, shape):
        self.paths, self.feature, self.kind = paths, feature, kind
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)
        self.out_dtype = np.dtype(np.uint8) if self.dtype == np.uint8 else np.dtype(np.float32)
        self.stored = self.dtype if kind == KIND_BYTES else np.dtype("<f4")  # an example's bytes in the file
        self.width = math.prod(self.shape) * self.stored.itemsize
        self._field = KIND_LIST_FIELDS[kind]
        self._reader = RecordReader(paths, mapped=True)
        self._layouts = Layouts(self.width, self._value_of)
        self._batches = 0  # calls of _records, for the files' size checks
        # The input thread reads batches while the main thread may read others
        # (the divergence check's scan); files, frames and mappings are shared.
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the files opened so far (a later read opens them again)."""
        with self._lock:
            self._reader.close()

    def read(self, files, offsets, lengths, numbers, crcs, into=None):
        """The examples of the records at ``offsets`` (of ``files``, payload ``lengths``, record ``numbers``).

        ``crcs``: the records' masked payload CRCs as indexed; a record whose footer differs raises
        :class:`IndexStale`.  ``into``: a C-contiguous array of the result's shape and ``out_dtype`` to
        fill and return (a batch's shared memory: the stored bytes go straight there when they are the
        result's, else they are converted into it).
        """
        n, shape = len(numbers), (len(numbers),) + self.shape
        direct = into is not None and self.stored == self.out_dtype
        out = into.reshape(n, -1).view(np.uint8) if direct else np.empty((n, self.width), np.uint8)
        with self._lock:
            if n and lengths.min() == lengths.max():  # the usual batch: no index arrays to build
                self._read_length(out, slice(None), files, offsets, numbers, int(lengths[0]), crcs)
            elif n:
                self._read_lengths(out, files, offsets, lengths, numbers, crcs)
        if direct:
            return into
        examples = out.view(self.stored).reshape(shape).astype(self.out_dtype, copy=False)
        if into is None:
            return examples
        into[...] = examples
        return into

    def _read_lengths(self, out, files, offsets, lengths, numbers, crcs) -> None:
        """Records of several lengths: gathers for the lengths with many records and a known start, the rest one
        by one (a batch of varying lengths has many small groups, and a group costs a few NumPy calls)."""
        values, group, counts = np.unique(lengths, return_inverse=True, return_counts=True)
        big = [k for k, (n, c) in enumerate(zip(values.tolist(), counts.tolist()))
               if c >= BATCH_MIN and self._layouts.start(n) is not None]
        for k in big:
            rows = np.flatnonzero(group == k)
            self._read_length(out, rows, files[rows], offsets[rows], numbers[rows], int(values[k]), crcs[rows])
        rest = np.flatnonzero(~np.isin(group, big)) if big else np.arange(len(out))
        self._records(out, rest, files[rest], offsets[rest], lengths[rest].tolist(), numbers[rest],
                      crcs[rest])

    def _read_length(self, out, rows, files, offsets, numbers, length, crcs) -> None:
        """Fill ``out[rows]`` (all rows as ``slice(None)``, or row numbers) with the examples of records whose
        payloads are all ``length`` bytes."""
        start, chunk = self._layouts.start(length), CHUNK_BYTES // (HEADER + length + FOOTER)
        if start is None or len(offsets) < BATCH_MIN or chunk < BATCH_MIN:
            self._records(out, np.arange(len(out))[rows], files, offsets, itertools.repeat(length), numbers, crcs)
            return
        for c in range(0, len(offsets), chunk):
            part = slice(c, c + chunk)
            self._gathered(out, part if isinstance(rows, slice) else rows[part], files[part], offsets[part],
                           numbers[part], length, start, crcs[part])

    def _gathered(self, out, rows, files, offsets, numbers, length, start, crcs) -> None:
        """Steps 1-3 for records of one length and a known start; the others record by record."""
        framed = self._gather(files, offsets, HEADER + length + FOOTER)
        if framed is None:  # a file shrank: record by record, which says where
            fast, rows = np.zeros(len(offsets), bool), np.arange(len(out))[rows]
        else:
            payloads = framed[:, HEADER:HEADER + length]
            fast = self._layouts.known(length, payloads) & framed_intact(framed, length)
            # The indexed records still: one compare of the footers (step 4 says which not).
            fast &= np.ascontiguousarray(framed[:, HEADER + length:]).view("<u4")[:, 0] == crcs
            self._layouts.outcome(length, int(fast.sum()), len(fast))
            if fast.all():
                out[rows] = payloads[:, start:start + self.width]
                return
            rows = np.arange(len(out))[rows]
            out[rows[fast]] = payloads[fast, start:start + self.width]
        slow = np.flatnonzero(~fast)
        raws = None if framed is None else [framed[i].tobytes() for i in slow]  # read already: no second read
        self._records(out, rows[slow], files[slow], offsets[slow], itertools.repeat(length), numbers[slow],
                      crcs[slow], raws)

    def _gather(self, files, offsets, n):
        """The whole records (k, n) at ``offsets`` of ``files``; None if a file shrank since it was indexed."""
        if files.min() == files.max():
            return self._reader.file(int(files[0])).rows(offsets, n)
        framed = np.empty((len(offsets), n), np.uint8)
        for f in np.unique(files).tolist():
            at = files == f
            part = self._reader.file(f).rows(offsets[at], n)
            if part is None:
                return None
            framed[at] = part
        return framed

    def _records(self, out, rows, files, offsets, lengths, numbers, crcs, raws=None) -> None:
        """Step 4 for each record: ``out[rows]`` (row numbers) from the records at these positions
        (``raws``: their bytes, when already read; ``crcs``: their CRCs as indexed)."""
        batch = self._batches = self._batches + 1
        values = [self._record(f, o, n, k, crc, raw, batch) for f, o, n, k, crc, raw in zip(
            files.tolist(), offsets.tolist(), lengths, numbers.tolist(),
            crcs.tolist(), raws or itertools.repeat(None))]
        out[rows] = np.frombuffer(b"".join(values), np.uint8).reshape(len(values), self.width)

    def _record(self, f, offset, length, number, crc, raw, batch) -> bytes:
        """One record's example, its stored bytes: its frame looked up, else a full parse (and learned)."""
        payload = self._reader.payload(f, offset, length, number, crc, raw, batch)
        value = self._layouts.value(payload)
        if value is None:
            value = self._value_of(payload)
            if value is None:
                raise TFRecordError(self.paths[f], number, offset,
                                    f"feature {self.feature!r} is not what the index says: the file changed since "
                                    "it was indexed; re-copy it")
            self._layouts.learn(payload, value, (f, number))
        return value

    def _value_of(self, payload):
        """The full parse: the example's stored bytes in ``payload``, or None if it has no such example."""
        try:
            typed = getattr(SequenceExample.FromString(payload).context.feature[self.feature], self._field).value
        except DecodeError:
            return None
        if self.kind == KIND_BYTES:
            value = typed[0] if len(typed) == 1 else None
        else:
            value = np.array(typed, "<f4").tobytes()
        return value if value is not None and len(value) == self.width else None
