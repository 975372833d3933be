"""The exponential moving average (EMA) of the weights: the one place its formula lives.

TensorFlow's ``ExponentialMovingAverage(decay, num_updates=global_step)``::

    d = min(decay, (1 + n) / (10 + n))
    shadow -= (1 - d) * (shadow - params)

where ``n`` counts the updates including the one the EMA follows: the TF1
multi-GPU example applies the average after ``apply_gradients`` (under
``tf.control_dependencies``), which has already incremented ``global_step``,
so its first average uses ``min(decay, 2 / 11)``.  towers takes the same
count, so that its EMA matches the example's step for step (``Optimizer.step``
passes its step count plus one; weights mode passes the number of weight
averages so far, this one included).

``ema_decay`` is the first line, ``ema`` the second, written once as a function
of one element (``towers.ops.codegen.expr``): the optimizers fuse it into the first
replica's update (``towers.optim.optimizers.base``: one pass, one kernel), it
runs on its own after each weight average in weights mode (``EMA.update``, an
``Elementwise`` op of it), and batch norm's moving statistics follow the same
formula (``towers.nn.normalization``).

The shadow starts equal to the initial weights and lives in one flat buffer on
the first tower's device.
"""
from __future__ import annotations

from towers.arrays import array_module
from towers.ops.codegen.elementwise import Elementwise


def ema_decay(decay: float, num_updates: int) -> float:
    """TF ``ExponentialMovingAverage`` decay with ``num_updates`` (``min(decay, (1 + n) / (10 + n))``)."""
    return min(decay, (1.0 + num_updates) / (10.0 + num_updates))


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
        """``1 - d`` for ``num_updates`` (the updates so far, the one this average follows included: 1 for the
        first), in the shadow's dtype (the update's scalar)."""
        return self.shadow.dtype.type(1.0 - ema_decay(self.decay, num_updates))

    def update(self, params, num_updates: int) -> None:
        """``shadow -= (1 - d) * (shadow - params)`` with d from ``num_updates`` (as ``one_minus_d``): one pass
        (``_UPDATE``)."""
        _UPDATE(params, self.shadow, self.one_minus_d(num_updates))
