"""The decoded-image cache: a training set of encoded images decoded once, then served from memory.

When the decoded training set fits under the budget
(``cache_images_mib``), :func:`fill` decodes it once, before the first
step, into one uint8 (N, H, W, C) array, and the training array
(``towers.data.examples.Examples``) then reads a :class:`CachedSource`
over that array instead of the files.

**What is cached.**  The decode only: each image decoded and fitted to
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
results), a test split (evaluated from the files), a set over
the budget, which streams after one notice that gives the size it
would need, and a set the process has no memory for (:func:`not_cached`): the
budget is checked against what this process may still take (``ulimit -v``
and ``-d`` less what it maps, its cgroup's memory limit less its use, the
machine's available memory; :func:`memory_room`), and the cache, with the
batches that fill it (at most ``FILL_BYTES`` each, two in flight), takes at
most ``SHARE`` of that, the rest being the run's own.  It streams then,
after one notice naming the limit; an allocation that fails anyway (limits
that cannot be read, another process taking the memory meanwhile) falls
back the same way.  Under a cgroup limit the allocation itself would not
fail: its pages, touched while filling, would get the process OOM-killed;
hence the check before.

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

import os
import resource

import numpy as np

from towers.data.sources import ArraySource, SourceError
from towers.data.tfrecord.framing import TFRecordError
from towers.data.workers import WorkerDied
from towers.errors import InputError, TrainingError

MIB = 1 << 20
FILL_ROWS = 512  # rows per fill batch and worker: large enough that the hand-offs do not show
FILL_BYTES = 32 << 20  # a fill batch's decoded pixels at most: two in flight are the fill's own memory
SHARE = 0.75  # of the memory the process may still take, what the cache may use: the run needs the rest
_UNLIMITED = 1 << 62  # a cgroup v1 limit at or above this is none (the kernel writes 2**63 less a page)


def nbytes(n: int, size) -> int:
    """Bytes of ``n`` decoded uint8 images of ``size`` (H, W, C)."""
    return int(n) * int(np.prod(size))


def memory_room(root: str = "/") -> list[tuple[str, int]]:
    """(limit, bytes this process may still take under it) for each limit the system reports (Linux: /proc,
    /sys/fs/cgroup; elsewhere none): ``ulimit -v`` less the address space mapped (``VmSize``), ``ulimit -d``
    less the data mapped (``VmData``), each cgroup memory limit on the way to the root less its use, its
    inactive page cache (reclaimable) not counted, and the machine's available memory (``MemAvailable``).
    ``root``: where /proc and /sys are (tests give a folder that mimics them)."""
    room = []
    status = _fields(os.path.join(root, "proc/self/status"))
    for limit, key, what in ((resource.RLIMIT_AS, "VmSize", "the address-space limit (ulimit -v)"),
                             (resource.RLIMIT_DATA, "VmData", "the data-segment limit (ulimit -d)")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY and key in status:
            room.append((what, soft - status[key] * 1024))
    room += _cgroup_room(root)
    available = _fields(os.path.join(root, "proc/meminfo")).get("MemAvailable")
    if available is not None:
        room.append(("the machine's available memory", available * 1024))
    return room


def _fields(path: str) -> dict[str, int]:
    """``Key: value [kB]`` lines (/proc/self/status, /proc/meminfo) as {key: int}; {} when unreadable."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if value.split() and value.split()[0].isdigit():
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _cgroup_room(root: str) -> list[tuple[str, int]]:
    """The room under this process's cgroup memory limits (v2 ``memory.max``, v1 ``memory.limit_in_bytes``),
    its own cgroup's and its ancestors' (a parent's limit binds too).  Inside a container the path listed
    may not exist under the mount (the container's cgroup is its root): the walk up ends there."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    room = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            mount, files = os.path.join(root, "sys/fs/cgroup"), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            mount, files = os.path.join(root, "sys/fs/cgroup/memory"), ("memory.limit_in_bytes",
                                                                       "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        mount = os.path.normpath(mount)
        folder = os.path.normpath(os.path.join(mount, path.lstrip("/")))
        while folder.startswith(mount):
            limit, used = _read_int(os.path.join(folder, files[0])), _read_int(os.path.join(folder, files[1]))
            if limit is not None and used is not None and limit < _UNLIMITED:
                inactive = _fields_space(os.path.join(folder, "memory.stat")).get(files[2], 0)
                room.append(("the cgroup memory limit", limit - max(used - inactive, 0)))
            if folder == mount:
                break
            folder = os.path.dirname(folder)
    return room


def _fields_space(path: str) -> dict[str, int]:
    """``key value`` lines (a cgroup's memory.stat) as {key: int}; {} when unreadable."""
    try:
        with open(path) as f:
            return {k: int(v) for k, v in (line.split() for line in f if len(line.split()) == 2) if v.isdigit()}
    except OSError:
        return {}


def fill_rows(example_bytes: int, workers: int) -> int:
    """Rows of one fill batch: ``FILL_ROWS`` a worker, at most ``FILL_BYTES`` of decoded pixels (large images:
    a batch of 512 ImageNet-sized ones would take 384 MiB besides the cache)."""
    return max(1, min(FILL_ROWS * max(workers, 1), FILL_BYTES // max(int(example_bytes), 1)))


def fill_bytes(n: int, size, workers: int) -> int:
    """The memory :func:`fill` takes besides the cache, for ``n`` images of ``size``: two batches in flight."""
    one = nbytes(1, size)
    return 2 * min(int(n), fill_rows(one, workers)) * one


ALLOCATION_FAILED = ("and allocating them failed (out of memory): they are decoded every epoch; free memory to "
                     "decode them once")


def not_cached(need: int, budget_mib: int, room: list[tuple[str, int]], filling: int = 0) -> str | None:
    """Why a cache of ``need`` bytes is not made, as the end of the notice that says so; None: it is made.

    Over the budget (``cache_images_mib``); or, with what filling it takes besides (``filling``:
    :func:`fill_bytes`), over ``SHARE`` of what this process may still take under one of the limits in
    ``room`` (:func:`memory_room`; the tightest is named; none known: it is made, and an allocation of the
    cache that fails falls back, ``ALLOCATION_FAILED``).
    """
    if need > budget_mib * MIB:
        return (f"over `cache_images_mib` {budget_mib}: they are decoded every epoch; set `cache_images_mib` "
                f"{-(-need // MIB)} or more to decode them once")
    for what, left in sorted(room, key=lambda r: r[1]):
        if need + filling > SHARE * left:
            return (f"more than this process may take under {what} ({max(left, 0) / MIB:.1f} MiB left, of which "
                    f"the cache may take {SHARE:.0%}): they are decoded every epoch; free memory or raise that "
                    "limit to decode them once")
    return None


def cacheable(source, augment: str) -> bool:
    """Whether decoding ``source`` once leaves the results unchanged: encoded images, not ``augment`` imagenet."""
    return source.encoded and augment != "imagenet"


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


def fill(cache: CachedSource, job, pool, jid: int, progress: bool = False) -> None:
    """Make every row of ``job`` (a ``towers.data.jobs.Transformed`` decode, registered with ``pool`` as
    ``jid``) into ``cache.array``, recording what fails in ``cache.bad``; two batches in flight keep the
    workers busy.  A chunk that raised (a record that failed its checks) is made again row by row here, so
    that only its failing rows carry the error.  The converter's ``--decode NAME:image`` decodes through
    here too (``towers.data.image.convert``), into a mapped file."""
    from towers.errors import progress_bar

    n = len(job.source)
    step = fill_rows(cache.array[0].nbytes if n else 1, pool.n)
    starts = list(range(0, n, step))
    with progress_bar(progress, total=n, desc="decoding images", unit="img", leave=False) as bar:
        pending = []
        for k, a in enumerate(starts + [None, None]):
            if a is not None:
                rows = np.arange(a, min(a + step, n), dtype=np.int64)
                pending.append((rows, _start(pool, jid, rows)))
            if len(pending) > 1 or (a is None and pending):  # two batches in flight keep the workers busy
                rows, batch = pending.pop(0)
                _take(cache, job, rows, batch)
                bar.update(len(rows))


def _start(pool, jid, rows):
    try:
        return pool.start(jid, rows)
    except InputError as e:
        return e


def _take(cache, job, rows, batch) -> None:
    try:
        if isinstance(batch, Exception):
            raise batch
        out, failed = batch.wait()
    except WorkerDied as e:
        raise TrainingError(str(e)) from None
    except TFRecordError:
        for r in rows.tolist():
            try:
                failed = job.make(job.refs([r]), None, [r], cache.array[r:r + 1])
            except TFRecordError as e:
                cache.bad[r] = e
                continue
            if failed:
                cache.bad[r] = failed[0][1]
        return
    cache.array[rows] = out
    for k, message in failed:
        cache.bad[int(rows[k])] = message
