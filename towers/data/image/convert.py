"""The converter's ``--decode NAME:image:H,W,C``: a spilled column of encoded images -> uint8 (N, H, W, C).

``tools.tfrecord_to_npz`` spills a bytes feature as its concatenated values
and their lengths (``towers.data.tfrecord.columns``).  :func:`decode_images`
decodes them in chunks of ``CHUNK`` images, in a pool of worker processes
(``workers``; 0: in this process), with the deterministic transform of
evaluation (resize the shorter side, center crop: ``towers.data.image.augment``),
and appends the pixels to a new spill file in the same folder, in record order.
Memory: the chunks in flight (twice the workers), not the column.

An image that does not decode stops the conversion with an
:class:`UndecodableImage` naming the file, the record and the feature (the
converter's exit status 1).
"""
from __future__ import annotations

import concurrent.futures
import os

import numpy as np

from towers.data.image.augment import Transform
from towers.data.orphans import watch_parent
from towers.data.spawning import spawn_context
from towers.data.image.codec import ImageError
from towers.data.tfrecord.schema import UsageError
from towers.devices.cpu_threads import cpu_count
from towers.output.files import ArraySource

CHUNK = 256  # images a task decodes


class UndecodableImage(Exception):
    """A record whose image does not decode; the message names the file, the record and the feature."""


def _decode_chunk(transform, values, ends, first):
    """uint8 pixels of the images ``values[ends[k]:ends[k + 1]]``; (None, k) for the first that fails."""
    out = np.empty((len(ends) - 1,) + transform.shape, np.uint8)
    for k in range(len(out)):
        try:
            out[k] = transform(values[ends[k]:ends[k + 1]])
        except ImageError as e:
            return None, (first + k, str(e))
    return out, None


def _where(row, ends_of_files):
    """(path, record number in it) of the ``row``-th record of the inputs."""
    start = 0
    for path, end in ends_of_files:
        if row < end:
            return path, row - start
        start = end
    return "the inputs", row


def decode_images(column, n, size, folder, workers=None, ends_of_files=()):
    """ArraySource of the ``n`` encoded images of ``column`` (a spilled bytes column) as uint8 (n, *size)."""
    lengths = np.fromfile(column.value_lengths.path, np.int64) if n else np.zeros(0, np.int64)
    if column.present_count != n or len(lengths) != n:
        raise UsageError(f"--decode {column.key}:image: the feature must hold one image in every record, but it is "
                         f"{column.describe(n)}")
    ends = np.concatenate(([0], np.cumsum(lengths)))
    values = np.memmap(column.values.path, np.uint8, "r") if ends[-1] else np.zeros(0, np.uint8)
    transform = Transform(size)
    out_path = os.path.join(folder, f"{column.key.replace('/', '_')}.decoded")
    workers = cpu_count() if workers is None else workers
    chunks = [(a, min(a + CHUNK, n)) for a in range(0, n, CHUNK)]

    def args(a, b):
        return transform, bytes(values[ends[a]:ends[b]]), ends[a:b + 1] - ends[a], a

    with open(out_path, "wb") as f:
        if workers == 0:
            results = (_decode_chunk(*args(a, b)) for a, b in chunks)
        else:
            pool = concurrent.futures.ProcessPoolExecutor(workers, spawn_context(),
                                                          watch_parent)  # no worker outlives a killed converter
            results = _in_order(pool, chunks, args, 2 * workers)
        for pixels, failed in results:
            if failed is not None:
                path, number = _where(failed[0], ends_of_files)
                raise UndecodableImage(f"{path}: record {number}: feature {column.key!r} is not a decodable "
                                       f"image: {failed[1]}; re-encode or drop that record")
            f.write(pixels.data)
    return ArraySource(np.uint8, (n,) + tuple(size), out_path)


def _in_order(pool, chunks, args, depth):
    """The chunks' results in order, at most ``depth`` submitted ahead; the pool ends with the generator."""
    with pool:
        pending = []
        for a, b in chunks:
            pending.append(pool.submit(_decode_chunk, *args(a, b)))
            if len(pending) >= depth:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()
