"""The exponential moving average (EMA) of the weights: the one place its formula lives.

TensorFlow's ``ExponentialMovingAverage(decay, num_updates=step)``::

    d = min(decay, (1 + step) / (10 + step))
    shadow -= (1 - d) * (shadow - params)

The shadow starts equal to the initial weights and lives in one flat buffer on
the first tower's device.  In grads mode the optimizers fuse this update into
the first replica's update pass (``EMA.apply``, ``EMA.gpu_body``); in weights
mode it runs on its own after each weight average (``EMA.update``).
"""
from __future__ import annotations

import numpy

from towers.devices.kernels import host_blocks
from towers.devices.placement import array_module
from towers.optim.kernels import flat_kernel


def ema_decay(decay: float, step: int) -> float:
    """TF ``ExponentialMovingAverage`` decay with ``num_updates=step``."""
    return min(decay, (1.0 + step) / (10.0 + step))


class EMA:
    """The moving average of the weights: one flat shadow buffer on one device.

    Usually updated inside the optimizer's step (fused with the update).  ``update`` is
    the standalone pass, for when the weights change outside the optimizer
    (weight averaging in ``--sync weights``).
    """

    # The update as CUDA source over the new weights ``{p}`` (fused into the
    # optimizers' kernels, or run alone by ``update``).
    GPU_BODY = "e = e - (e - {p}) * one_minus_d;\n"

    def __init__(self, params, decay: float):
        self.decay = float(decay)
        self.shadow = params.copy()  # TF starts the shadow at the variable's value
        self._tmp = None

    def state_dict(self, layout) -> dict:
        """{ema/name: host array} (``layout``: ``towers.state.Layout`` of the weights)."""
        return layout.split(self.shadow, "ema/")

    def read_state(self, state: dict, layout, where: str):
        """The ``ema/`` weights of ``state`` as a checked host flat buffer (a ``UserError`` names a bad one)."""
        from towers.errors import UserError
        from towers.state import under

        named = under(state, "ema")
        if not named:
            raise UserError(f"{where}: no ema/ weights")
        return layout.join(layout.check(named, f"{where} (ema)"))

    def set_state(self, flat) -> None:
        self.shadow[...] = array_module(self.shadow).asarray(flat)

    def update(self, params, num_updates: int) -> None:
        """``shadow -= (1 - d) * (shadow - params)`` with d from ``num_updates``."""
        t = self.shadow.dtype.type
        one_minus_d = t(1.0 - ema_decay(self.decay, num_updates))
        if isinstance(self.shadow, numpy.ndarray):
            if self._tmp is None:
                self._tmp = numpy.empty_like(self.shadow)
            for b in host_blocks(0, self.shadow.size, self.shadow.itemsize):  # in cache: see Optimizer.step
                self.apply(params[b], one_minus_d, self._tmp[b], b)
        else:
            flat_kernel(("p",), ("one_minus_d",), ("e",), self.GPU_BODY.format(p="p"), "towers_ema")(
                params, one_minus_d, self.shadow)

    def apply(self, params, one_minus_d, tmp, part: slice = slice(None)) -> None:
        """The CPU pass over ``shadow[part]`` (``params``, ``tmp``: that slice's)."""
        e = self.shadow[part]
        numpy.subtract(e, params, out=tmp)
        tmp *= one_minus_d
        e -= tmp

