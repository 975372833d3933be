"""The step engine's device rows on tower threads, checked on the CPU.

With the training set on the GPUs a step uploads its row indices once and
each tower gathers its slice on its device (``towers.data.device_data``).
Tower threads (CPU towers; GPU towers with ``sync_bn``) may still be running
the last step when the next upload comes (a keeper without a barrier: weights
mode), so each gather reads the index buffer of its own step's upload, the
handle the engine passes it.  ``HostRows`` is that interface over host memory,
with tower 1 made to lag, so the engine's threaded path runs here: its
weights must be those of the same batches given as host arrays.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from tests.conftest import DIGITS
from towers import Config, Trainer
from towers.data.batches import BatchSource
from towers.data.dataset import input_scale
from towers.data.loading import load_dataset


class HostRows:
    """``DeviceData``'s ``upload``/``stage`` over host memory: two index buffers, tower 1's gather late."""

    def __init__(self, dataset, towers: int, batch: int, lag: float):
        self.x, self.y, self.towers, self.batch, self.lag = dataset.x, dataset.y, towers, batch, lag
        self.scale = input_scale(dataset.x.dtype)
        self.buffers, self._k = [None, None], 0
        self.reads = []  # (tower, buffer, the upload that filled it when read)
        self.filled = [None, None]
        self.uploads = 0
        self.lock = threading.Lock()

    def upload(self, indices) -> int:
        k = self._k
        self._k ^= 1
        self.buffers[k] = np.asarray(indices).reshape(self.towers, self.batch).copy()
        self.uploads += 1
        self.filled[k] = self.uploads
        return k

    def stage(self, i: int, k: int, buffer: int):
        if i == 1:
            time.sleep(self.lag)  # the next step's upload comes while this tower still stages
        rows = self.buffers[buffer][i, k * self.batch:(k + 1) * self.batch]
        with self.lock:
            self.reads.append((i, buffer, self.filled[buffer]))
        x = np.empty(self.x[rows].shape, np.float32)
        np.multiply(self.x[rows], self.scale, out=x, casting="unsafe")
        return x, self.y[rows].astype(np.int32)


def test_tower_threads_gather_the_rows_of_their_own_step():
    ds = load_dataset(str(DIGITS))
    cfg = Config(devices="cpu", n_gpu=2, hidden=32, batch_size=10, sync="weights", average_every=3,
                 cpu_towers="threads", cpu_kernels="numpy")
    steps = 7
    with Trainer(cfg, dataset=ds) as tr:
        src = BatchSource(ds, tr.global_batch, cfg.seed)
        for _ in range(steps):
            x, y = src.next_batch()
            tr.train_step(x, y)
        tr.finish()
        want = tr.get_weights()
    with Trainer(cfg, dataset=ds) as tr:
        assert tr.executor.engine.threaded
        rows = tr.executor.engine.device_data = HostRows(ds, 2, cfg.batch_size, lag=0.02)
        src = BatchSource(ds, tr.global_batch, cfg.seed)
        for _ in range(steps):
            tr.executor.engine.run(None, None, False, src.next_indices())
        tr.finish()
        got = tr.get_weights()
    assert rows.uploads == steps
    lagging = [(b, filled) for i, b, filled in rows.reads if i == 1]
    assert len(lagging) == steps and [f for _, f in lagging] == list(range(1, steps + 1))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
