"""Input pipeline: npz datasets, the shuffled global batch, prefetching, staging.

Parsing stays on the CPU.  Each step draws ONE global batch of
``n_towers * batch_size`` examples from a seeded per-epoch permutation and
splits it into equal contiguous slices in tower order, so N towers x B follow
exactly the same sequence of examples as 1 tower x N*B.  A batch that runs past
the end of an epoch continues into the next epoch's permutation, so every epoch
is seen whole and no tower ever gets a short slice.

The permutation of epoch ``e`` is drawn from ``default_rng([seed, e])``: the
position (epoch, index in epoch) is the pipeline's whole state, which makes
resuming exact.

A background thread assembles global batches ahead of the trainer into a
bounded queue (``Prefetcher``).  ``Stager`` turns a tower's slice into device
arrays: uint8 pixels travel as uint8 and are scaled by 1/255 on the device; on
a GPU the copy goes through two pinned host buffers per tower, asynchronously on
the tower's stream, and an event guards each buffer before it is refilled.
"""
from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass

import numpy

from towers import UserError


@dataclass
class Dataset:
    x: numpy.ndarray  # (N, ...) uint8 or float32
    y: numpy.ndarray  # (N,) int32
    num_classes: int
    x_test: numpy.ndarray | None = None
    y_test: numpy.ndarray | None = None

    @property
    def example_shape(self) -> tuple:
        return tuple(self.x.shape[1:])


def _labels(y: numpy.ndarray, where: str, key: str) -> numpy.ndarray:
    if y.ndim != 1 or not numpy.issubdtype(y.dtype, numpy.integer):
        raise UserError(
            f"{where}: key {key!r} must be 1-D integer labels, got {y.dtype} {y.shape}"
        )
    if y.size and y.min() < 0:
        raise UserError(f"{where}: key {key!r} has a negative label ({int(y.min())}); labels are 0..C-1")
    return y.astype(numpy.int32)


def _images(x: numpy.ndarray, where: str, key: str) -> numpy.ndarray:
    if x.dtype == numpy.uint8:
        return x
    if numpy.issubdtype(x.dtype, numpy.floating):
        return x.astype(numpy.float32, copy=False)
    raise UserError(f"{where}: key {key!r} is {x.dtype}; give uint8 pixels or float32 features")


def _load_npz(path: str):
    if not os.path.exists(path):
        raise UserError(f"data file {path} does not exist: pass --data PATH to an .npz file")
    try:
        return numpy.load(path, allow_pickle=False)
    except Exception as e:
        raise UserError(f"cannot read {path} as .npz ({e.__class__.__name__}: {e})") from None


def _pair(npz, path, xk, yk):
    for k in (xk, yk):
        if k not in npz.files:
            raise UserError(
                f"{path} has no key {k!r} (keys: {', '.join(npz.files) or 'none'}); "
                "use --x-key/--y-key to pick others"
            )
    x, y = _images(npz[xk], path, xk), _labels(npz[yk], path, yk)
    if x.ndim < 2:
        raise UserError(f"{path}: key {xk!r} has shape {x.shape}; expected (N, features...)")
    if len(x) != len(y):
        raise UserError(f"{path}: {xk!r} has {len(x)} examples but {yk!r} has {len(y)} labels")
    return x, y


def load_dataset(path: str, x_key: str = "x", y_key: str = "y", test_path: str | None = None) -> Dataset:
    """Load and validate training (and test) data; every problem is a UserError."""
    npz = _load_npz(path)
    x, y = _pair(npz, path, x_key, y_key)
    if len(x) == 0:
        raise UserError(f"{path}: the dataset is empty (key {x_key!r} has 0 examples)")
    x_test = y_test = None
    if test_path is not None:
        tnpz = _load_npz(test_path)
        tx = x_key if x_key in tnpz.files else "x_test"
        ty = y_key if y_key in tnpz.files else "y_test"
        x_test, y_test = _pair(tnpz, test_path, tx, ty)
    elif "x_test" in npz.files and "y_test" in npz.files:
        x_test, y_test = _pair(npz, path, "x_test", "y_test")
    num_classes = int(y.max()) + 1
    if x_test is not None:
        if x_test.shape[1:] != x.shape[1:]:
            raise UserError(
                f"test examples have shape {x_test.shape[1:]} but training examples {x.shape[1:]}"
            )
        if len(y_test) and int(y_test.max()) >= num_classes:
            raise UserError(
                f"test label {int(y_test.max())} is out of range: training labels are 0..{num_classes - 1}"
            )
    return Dataset(x, y, num_classes, x_test, y_test)


class BatchSource:
    """Global batches from per-epoch seeded permutations; state = (epoch, index)."""

    def __init__(self, dataset: Dataset, global_batch: int, seed: int, epoch: int = 0, index: int = 0):
        n = len(dataset.x)
        if global_batch > n:
            raise UserError(
                f"the global batch ({global_batch} examples) is larger than the dataset ({n}); "
                "lower --batch-size or the number of towers"
            )
        self.x, self.y, self.n = dataset.x, dataset.y, n
        self.global_batch, self.seed = global_batch, seed
        self.epoch, self.index = epoch, index
        self._perm = self._permutation(epoch)

    def _permutation(self, epoch: int) -> numpy.ndarray:
        return numpy.random.default_rng([self.seed, epoch]).permutation(self.n)

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.index

    def next_indices(self) -> numpy.ndarray:
        out = numpy.empty(self.global_batch, dtype=numpy.int64)
        filled = 0
        while filled < self.global_batch:
            take = min(self.global_batch - filled, self.n - self.index)
            out[filled : filled + take] = self._perm[self.index : self.index + take]
            filled += take
            self.index += take
            if self.index == self.n:  # epoch boundary: the next permutation
                self.epoch, self.index = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
        return out

    def next_batch(self):
        idx = self.next_indices()
        return self.x[idx], self.y[idx]


class Prefetcher:
    """Runs ``BatchSource.next_batch`` on a background thread, ``depth`` batches ahead."""

    _DONE = object()

    def __init__(self, source: BatchSource, steps: int, depth: int = 4):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source, steps), daemon=True, name="towers-input")
        self._thread.start()

    def _run(self, source, steps):
        try:
            for _ in range(steps):
                item = source.next_batch()
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # surfaced in the main thread by get()
            self._q.put(e)

    def get(self):
        item = self._q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Stager:
    """Copies one tower's slice to its device and converts it to float32 there."""

    def __init__(self, device, stream, batch: int, example_shape: tuple, x_dtype):
        self.device, self.stream = device, stream
        self.xp = device.xp
        self.scale = numpy.float32(1.0 / 255.0) if numpy.dtype(x_dtype) == numpy.uint8 else None
        shape = (batch,) + tuple(example_shape)
        with device.scope():
            self.x = self.xp.empty(shape, dtype=numpy.float32)
            if device.is_gpu:
                import cupy
                import cupyx

                # Two pinned buffers per tower: refill one while the other's copy runs.
                self._pinned = [
                    (cupyx.empty_pinned(shape, dtype=x_dtype), cupyx.empty_pinned((batch,), dtype=numpy.int32))
                    for _ in range(2)
                ]
                self._raw = [
                    (cupy.empty(shape, dtype=x_dtype), cupy.empty((batch,), dtype=numpy.int32)) for _ in range(2)
                ]
                self._events = [None, None]
                self._k = 0

    def stage(self, x_host, y_host):
        """Return (x float32, y int32) on the device for this step."""
        xp = self.xp
        if not self.device.is_gpu:
            if self.scale is not None:
                numpy.multiply(x_host, self.scale, out=self.x, casting="unsafe")
            else:
                self.x[...] = x_host
            return self.x, y_host
        k = self._k
        self._k ^= 1
        px, py = self._pinned[k]
        ev = self._events[k]
        if ev is not None:
            ev.synchronize()  # the last copy out of this pinned pair has finished
        px[...] = x_host
        py[...] = y_host
        dx, dy = self._raw[k]
        with self.device.scope():
            dx.set(px, stream=self.stream)
            dy.set(py, stream=self.stream)
            self._events[k] = self.stream.record()
            with self.stream:
                if self.scale is not None:
                    xp.multiply(dx, self.scale, out=self.x)
                else:
                    self.x[...] = dx
        return self.x, dy
