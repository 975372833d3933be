"""The examples of an image data set as an array-like: a source, a transform and the workers behind it.

``ImageArray`` has what the batch code needs from an examples array
(``shape``, ``dtype``, ``len``, ``x[index array]``, ``x[a:b]``) and
``submit(rows, epochs)``, which starts one batch in the input workers
(``towers.data.workers``) and returns an object whose ``result()`` is
the batch.  With ``epochs`` (training: ``towers.data.batches.BatchSource``
passes each example's epoch) examples are augmented; without (indexing,
evaluation) they take the deterministic path.

An example that cannot be made (an image that does not decode, a file that
cannot be read) stops the run with a ``TrainingError`` naming the file, the
record and the key.  With ``on_error="skip"`` it is replaced by the next
example of the same class (in row order, wrapping) that can be made, with the
draws of the one it replaces, so the batch keeps its labels, its size and its
determinism; each skip is counted (``skipped``) and reported through ``say``
(the first ``REPORTED`` one by one, then every 100th).

Sync point: ``result()`` waits for the batch (replacements are made there, in
the calling thread).
"""
from __future__ import annotations

import numpy as np

from towers.data.dataset import OnDemand
from towers.data.workers import WorkerDied, layout, make_rows
from towers.data.tfrecord.framing import TFRecordError
from towers.errors import TrainingError

REPORTED = 10


class ImageArray(OnDemand):
    """``len(source)`` examples of ``transform.shape`` made by ``workers`` from ``source`` (``transform`` None:
    gathered by the source, a decoded-image cache read without augmentation).  ``stored``: the source the
    examples come from, the files or records behind a decoded-image cache (default ``source``); the data's
    fingerprint is of it (``towers.data.fingerprint``)."""

    augments = True  # BatchSource passes the examples' epochs to submit

    def __init__(self, name, source, transform, labels, workers, on_error="stop", say=None, stored=None):
        self.name, self.source, self.transform = name, source, transform
        self.stored = source if stored is None else stored
        self._labels, self._workers, self._on_error, self._say = labels, workers, on_error, say
        self._sid = workers.add(source, transform)
        example, self.dtype = layout(source, transform)  # no transform: the source gathers rows (a cache)
        self.shape = (len(source),) + tuple(example)
        self.ndim = len(self.shape)
        self.skipped = 0

    @property
    def workers(self) -> int:
        return self._workers.n

    def __len__(self):
        return self.shape[0]

    def submit(self, rows, epochs=None) -> "_Batch":
        rows = np.asarray(rows, np.int64)
        epochs = None if epochs is None else np.asarray(epochs, np.int64)
        try:
            return _Batch(self, rows, epochs, self._workers.start(self._sid, rows, epochs))
        except (TFRecordError, WorkerDied) as e:  # made in the calling thread; a worker gone before the send
            raise TrainingError(str(e)) from None

    def close(self) -> None:
        """Stop the workers (shared with the data set's other arrays) and free their memory."""
        self._workers.close()

    def _replace(self, out, rows, epochs, failed) -> None:
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
                if not make_rows(self.source, self.transform, self.source.refs([j]),
                                 None if epochs is None else epochs[k:k + 1], rows[k:k + 1], one):
                    break
            else:
                raise TrainingError(f"{message}; and no other example of its class {int(label)} can be made")


class _Batch:
    """A batch being made; ``result()`` waits for it, then replaces or reports what could not be made (once)."""

    def __init__(self, array, rows, epochs, chunks):
        self._array, self._rows, self._epochs, self._chunks = array, rows, epochs, chunks
        self._out = None

    def result(self) -> np.ndarray:
        if self._out is None:
            try:
                out, failed = self._chunks.wait()
            except (TFRecordError, WorkerDied) as e:
                raise TrainingError(str(e)) from None
            if failed:
                self._array._replace(out, self._rows, self._epochs, failed)
            self._out = out
        return self._out

