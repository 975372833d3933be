"""TFRecord framing: reading and writing records, CRC checks, compression.

A TFRecord file is a sequence of records, each::

    uint64 length (little-endian) | uint32 masked CRC32C of those 8 bytes
    payload (length bytes)        | uint32 masked CRC32C of the payload

with ``masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2**32)``.
The whole stream may be gzip- or zlib-compressed.

Reading (:class:`TFRecordReader`) walks a large in-memory chunk (8 MiB by
default) at a time and yields the payloads of the complete records in it as
one :class:`RecordBatch`; only the tail of an unfinished record is carried to
the next chunk, so memory is bounded by the chunk size plus the largest record.
Both CRCs are checked with the C implementation of ``google-crc32c``.

Damage is reported as :class:`TFRecordError`, one line naming the file, the
record index, the byte offset of the record (in the decompressed stream for
compressed files) and what is wrong.  The reader is stricter than TensorFlow:
a file ending inside a 12-byte record header, and a non-empty file shorter
than one header, are errors rather than a silent end of data.  With
``on_error="skip"`` only records whose payload CRC fails while the framing is
intact are dropped (and counted in :attr:`TFRecordReader.skipped`).
"""

import functools
import os
import struct
import sys
import zlib

import google_crc32c
import numpy as np

from towers.errors import InputError

COMPRESSIONS = ("auto", "none", "gzip", "zlib")
HEADER = 12  # uint64 length + uint32 length CRC
FOOTER = 4  # uint32 payload CRC
_MASK_DELTA = 0xA282EAD8
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "zlib": zlib.MAX_WBITS}
_HEADER_STRUCT = struct.Struct("<QI")
_CRC_STRUCT = struct.Struct("<I")
# What is wrong, as the reports say it (the streaming reader and check_record share them).
LENGTH_CRC = ("length CRC mismatch: the record header is corrupted and the records after it cannot be located; "
              "re-copy the file")
PAYLOAD_CRC = ("payload CRC mismatch: the record is corrupted; re-copy the file, or pass `on_error` skip to drop "
               "such records")


class TFRecordError(InputError):
    """Damaged or unreadable TFRecord input; ``str()`` is the one-line report."""

    def __init__(self, path, index, offset, what, compressed=False):
        where = "byte offset" + (" (decompressed)" if compressed else "")
        super().__init__(f"{path}: record {index} at {where} {offset}: {what}")
        self.path, self.index, self.offset = path, index, offset
        self._args = (path, index, offset, what, compressed)

    def __reduce__(self):  # rebuilt from its own arguments when it crosses from a worker process
        return type(self), self._args


def masked_crc(data):
    """TensorFlow's masked CRC32C of ``data`` (bytes)."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(payload):
    """One TFRecord record (header, payload, footer) as bytes."""
    length = struct.pack("<Q", len(payload))
    return b"".join((length, _CRC_STRUCT.pack(masked_crc(length)), payload,
                     _CRC_STRUCT.pack(masked_crc(payload))))


def header_intact(head) -> bool:
    """Whether ``head`` (a file's first bytes) starts with a record header whose length CRC matches."""
    return len(head) >= HEADER and masked_crc(head[:8]) == _CRC_STRUCT.unpack_from(head, 8)[0]


def detect_compression(head):
    """Guess the compression of a file from its first bytes: none, gzip or zlib.

    A valid first record header (its length CRC matches) means ``none``, which
    also settles the rare uncompressed file whose first two bytes happen to
    form a zlib header.  Otherwise the gzip magic ``1f 8b`` means ``gzip`` and
    a valid zlib header (deflate, window <= 32K, header checksum) ``zlib``.
    Anything else is read as ``none`` so that framing reports what is wrong.
    """
    if header_intact(head):
        return "none"
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if len(head) >= 2 and head[0] & 0x0F == 8 and head[0] >> 4 <= 7 and (head[0] << 8 | head[1]) % 31 == 0:
        return "zlib"
    return "none"


class _StreamError(Exception):
    """The compressed stream itself is damaged or ends early."""


class _PlainStream:
    """Uncompressed file bytes; ``consumed`` counts bytes read from disk."""

    def __init__(self, fileobj):
        self._file = fileobj
        self.consumed = 0

    def read(self, size):
        data = self._file.read(size)
        self.consumed += len(data)
        return data


class _InflateStream:
    """gzip or zlib decompression with bounded output per call.

    ``read(size)`` returns at most ``size`` decompressed bytes (``max_length``
    keeps a highly compressed input from exploding in memory) and ``b""`` only
    at a clean end of stream.  Concatenated streams (multi-member gzip) are
    read one after the other.  A stream that stops before its end marker, or
    does not inflate, raises :class:`_StreamError`.
    """

    _RAW_CHUNK = 1 << 16  # small, so a damaged stream loses little of the good data before it

    def __init__(self, fileobj, compression):
        self._file = fileobj
        self._kind = compression
        self._inflate = zlib.decompressobj(_WBITS[compression])
        self._pending = None
        self.consumed = 0

    def _raw(self):
        data = self._file.read(self._RAW_CHUNK)
        self.consumed += len(data)
        return data

    def read(self, size):
        if self._pending:
            raise _StreamError(self._pending)
        out, got = [], 0
        try:
            while got < size:
                piece = self._inflate_some(size - got)
                if piece is None:
                    break
                out.append(piece)
                got += len(piece)
        except _StreamError as exc:
            if not out:
                raise
            self._pending = str(exc)  # hand out the good data first; fail on the next call
        return b"".join(out)

    def _inflate_some(self, size):
        """Up to ``size`` more decompressed bytes; None at a clean end of stream."""
        source = self._inflate.unconsumed_tail
        if not source:
            if self._inflate.eof:
                source = self._inflate.unused_data or self._raw()
                if not source:
                    return None
                self._inflate = zlib.decompressobj(_WBITS[self._kind])
            else:
                source = self._raw()
                if not source:
                    raise _StreamError(f"the {self._kind} stream ends before its end marker: the file is "
                                       "truncated; re-copy it")
        try:
            piece = self._inflate.decompress(source, size)
        except zlib.error as exc:
            reason = str(exc).split(": ", 1)[-1]
            hint = (f"is the file really {self._kind}-compressed? Try `compression` auto"
                    if "header" in reason else "the compressed data is damaged; re-copy the file")
            raise _StreamError(f"{self._kind} inflate failed ({reason}): {hint}") from None
        return piece


class RecordBatch:
    """Payloads of consecutive good records, with their indices, byte offsets and masked payload CRCs
    (the footers: what identifies each record's bytes for a reader that indexed them)."""

    __slots__ = ("payloads", "indices", "offsets", "crcs")

    def __init__(self, payloads, indices, offsets, crcs=None):
        self.payloads, self.indices, self.offsets, self.crcs = payloads, indices, offsets, crcs


class TFRecordReader:
    """Iterate over one TFRecord file as :class:`RecordBatch` objects.

    ``compression`` is one of :data:`COMPRESSIONS`; after construction
    :attr:`compression` holds the one in use (``auto`` resolved).  Attributes
    updated while iterating: ``records`` (good records yielded), ``skipped``
    (payload-CRC failures dropped with ``on_error="skip"``) and ``consumed``
    (bytes read from the file, for progress).
    """

    def __init__(self, path, compression="auto", on_error="stop", chunk_size=8 << 20):
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
        if on_error not in ("stop", "skip"):
            raise ValueError(f"on_error must be 'stop' or 'skip', not {on_error!r}")
        self.path = path
        self.size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER)
        if compression == "auto":
            compression = detect_compression(head)
        self.compression = compression
        self._head = head
        self.on_error = on_error
        self.chunk_size = chunk_size
        self.records = self.skipped = 0
        self._stream = None

    @property
    def consumed(self):
        return self._stream.consumed if self._stream else 0

    def _error(self, index, offset, what):
        return TFRecordError(self.path, index, offset, what, self.compression != "none")

    def _bad_first_header(self):
        """Explain a first record whose header fails: usually not a TFRecord at all."""
        guess = detect_compression(self._head)
        if self.compression == "none" and guess != "none":
            return f"not a TFRecord file: it looks {guess}-compressed; use `compression` {guess} or auto"
        return "not a TFRecord file (the first record header fails its CRC); is this even a TFRecord file?"

    def __iter__(self):
        with open(self.path, "rb") as f:
            self._stream = _PlainStream(f) if self.compression == "none" else _InflateStream(f, self.compression)
            yield from self._batches(self._stream)

    def _batches(self, stream):
        unpack_header, unpack_crc, crc32c = _HEADER_STRUCT.unpack_from, _CRC_STRUCT.unpack_from, google_crc32c.value
        skip = self.on_error == "skip"
        buf, pos, base, index = b"", 0, 0, 0
        want = self.chunk_size
        eof, stream_error = False, None
        while not eof:
            try:
                data = stream.read(want)
            except _StreamError as exc:
                data, stream_error = b"", str(exc)
            eof = not data
            buf, base, pos = buf[pos:] + data, base + pos, 0
            end = len(buf)
            want = self.chunk_size
            payloads, indices, offsets, crcs = [], [], [], []
            while end - pos >= HEADER:
                length, length_crc = unpack_header(buf, pos)
                crc = crc32c(buf[pos:pos + 8])
                if (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF != length_crc:
                    if index == 0:
                        raise self._error(index, base + pos, self._bad_first_header())
                    raise self._error(index, base + pos, LENGTH_CRC)
                stop = pos + HEADER + length
                if stop + FOOTER > end:
                    # An uncompressed file's size bounds what is still to come: a length beyond it (a wrong length
                    # whose CRC happens to hold) is found here, not by asking for that many bytes.
                    on_disk = self.size - stream.consumed if self.compression == "none" else 0
                    if not eof and (self.compression != "none" or stop + FOOTER - end <= on_disk):
                        want = max(self.chunk_size, min(stop + FOOTER - end, sys.maxsize))  # at least the rest
                        break
                    raise self._error(index, base + pos, stream_error or (
                        f"the file ends inside the record ({length} byte payload needs "
                        f"{HEADER + length + FOOTER} bytes, {end - pos + on_disk} left): the file is truncated; "
                        "re-copy it"))
                payload = buf[pos + HEADER:stop]
                crc = crc32c(payload)
                footer = unpack_crc(buf, stop)[0]
                if (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF != footer:
                    if not skip:
                        raise self._error(index, base + pos, PAYLOAD_CRC)
                    self.skipped += 1
                else:
                    payloads.append(payload)
                    indices.append(index)
                    offsets.append(base + pos)
                    crcs.append(footer)
                pos = stop + FOOTER
                index += 1
            if payloads:
                self.records += len(payloads)
                yield RecordBatch(payloads, indices, offsets, crcs)
        if stream_error:
            raise self._error(index, base + pos, stream_error)
        if pos < end:
            if index == 0 and base == 0:
                what = (f"not a TFRecord file: only {end} bytes, fewer than one {HEADER}-byte record header")
            else:
                what = (f"the file ends {end - pos} bytes into a {HEADER}-byte record header: "
                        "the file is truncated; re-copy it")
            raise self._error(index, base + pos, what)


def check_record(raw, length):
    """The payload of ``raw``, the bytes read where a record whose payload is ``length`` bytes should be.

    For random access to uncompressed files (``towers.data.tfrecord.gather``).
    The header must give ``length`` and both CRCs must hold; otherwise the
    return value is a str saying what is wrong (the caller knows the record's
    index and offset and builds the :class:`TFRecordError`).
    """
    if len(raw) < HEADER + length + FOOTER:
        return (f"the file ends inside the record ({length} byte payload needs {HEADER + length + FOOTER} bytes, "
                f"{len(raw)} left): the file is truncated; re-copy it")
    header_length, header_crc = _HEADER_STRUCT.unpack_from(raw)
    crc = google_crc32c.value(raw[:8])  # masked_crc inlined: this runs once per record read
    if header_length != length or (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF != header_crc:
        return LENGTH_CRC
    payload = raw[HEADER:HEADER + length]
    crc = google_crc32c.value(payload)
    if (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF != _CRC_STRUCT.unpack_from(raw, HEADER + length)[0]:
        return PAYLOAD_CRC
    return payload


@functools.lru_cache(maxsize=8)
def _payload_slices(length, k):
    """Where the payloads lie in ``k`` whole records of ``length`` laid end to end (kept: batches repeat)."""
    step = HEADER + length + FOOTER
    return tuple(slice(s, s + length) for s in range(HEADER, k * step, step))


def framed_intact(rows, length):
    """Which records of ``rows`` are intact: :func:`check_record`'s checks for many records of one length at once.

    ``rows`` is a (k, HEADER + length + FOOTER) uint8 array of whole records
    as they lie in the file.  The header must be the one every record of
    ``length`` has (the length and its masked CRC: 12 equal bytes, compared at
    once) and the payload's CRC32C must match its footer (one C call each).
    Returns a bool array; :func:`check_record` says what is wrong with a
    failure.
    """
    length_bytes = struct.pack("<Q", length)
    header = np.frombuffer(length_bytes + _CRC_STRUCT.pack(masked_crc(length_bytes)), np.uint8)
    good = (rows[:, :HEADER] == header).all(axis=1)
    payloads = map(rows.tobytes().__getitem__, _payload_slices(length, len(rows)))
    crcs = np.fromiter(map(google_crc32c.value, payloads), np.uint32, len(rows))
    masked = ((crcs >> np.uint32(15)) | (crcs << np.uint32(17))) + np.uint32(_MASK_DELTA)  # wraps mod 2**32
    return good & (masked == np.ascontiguousarray(rows[:, HEADER + length:]).view("<u4")[:, 0])


class TFRecordWriter:
    """Write framed records to an open binary file, optionally compressed.

    ``compression`` is ``none``, ``gzip`` or ``zlib``; call :meth:`close` (or
    use ``with``) to flush the compressor's end marker.  The file object is
    not closed.
    """

    def __init__(self, fileobj, compression="none"):
        if compression not in ("none", "gzip", "zlib"):
            raise ValueError(f"compression must be none, gzip or zlib, not {compression!r}")
        self._file = fileobj
        self._deflate = None if compression == "none" else zlib.compressobj(6, zlib.DEFLATED, _WBITS[compression])

    def write(self, payload):
        record = frame(payload)
        self._file.write(self._deflate.compress(record) if self._deflate else record)

    def close(self):
        if self._deflate:
            self._file.write(self._deflate.flush())
            self._deflate = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
