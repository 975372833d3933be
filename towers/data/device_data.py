"""A training set that fits on the GPU stays there; each step's batch is gathered on the device.

When every tower is on a GPU and the training examples and labels take at most
``FRACTION`` of a device's free memory, ``DeviceData`` copies them once to each
GPU (pixels stay uint8, labels become int32).  A step then sends only its
global batch's row indices (``batch`` int64 per tower, through two pinned host
buffers, as ``towers.data.staging`` does for whole batches) and ONE kernel per
tower gathers the rows and scales uint8 by 1/255 (``towers.nn.kernels.gather_batch``),
which gives the same float32 values as staging the rows from the host.  The
batches are the ones ``BatchSource.next_indices`` draws, so the examples seen,
their order and the resume position are those of the host pipeline, and no
input thread is needed.

Sync points: before refilling a pinned index buffer, the host waits for the
copy out of it issued two steps earlier (an event), never for compute.
Limits: GPU towers only (CPU towers already read host memory; there the
background batch thread keeps the copy off the critical path); training data
only (evaluation still streams the test set in chunks).
"""
from __future__ import annotations

import numpy

from towers.nn import kernels

FRACTION = 0.25  # of a device's free memory the training set may take


def fits_on(devices, dataset) -> bool:
    """Whether the training set may live on every (GPU) device of ``devices``."""
    if not devices or not all(d.is_gpu for d in devices):
        return False
    import cupy

    need = dataset.x.nbytes + len(dataset.y) * 4
    for index in {d.index for d in devices}:
        with cupy.cuda.Device(index):
            free, _ = cupy.cuda.runtime.memGetInfo()
        if need > FRACTION * free:
            return False
    return True


class DeviceData:
    """The training set on each tower's GPU, and per tower the gather of its slice."""

    def __init__(self, devices, streams, dataset, batch: int):
        self.devices, self.streams, self.batch = list(devices), list(streams), int(batch)
        self.scale = numpy.float32(1.0 / 255.0) if dataset.x.dtype == numpy.uint8 else None
        shape = (self.batch,) + tuple(dataset.example_shape)
        y32 = numpy.ascontiguousarray(dataset.y, dtype=numpy.int32)
        x_host = dataset.x if dataset.x.dtype == numpy.uint8 else dataset.x.astype(numpy.float32, copy=False)
        per_device = {}
        self.towers = []
        for dev, stream in zip(self.devices, self.streams):
            with dev.scope():
                xp = dev.xp
                if dev.index not in per_device:  # one copy per GPU, shared by its towers
                    per_device[dev.index] = (xp.asarray(numpy.ascontiguousarray(x_host)), xp.asarray(y32))
                import cupyx

                self.towers.append({
                    "data": per_device[dev.index],
                    "x": xp.empty(shape, dtype=numpy.float32),
                    "y": xp.empty((self.batch,), dtype=numpy.int32),
                    "pinned": [cupyx.empty_pinned((self.batch,), dtype=numpy.int64) for _ in range(2)],
                    "idx": [xp.empty((self.batch,), dtype=numpy.int64) for _ in range(2)],
                    "events": [None, None],
                    "k": 0,
                })

    def stage(self, i: int, indices):
        """(x float32, y int32) of tower ``i`` on its device: rows ``indices`` (host, ``batch`` of them).

        Call with tower ``i``'s device current and its stream entered.
        """
        t, stream = self.towers[i], self.streams[i]
        k = t["k"]
        t["k"] ^= 1
        if t["events"][k] is not None:
            t["events"][k].synchronize()  # the copy out of this pinned buffer (two steps ago) is done
        pinned, idx = t["pinned"][k], t["idx"][k]
        pinned[...] = indices
        idx.set(pinned, stream=stream)
        t["events"][k] = stream.record()
        xd, yd = t["data"]
        kernels.gather_batch(xd, yd, idx, t["x"], t["y"], self.scale)
        return t["x"], t["y"]
