"""The decoded-image cache: a training set of encoded images decoded once, then served from memory.

Decoding is the costly stage of an encoded-image set (JPEG or PNG in
TFRecord records, an image folder), and without a cache every epoch decodes
every image again.  When the decoded training set fits under the budget
(``cache_images_mib``), :func:`fill` decodes it once, before the first
step, into one uint8 (N, H, W, C) array, and the training array
(``towers.data.image.array.ImageArray``) then reads a :class:`CachedSource`
over that array instead of the files.

**What is cached.**  The decode stage only: each image decoded and fitted to
H x W (``Transform`` with ``augment`` none: resize the shorter side, center
crop; a no-op for images already H x W), before augmentation and
normalization.  Those still run on every read, with the same per-example
draws from (seed, epoch, index), so augmentation still differs each epoch
and the batches are byte-identical to those made without the cache, and to
those of an npz holding the same decoded pixels, whatever the worker count
and across a resume.  Without augmentation or normalization the batch is a
gather from the array in the input thread (no worker hand-off); ``cifar``
crops run in the input thread too (cheaper than sending the pixels); the
float work of ``tf-cifar10`` and ``normalize`` runs in the input workers, on
the rows sent with each chunk, as for an npz (``towers.data.image.load``
gives the figures).

**Not cached:** ``augment`` imagenet (it decodes each crop from the encoded
image at a DCT scale, so pixels decoded once at full size would change its
results), a test split (evaluated from the files, as before), and a set over
the budget, which streams as before after one notice that gives the size it
would need.

**Bad input** is found while filling and answered when the row is read, as
without the cache: an image that does not decode gives the same message (the
run stops, or with ``on_error`` skip the same replacement and the same
count, once per read); a record that fails its checks (its CRC against the
index: the file changed since it was indexed) raises the same error.  Every
record is read in full once and checked against its index as it is decoded.
A file that changes after the cache is full is not read again and so is not
noticed: the run trains on the copy it checked, which is what the file held
when the run began, never a mix of two versions.

Sync point: :func:`fill` waits for the whole decode (the pool's workers,
``workers``; a progress bar when ``progress``).  Limits: the cache lives in
the main process (workers get the rows of their chunks); it is held until
the data set is collected.
"""
from __future__ import annotations

import numpy as np

from towers.data.sources import ArraySource, SourceError
from towers.data.tfrecord.framing import TFRecordError
from towers.data.workers import WorkerDied, transform_rows
from towers.errors import TrainingError

MIB = 1 << 20
FILL_ROWS = 512  # rows per fill batch and worker: large enough that the hand-offs do not show


def nbytes(n: int, size) -> int:
    """Bytes of ``n`` decoded uint8 images of ``size`` (H, W, C)."""
    return int(n) * int(np.prod(size))


def cacheable(source, augment: str) -> bool:
    """Whether decoding ``source`` once leaves the results unchanged: encoded images, not ``augment`` imagenet."""
    return bool(getattr(source, "encoded", False)) and augment != "imagenet"


class CachedSource(ArraySource):
    """Rows of the decoded array, with what failed while filling: ``bad[row]`` is the message of an image that
    does not decode (read as a ``SourceError``, replaced or fatal as ``on_error`` says) or the exception of a
    record that failed its checks (raised).  The mark travels with the ref, so a worker needs no table."""

    def __init__(self, array, name):
        super().__init__(array, name)
        self.bad: dict = {}

    def refs(self, rows):
        rows = np.asarray(rows, np.int64)
        return [(r, self.array[r], self.bad.get(r)) for r in rows.tolist()]

    def read(self, ref) -> np.ndarray:
        bad = ref[2]
        if bad is None:
            return ref[1]
        if isinstance(bad, Exception):
            raise bad
        raise SourceError(bad)

    def read_rows(self, refs, out):
        """The whole chunk at once (a gather: no transform); returns (k, message) of the rows that failed."""
        rows = np.fromiter((r for r, _, _ in refs), np.int64, len(refs))
        np.take(self.array, rows, axis=0, out=out)
        failed = []
        for k, (_, _, bad) in enumerate(refs):
            if isinstance(bad, Exception):
                raise bad
            if bad is not None:
                failed.append((k, bad))
        return failed

    @property
    def example_shape(self):
        return tuple(self.array.shape[1:])


def fill(cache: CachedSource, source, decode, pool, sid: int, progress: bool = False) -> None:
    """Decode every row of ``source`` (``decode``: registered with ``pool`` as ``sid``) into ``cache.array``,
    recording what fails in ``cache.bad``.  A chunk that raised (a record that failed its checks) is decoded
    again row by row here, so that only its failing rows carry the error."""
    from tqdm import tqdm

    n = len(source)
    step = FILL_ROWS * max(pool.n, 1)
    starts = list(range(0, n, step))
    with tqdm(total=n, desc="decoding images", unit="img", disable=not progress, dynamic_ncols=True,
              leave=False) as bar:
        pending = []
        for k, a in enumerate(starts + [None, None]):
            if a is not None:
                rows = np.arange(a, min(a + step, n), dtype=np.int64)
                pending.append((rows, _start(pool, sid, rows)))
            if len(pending) > 1 or (a is None and pending):  # two batches in flight keep the workers busy
                rows, chunks = pending.pop(0)
                _take(cache, source, decode, rows, chunks)
                bar.update(len(rows))


def _start(pool, sid, rows):
    try:
        return pool.start(sid, rows)
    except (TFRecordError, WorkerDied) as e:
        return e


def _take(cache, source, decode, rows, chunks) -> None:
    try:
        if isinstance(chunks, Exception):
            raise chunks
        out, failed = chunks.wait()
    except WorkerDied as e:
        raise TrainingError(str(e)) from None
    except TFRecordError:
        for r in rows.tolist():
            try:
                failed = transform_rows(source, decode, source.refs([r]), None, [r], cache.array[r:r + 1])
            except TFRecordError as e:
                cache.bad[r] = e
                continue
            if failed:
                cache.bad[r] = failed[0][1]
        return
    cache.array[rows] = out
    for k, message in failed:
        cache.bad[int(rows[k])] = message
