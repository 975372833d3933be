"""``Dropout``: zero a random fraction of the activations while training.

Inverted dropout: while training each value is kept with probability
``1 - rate`` and scaled by ``1 / (1 - rate)``, so evaluation (no dropout)
needs no rescaling.  The mask is drawn on the host from
``numpy.random.default_rng([seed, tower, step, *path])`` (``towers.nn.context``):
it depends on nothing but the run's seed, the tower, the step and the
layer's place in the model, so a resumed run draws the masks of the
uninterrupted one, and a CPU and a GPU tower of the same index agree.  On a
GPU the mask is copied to the device each step (a host-to-device copy of the
activation's size; the GPU path is correct, not fast).
"""
from __future__ import annotations

import numpy

from towers.errors import UserError
from towers.nn.context import host_rng
from towers.nn.layers import Layer


class Dropout(Layer):
    """Drop each value with probability ``rate`` while training (see the module doc)."""

    def __init__(self, rate: float = 0.5):
        if not 0 <= rate < 1:
            raise UserError(f"Dropout: rate must be in [0, 1), got {rate!r}")
        self.rate = float(rate)

    def draws_on_host(self) -> bool:
        return self.rate > 0

    def forward(self, p, x, ws):
        if not ws.ctx.training or self.rate == 0:
            ws.saved["mask"] = None
            return x
        keep = host_rng(ws.ctx, ws.path).random(x.shape, dtype=numpy.float32) >= self.rate
        mask = ws.array("mask", x.shape, x.dtype)
        mask[...] = ws.xp.asarray((keep * numpy.float32(1 / (1 - self.rate))).astype(x.dtype))
        y = ws.array("y", x.shape, x.dtype)
        ws.xp.multiply(x, mask, out=y)
        ws.saved["mask"] = mask
        return y

    def backward(self, p, g, dy, ws, need_dx):
        if not need_dx:
            return None
        mask = ws.saved["mask"]
        if mask is None:
            return dy
        dy *= mask  # dy is the next layer's scratch: safe in place
        return dy
