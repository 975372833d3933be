"""The converter's ``--decode NAME:image:H,W,C``: a spilled column of encoded images -> uint8 (N, H, W, C).

``tools.tfrecord_to_npz`` spills a bytes feature as its concatenated values
and their lengths (``towers.data.tfrecord.columns``).  :func:`decode_images`
decodes them through the data pipeline's one worker pool (``towers.data.workers``;
``workers``; 0: in this process) and its fill loop (``towers.data.image.cache.fill``,
two batches in flight), with the deterministic transform of evaluation
(resize the shorter side, center crop: ``towers.data.image.augment``), into
a new spill file in the same folder (mapped), in record order.  Memory: the
batches in flight (``towers.data.image.cache.fill_rows``), not the column.

An image that does not decode stops the conversion with an
:class:`UndecodableImage` naming the file, the record and the feature (the
converter's exit status 1); the first such record is named, once the column
is decoded.
"""
from __future__ import annotations

import os

import numpy as np

from towers.data.image import cache
from towers.data.image.augment import Transform
from towers.data.jobs import Transformed
from towers.data.tfrecord.schema import UsageError
from towers.data.workers import Workers
from towers.devices.cpu_threads import cpu_count
from towers.files import ArrayBytes


class UndecodableImage(Exception):
    """A record whose image does not decode; the message names the file, the record and the feature."""


class SpilledImages:
    """The encoded images of a spilled bytes column as a source (``towers.data.sources``): row k is
    ``values[ends[k]:ends[k + 1]]`` of the values file, mapped once in each process that reads it."""

    encoded = True

    def __init__(self, values_path, ends, key, ends_of_files=()):
        self.values_path, self.ends, self.key, self.ends_of_files = values_path, ends, key, tuple(ends_of_files)
        self._values = None

    def __getstate__(self):
        return dict(self.__dict__, _values=None)  # each worker maps the file itself

    def __len__(self):
        return len(self.ends) - 1

    def refs(self, rows):
        return np.asarray(rows, np.int64)  # a worker has the ends: only row numbers travel

    def read(self, ref) -> bytes:
        if self._values is None:
            self._values = np.memmap(self.values_path, np.uint8, "r")
        return self._values[self.ends[ref]:self.ends[ref + 1]].tobytes()

    def where(self, ref) -> str:
        """``path: record N: feature 'KEY'`` of the ``ref``-th record of the inputs."""
        start = 0
        for path, end in self.ends_of_files:
            if ref < end:
                return f"{path}: record {ref - start}: feature {self.key!r}"
            start = end
        return f"the inputs: record {ref}: feature {self.key!r}"

    def close(self) -> None:
        self._values = None


class _Decode(Transformed):
    """The decode of a spilled column, failing with the converter's message."""

    def undecodable(self, ref, error) -> str:
        return f"{self.source.where(ref)} is not a decodable image: {error}; re-encode or drop that record"


def decode_images(column, n, size, folder, workers=None, ends_of_files=()):
    """ArrayBytes of the ``n`` encoded images of ``column`` (a spilled bytes column) as uint8 (n, *size).

    ``workers``: input worker processes (None: one per core; 0: this process).  ``ends_of_files``: (path,
    records so far) after each input file, to name an image that does not decode.
    """
    lengths = np.fromfile(column.value_lengths.path, np.int64) if n else np.zeros(0, np.int64)
    if column.present_count != n or len(lengths) != n:
        raise UsageError(f"--decode {column.key}:image: the feature must hold one image in every record, but it is "
                         f"{column.describe(n)}")
    ends = np.concatenate(([0], np.cumsum(lengths)))
    out_path = os.path.join(folder, f"{column.key.replace('/', '_')}.decoded")
    if n == 0:
        open(out_path, "wb").close()
        return ArrayBytes(np.uint8, (0,) + tuple(size), out_path)
    job = _Decode(SpilledImages(column.values.path, ends, column.key, ends_of_files), Transform(size))
    pixels = cache.CachedSource(np.memmap(out_path, np.uint8, "w+", shape=(n,) + tuple(size)), "decoded images")
    pool = Workers(cpu_count() if workers is None else workers)
    try:
        cache.fill(pixels, job, pool, pool.add(job))
    finally:
        pool.close()
    pixels.array.flush()
    del pixels.array
    if pixels.bad:
        bad = pixels.bad[min(pixels.bad)]
        raise bad if isinstance(bad, Exception) else UndecodableImage(bad)
    return ArrayBytes(np.uint8, (n,) + tuple(size), out_path)
