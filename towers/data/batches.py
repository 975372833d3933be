"""The sampler and the batches: which examples each step reads, and the background batch thread.

Each step draws ONE global batch of ``n_towers * batch_size`` examples from a
seeded per-epoch permutation; the trainer splits it into equal contiguous slices
in tower order, so N towers x B follow exactly the same sequence of examples as
1 tower x N*B.  A batch that runs past the end of an epoch continues into the
next epoch's permutation, so every epoch is seen whole and no tower ever gets a
short slice.

:class:`Sampler` keeps this once: the permutation of epoch ``e`` is drawn from
``default_rng([seed, e])``, so the position (epoch, index in epoch) is the
pipeline's whole state, counted from the steps taken, and serialized as
``data/epoch``, ``data/index``; resuming from it is exact.  :class:`BatchSource`
is a cursor over a Sampler that starts each batch (:func:`start_batch`: a
gather from arrays in memory, or the examples array's pipeline for examples
made on demand); :class:`Batch` is the one batch type, whatever made it;
``Prefetcher`` runs the cursor on a background thread into a bounded queue,
ahead of the trainer.
"""
from __future__ import annotations

import queue
import threading

import numpy

from towers.data.dataset import Dataset, OnDemand
from towers.errors import InputError, TrainingError, UserError


class Sampler:
    """The seeded per-epoch permutation and the input position of ``n`` examples in global batches.

    ``start``: the (epoch, index) at step ``start_step`` (a resumed run's).
    ``batch(step)`` gives the examples step ``step`` reads, ``at(step)`` the
    position after it, ``state_dict(step)`` / ``read_state`` its checkpoint
    part.  ``seed`` None: a sampler that only counts (it draws nothing).  The
    permutation of the epoch drawn last is kept (one thread draws).
    """

    def __init__(self, n: int, global_batch: int, seed: int | None = None, start=(0, 0), start_step: int = 0):
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self.start_step, self.start = start_step, tuple(start)
        self._perm = (None, None)  # (epoch, its permutation)

    def permutation(self, epoch: int) -> numpy.ndarray:
        if self._perm[0] != epoch:
            self._perm = (epoch, numpy.random.default_rng([self.seed, epoch]).permutation(self.n))
        return self._perm[1]

    def at(self, step: int) -> tuple[int, int]:
        """(epoch, index in epoch) after ``step`` steps."""
        return divmod(self.start[0] * self.n + self.start[1] + (step - self.start_step) * self.global_batch, self.n)

    def batch(self, step: int) -> tuple[numpy.ndarray, numpy.ndarray]:
        """(example indices, their epochs) of the global batch read by step ``step`` + 1 (from ``at(step)``)."""
        epoch, index = self.at(step)
        out = numpy.empty(self.global_batch, dtype=numpy.int64)
        epochs = numpy.empty(self.global_batch, dtype=numpy.int64)
        filled = 0
        while filled < self.global_batch:
            take = min(self.global_batch - filled, self.n - index)
            out[filled : filled + take] = self.permutation(epoch)[index : index + take]
            epochs[filled : filled + take] = epoch
            filled += take
            epoch, index = (epoch + 1, 0) if index + take == self.n else (epoch, index + take)
        return out, epochs

    def state_dict(self, step: int) -> dict:
        epoch, index = self.at(step)
        return {"data/epoch": numpy.int64(epoch), "data/index": numpy.int64(index)}

    def read_state(self, state: dict, where: str) -> tuple[int, int]:
        """(epoch, index) of ``state``, checked against this data set's size (a ``UserError`` otherwise)."""
        from towers.state import count

        epoch = count(state, "data/epoch", where)
        index = count(state, "data/index", where)
        if index >= self.n:
            raise UserError(f"{where}: 'data/index' {index} is beyond the data set's {self.n} examples")
        return epoch, index


class InputPosition(Sampler):
    """A Sampler that only counts: the position after ``step`` steps and its checkpoint part (the trainer's and
    a cluster host's; the batch thread runs ahead, so the position a checkpoint needs is counted from the
    steps taken since ``start``, not read from the batch thread's cursor)."""

    def __init__(self, n_examples: int, global_batch: int, start_step: int = 0, start=(0, 0)):
        super().__init__(n_examples, global_batch, None, start, start_step)


class BatchSource:
    """The batch thread's cursor over a :class:`Sampler`: the next global batches, read from ``dataset``."""

    def __init__(self, dataset: Dataset, global_batch: int, seed: int, epoch: int = 0, index: int = 0):
        n = len(dataset.x)
        if global_batch > n:
            raise UserError(
                f"the global batch ({global_batch} examples) is larger than the dataset ({n}); "
                "lower `batch_size`, `accumulate` or the number of towers"
            )
        self.x, self.y, self.n = dataset.x, dataset.y, n
        self.global_batch, self.seed = global_batch, seed
        self.sampler = Sampler(n, global_batch, seed, (epoch, index))
        self._steps = 0  # batches drawn

    @property
    def position(self) -> tuple[int, int]:
        return self.sampler.at(self._steps)

    def next_indices(self) -> numpy.ndarray:
        return self.next_positions()[0]

    def next_positions(self) -> tuple[numpy.ndarray, numpy.ndarray]:
        """(example indices, their epochs) of the next global batch."""
        batch = self.sampler.batch(self._steps)
        self._steps += 1
        return batch

    def next_batch(self):
        return self.submit_batch().result()

    def submit_batch(self) -> "Batch":
        """The next global batch, started: ``result()`` gives (x, y)."""
        return start_batch(self.x, self.y, *self.next_positions())


def start_batch(x, y, idx, epochs) -> "Batch":
    """The examples ``idx`` (drawn in ``epochs``) of ``x`` and ``y``, started: ``result()`` gives (x, y).

    Examples made on demand (``OnDemand``: ``towers.data.examples.Examples``)
    are made by their pipeline meanwhile, with each example's epoch (its
    random draws come from (seed, epoch, index); a pipeline without draws
    ignores it); arrays in memory are gathered here and now.
    """
    if isinstance(x, OnDemand):
        return x.submit(idx, epochs, y[idx])
    return Batch(x[idx], y[idx])


def workers_of(x) -> int:
    """The input worker processes that make the examples ``x`` (0: arrays in memory, or made in the thread)."""
    return x.workers if isinstance(x, OnDemand) else 0


class Batch:
    """One batch: its examples and labels (``y``; None for a read of examples alone).

    The examples are here already (gathered in the input thread), or being
    written by the input workers into ``x`` (``towers.data.workers``: shared
    memory) with one ticket per chunk of rows (``bounds``, its rows).
    ``repair(x, failed)`` answers the rows that could not be made (replaced, or
    a ``TrainingError``: ``towers.data.examples``).

    Sync point: :meth:`examples` (and :meth:`result`) waits for the chunks, once;
    an ``InputError`` (a damaged record, a dead worker) is raised as a ``TrainingError``.
    """

    def __init__(self, x, y=None, tickets=(), bounds=(), repair=None):
        self.x, self.y = x, y
        self._tickets, self._bounds, self._repair = tickets, bounds, repair
        self._done = not tickets

    def wait(self):
        """(the examples, the rows that could not be made as (row, message)); an ``InputError`` as raised."""
        failed = []
        for (start, _), ticket in zip(self._bounds, self._tickets):
            failed += [(start + k, message) for k, message in ticket.result()]
        return self.x, failed

    def examples(self):
        if not self._done:
            try:
                x, failed = self.wait()
            except InputError as e:
                raise TrainingError(str(e)) from None
            if failed:
                self._repair(x, failed)
            self._done = True
        return self.x

    def result(self):
        return self.examples(), self.y


class Prefetcher:
    """Starts ``BatchSource.submit_batch`` on a background thread, ``depth`` batches ahead.

    With examples read by ``workers`` worker processes (``workers_of``), up to
    ``depth`` (at least twice the workers) batches are in flight at once, and ``get`` waits for the
    oldest: batches come in order, and memory is bounded by ``depth`` batches.
    """

    def __init__(self, source: BatchSource, steps: int, depth: int = 4, workers: int = 0):
        depth = max(depth, 2 * workers)
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source, steps), daemon=True, name="towers-input")
        self._thread.start()

    def _run(self, source, steps):
        try:
            for _ in range(steps):
                if not self._put(source.submit_batch()):
                    return
        except BaseException as e:  # surfaced in the main thread by get()
            self._put(e)

    def _put(self, item) -> bool:
        """Queue ``item`` unless ``close`` comes first (a full queue must not outlive the reader)."""
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self):
        item = self._q.get()
        if isinstance(item, BaseException):
            raise item
        return item.result()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
