"""Staging: one tower's slice of the global batch onto its device, as float32.

uint8 pixels travel as uint8 and are scaled on the device (by 1/255, or as `input_scale` says).  On a GPU
the copy goes through two pinned host buffers per tower, asynchronously on the
tower's stream, and an event guards each buffer before it is refilled (the
event's synchronize is the only host wait, and it is on a copy issued one step
earlier).
"""
from __future__ import annotations

import numpy

from towers.arrays import empty_pinned
from towers.data.dataset import input_scale


class Stager:
    """Copies one tower's slice to its device and converts it to float32 there."""

    def __init__(self, device, stream, batch: int, example_shape: tuple, x_dtype, scale: str = "1/255"):
        self.device, self.stream = device, stream
        self.xp = device.xp
        self.scale = input_scale(x_dtype, scale)  # ``scale``: the `input_scale` setting
        shape = (batch,) + tuple(example_shape)
        with device.scope():
            self.x = self.xp.empty(shape, dtype=numpy.float32)
            if device.is_gpu:
                import cupy

                # Two pinned buffers per tower: refill one while the other's copy runs.
                self._pinned = [
                    (empty_pinned(shape, x_dtype), empty_pinned((batch,), numpy.int32))
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
