"""The exponential moving average (EMA) of the weights: the one place its formula lives.

TensorFlow's ``ExponentialMovingAverage(decay, num_updates=step)``::

    d = min(decay, (1 + step) / (10 + step))
    shadow -= (1 - d) * (shadow - params)

``ema_decay`` is the first line, ``ema`` the second, written once as a function
of one element (``towers.ops.expr``): the optimizers fuse it into the first
replica's update (``towers.optim.optimizers.base``: one pass, one kernel), it
runs on its own after each weight average in weights mode (``EMA.update``, an
``Elementwise`` op of it), and batch norm's moving statistics follow the same
formula (``towers.nn.normalization``).

The shadow starts equal to the initial weights and lives in one flat buffer on
the first tower's device.
"""
from __future__ import annotations

from towers.devices.placement import array_module
from towers.ops.elementwise import Elementwise


def ema_decay(decay: float, step: int) -> float:
    """TF ``ExponentialMovingAverage`` decay with ``num_updates=step``."""
    return min(decay, (1.0 + step) / (10.0 + step))


def ema(shadow, params, one_minus_d):
    """The shadow's new value: ``shadow - (shadow - params) * (1 - d)`` (an element, an array or a traced value)."""
    return shadow - (shadow - params) * one_minus_d


# The update alone over flat buffers (weights mode): every form of ``ema``.
_UPDATE = Elementwise("ema", lambda p, e, one_minus_d: ema(e, p, one_minus_d), ("e",), scalars=("one_minus_d",),
                      module=False, distinct=True)


class EMA:
    """The moving average of the weights: one flat shadow buffer on one device.

    Usually updated inside the optimizer's step (fused with the update).  ``update`` is
    the standalone pass, for when the weights change outside the optimizer
    (weight averaging in ``--sync weights``).
    """

    def __init__(self, params, decay: float):
        self.decay = float(decay)
        self.shadow = params.copy()  # TF starts the shadow at the variable's value

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

    def one_minus_d(self, num_updates: int):
        """``1 - d`` for ``num_updates``, in the shadow's dtype (the update's scalar)."""
        return self.shadow.dtype.type(1.0 - ema_decay(self.decay, num_updates))

    def update(self, params, num_updates: int) -> None:
        """``shadow -= (1 - d) * (shadow - params)`` with d from ``num_updates``: one pass (``_UPDATE``)."""
        _UPDATE(params, self.shadow, self.one_minus_d(num_updates))
