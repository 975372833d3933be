"""A training set that fits on the GPU stays there; each step's batch is gathered on the device.

When every tower is on a GPU and the training examples and labels take at most
``FRACTION`` of a device's free memory, ``DeviceData`` copies them once to each
GPU (pixels stay uint8, labels become int32).  A step then sends only its
global batch's row indices (``batch x accumulate`` int64 per tower; per GPU one
pinned fill, one copy and one event for all its towers, through two pinned host
buffers, as ``towers.data.staging`` does for whole batches) and ONE kernel per
tower and micro-batch gathers the rows and scales uint8 by 1/255 (``towers.devices.kernels.gather_batch``),
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

from towers.arrays import empty_pinned
from towers.data.dataset import OnDemand, input_scale
from towers.devices import kernels

FRACTION = 0.25  # of a device's free memory the training set may take


def fits_on(devices, dataset) -> bool:
    """Whether the training set may live on every (GPU) device of ``devices``."""
    if not devices or not all(d.is_gpu for d in devices):
        return False
    if isinstance(dataset.x, OnDemand):  # read (and augmented) on demand by the input workers: stays on the host
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
    """The training set on each GPU of the towers; per step one index upload per GPU, one gather per tower.

    ``upload(indices)`` sends a step's global batch of row indices: per GPU ONE
    fill of a pinned buffer with its towers' slices, ONE host-to-device copy
    and ONE event, on the GPU's stream (towers sharing a GPU share its stream,
    as the trainer makes them) and returns which of two index buffers holds
    them; ``stage(i, k, buffer)`` then gathers tower ``i``'s micro-batch ``k``.
    """

    def __init__(self, devices, streams, dataset, batch: int, accumulate: int = 1, scale: str = "1/255"):
        self.devices, self.streams, self.batch = list(devices), list(streams), int(batch)
        self.accumulate = int(accumulate)  # micro-batches of ``batch`` rows per tower and step
        self.scale = input_scale(dataset.x.dtype, scale)  # ``scale``: the `input_scale` setting
        shape = (self.batch,) + tuple(dataset.example_shape)
        y32 = numpy.ascontiguousarray(dataset.y, dtype=numpy.int32)
        x_host = numpy.ascontiguousarray(
            dataset.x if dataset.x.dtype == numpy.uint8 else dataset.x.astype(numpy.float32, copy=False))
        import cupy

        members: dict[int, list[int]] = {}  # GPU -> its towers, in tower order
        for i, dev in enumerate(self.devices):
            members.setdefault(dev.index, []).append(i)
        self.groups, self._slot, self.towers = [], {}, [None] * len(self.devices)
        self._k = 0  # the index buffer the next upload fills (every GPU's pair flips together)
        for index, towers in members.items():
            stream = self.streams[towers[0]]
            if any(self.streams[i] is not stream for i in towers):
                raise ValueError(f"towers {towers} share gpu:{index} but not its stream: "
                                 "DeviceData copies their indices once, on one stream")
            n, b, m = len(towers), self.batch * self.accumulate, self.batch
            rows = (slice(towers[0], towers[-1] + 1) if towers == list(range(towers[0], towers[-1] + 1))
                    else numpy.array(towers))
            with self.devices[towers[0]].scope():
                pinned = [empty_pinned((n, b), numpy.int64) for _ in range(2)]
                idx = [cupy.empty((n, b), dtype=numpy.int64) for _ in range(2)]
                group = {
                    "device": self.devices[towers[0]], "stream": stream, "rows": rows, "pinned": pinned, "idx": idx,
                    "ptrs": [p.ctypes.data for p in pinned], "nbytes": pinned[0].nbytes,
                    # each tower's micro-batches of each buffer (views of its row)
                    "slices": [[[a[j, k * m:(k + 1) * m] for k in range(self.accumulate)] for j in range(n)]
                               for a in idx],
                    "events": [cupy.cuda.Event(disable_timing=True) for _ in range(2)],
                    "data": (cupy.asarray(x_host), cupy.asarray(y32)),  # one copy per GPU
                }
                for j, i in enumerate(towers):
                    self._slot[i] = (group, j)
            self.groups.append(group)
        for i, dev in enumerate(self.devices):
            with dev.scope():
                self.towers[i] = (cupy.empty(shape, dtype=numpy.float32), cupy.empty((self.batch,), dtype=numpy.int32))

    def upload(self, indices) -> int:
        """Send the global batch's row indices (host ints, ``batch x accumulate`` a tower, in tower order) to each GPU.

        Returns which of the two index buffers holds them, for ``stage``.
        Sync point: before refilling a pinned buffer the host waits for the
        copy out of it issued two steps earlier (an event), never for compute.
        """
        rows = numpy.asarray(indices).reshape(len(self.devices), self.batch * self.accumulate)
        k = self._k
        self._k ^= 1
        for g in self.groups:
            event = g["events"][k]
            event.synchronize()  # the copy out of this pinned buffer (two steps ago) is done
            g["pinned"][k][...] = rows[g["rows"]]
            with g["device"].scope():
                g["idx"][k].data.copy_from_host_async(g["ptrs"][k], g["nbytes"], g["stream"])
                event.record(g["stream"])
        return k

    def stage(self, i: int, k: int, buffer: int):
        """(x float32, y int32) of tower ``i`` on its device: its micro-batch ``k`` of the upload that returned
        ``buffer``.

        Call with tower ``i``'s device current and its stream entered (the
        gather is queued behind the index copy on that stream).
        """
        group, j = self._slot[i]
        xd, yd = group["data"]
        x, y = self.towers[i]
        kernels.gather_batch(xd, yd, group["slices"][buffer][j][k], x, y, self.scale)
        return x, y
