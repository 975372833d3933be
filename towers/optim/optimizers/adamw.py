"""AdamW as ``torch.optim.AdamW``: Adam with decoupled weight decay (Loshchilov and Hutter).

With ``t`` = updates so far + 1::

    p = p * (1 - lr * weight_decay)                       (decoupled: not through the gradient)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + epsilon)

epsilon is added after the bias correction of ``v``, as torch does (TF's Adam
adds it before).  The decay applies to every parameter, biases and batch-norm
scales included, as torch's default parameter group does; ``l2`` (towers' L2
through the gradient, on weights only) defaults to 0 with AdamW, the decay
replaces it.  Slots: ``adam_m``, ``adam_v`` (Adam's: the same moments).
"""
from __future__ import annotations

import math

from towers.errors import UserError
from towers.ops.codegen.expr import sqrt
from towers.optim.optimizers.adam import moments
from towers.optim.optimizers.base import Optimizer
from towers.optim.schedule import piecewise_values
from towers.settings import Number, hyperparameter


class AdamW(Optimizer):
    """torch's ``AdamW`` (amsgrad off); reads Adam's ``beta1``, ``beta2``, ``epsilon``."""

    name = "adamw"
    settings = {
        "weight_decay": hyperparameter(
            0.01, "AdamW's decoupled weight decay: every step multiplies each parameter by 1 - lr * D "
            "(torch default 0.01)", check=Number(0, optional=True), metavar="D"),
    }
    reads = ("beta1", "beta2", "epsilon", "weight_decay")
    defaults = {"lr": 0.001, "lr_decay": 1.0, "l2": 0.0}  # torch's lr; the decay replaces L2
    all_slots = slots = ("adam_m", "adam_v")
    scalars = ("keep", "step_size", "inv_root_bc2", "b1", "b2", "eps")

    def __init__(self, params, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.01, ema=None):
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)
        self.weight_decay = float(weight_decay)
        super().__init__(params, ema)

    @classmethod
    def from_config(cls, cfg, params, ema=None):
        return cls(params, cfg.beta1, cfg.beta2, cfg.epsilon, cfg.weight_decay, ema)

    @classmethod
    def check(cls, cfg):
        """The decay keeps ``1 - lr * weight_decay`` of every parameter each step: at lr x weight_decay >= 1
        that zeroes or flips the sign of every weight, whatever the gradient.  ``lr`` is the schedule's
        largest rate: the first (exponential, cosine; warm-up only climbs to it), or the largest piecewise
        value."""
        peak = max(piecewise_values(cfg)[1]) if cfg.lr_schedule == "piecewise" else cfg.lr
        if peak * cfg.weight_decay >= 1:
            raise UserError(f"`lr` {peak:g} x `weight_decay` {cfg.weight_decay:g} = {peak * cfg.weight_decay:g}, not "
                            "below 1: AdamW multiplies every parameter by 1 - lr x weight_decay each step, which would "
                            "zero or flip the weights; lower `lr` or `weight_decay` (torch's defaults: 0.001 x 0.01)")

    def _scalars(self, lr, step):
        t = step + 1
        return (1.0 - lr * self.weight_decay, lr / (1.0 - self.beta1 ** t),
                1.0 / math.sqrt(1.0 - self.beta2 ** t), self.beta1, self.beta2, self.epsilon)

    def update(self, p, g, slot, k):
        slot.adam_m, slot.adam_v = moments(slot.adam_m, slot.adam_v, g, k.b1, k.b2)
        return p * k.keep - (slot.adam_m / (sqrt(slot.adam_v) * k.inv_root_bc2 + k.eps)) * k.step_size
