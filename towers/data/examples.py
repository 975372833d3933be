"""The examples of a data set made on demand, as one array-like: a worker job and the pool behind it.

:class:`Examples` is the examples array of every data set whose rows are
made on demand: raw TFRecord records (a ``Gather`` job), encoded images,
image folders and arrays to augment (a ``Transformed`` job), a
decoded-image cache (gathered, or transformed after it).  The loader
(``towers.data.loading``) builds the job; this array only runs it.  It has
what the batch code needs from an examples array (``shape``, ``dtype``,
``len``, ``x[index array]``, ``x[a:b]``: ``towers.data.dataset.OnDemand``)
and ``submit(rows, epochs, y)``, which starts one batch in the input workers
(``towers.data.workers``; ``workers=0``: in the calling thread) and returns
its ``towers.data.batches.Batch``.  With ``epochs`` (training:
``towers.data.batches.start_batch`` passes each example's epoch) a job
with random draws augments; without (indexing, evaluation) it takes the
deterministic path.

An example that cannot be made (an image that does not decode, a file that
cannot be read) stops the run with a ``TrainingError`` naming the file, the
record and the key.  With ``on_error="skip"`` it is replaced by the next
example of the same class (in row order, wrapping) that can be made, with the
draws of the one it replaces, so the batch keeps its labels, its size and its
determinism; each skip is counted (``skipped``) and reported through ``say``
(the first ``REPORTED`` one by one, then every 100th).  A record damaged
since it was indexed, or a worker that died, is a ``TrainingError`` too.

Closing: an array with a pool of its own (``own_workers``: stored TFRecord
records, one pool a split) stops it and closes its files, and a later read
starts them again; arrays that share one pool (an image set's training,
test and cache arrays) stop it for all of them, and a read after that is a
``UserError`` saying the data set is closed.

Sync point: the batch's ``result()`` waits for it (replacements are made
there, in the calling thread).
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from towers.data.batches import Batch
from towers.data.dataset import OnDemand
from towers.data.workers import Workers
from towers.errors import InputError, TrainingError

REPORTED = 10


class Examples(OnDemand):
    """The rows of ``job`` (``towers.data.jobs``) made by ``workers`` (a ``Workers`` pool).

    ``labels``: the rows' labels (a replacement is of the same class);
    ``on_error``/``say``: see the module docstring; ``stored``: the source
    the examples come from (default the job's: the files or records behind
    a decoded-image cache), which the data's fingerprint is of
    (``towers.data.fingerprint``); ``rows``: what a row is called in an
    IndexError; ``own_workers``: the pool is this array's alone.
    """

    def __init__(self, name, job, workers: Workers, labels=None, on_error="stop", say=None, stored=None,
                 rows="examples", own_workers=False):
        self.name, self.job, self.rows = name, job, rows
        self.stored = job.source if stored is None else stored
        self._labels, self._on_error, self._say, self._own = labels, on_error, say, own_workers
        self._workers, self._jid = workers, workers.add(job)
        self.shape = (len(job.source),) + tuple(job.shape)
        self.dtype = job.dtype
        self.ndim = len(self.shape)
        self.skipped = 0
        self._lock = threading.Lock()  # the input thread and the main thread both read; close swaps the pool

    def __getstate__(self):
        return dict(self.__dict__, _lock=None)  # the pool travels as its count and jobs (Workers.__getstate__)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def workers(self) -> int:
        return self._workers.n

    def __len__(self):
        return self.shape[0]

    def submit(self, rows, epochs=None, y=None) -> Batch:
        """Start making ``rows`` (``epochs``: each row's, for its draws); the batch carries the labels ``y``."""
        rows = np.asarray(rows, np.int64)
        epochs = None if epochs is None or not self.job.draws else np.asarray(epochs, np.int64)
        with self._lock:
            workers, jid = self._workers, self._jid
        try:
            return workers.start(jid, rows, epochs, y, functools.partial(self._replace, rows, epochs))
        except InputError as e:  # made in the calling thread; a worker gone before the send
            raise TrainingError(str(e)) from None

    def close(self) -> None:
        """Stop the workers (shared with the data set's other arrays, unless ``own_workers``) and free their
        memory; this array's own pool is made again, to start on the next read."""
        with self._lock:
            workers = self._workers
            if self._own:
                self._workers = Workers(workers.n)
                self._jid = self._workers.add(self.job)
        workers.close()

    def _replace(self, rows, epochs, out, failed) -> None:
        """``on_error`` skip: each failed row's example from the next example of its class that can be made."""
        n = len(self)
        for k, message in failed:
            if self._on_error != "skip":
                raise TrainingError(f"{message}; re-encode or remove it, or set `on_error` skip to replace such "
                                    "examples by the next of their class (counted)")
            self.skipped += 1
            if self._say and (self.skipped <= REPORTED or self.skipped % 100 == 0):
                self._say(f"skipped {message} ({self.skipped} so far; `on_error` skip)")
            label, row = self._labels[rows[k]], int(rows[k])
            for step in range(1, n):
                j = (row + step) % n
                if self._labels[j] != label:
                    continue
                one = out[k:k + 1]
                # The replacement takes the draws of the row it stands for (epoch, row).
                if not self.job.make(self.job.refs([j]), None if epochs is None else epochs[k:k + 1],
                                       rows[k:k + 1], one):
                    break
            else:
                raise TrainingError(f"{message}; and no other example of its class {int(label)} can be made")
