"""Adam as ``tf.train.AdamOptimizer`` (``t`` = updates so far + 1; bias correction folded into the step)::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + epsilon)

Slots: ``adam_m``, ``adam_v``.
"""
from __future__ import annotations

import math

from towers.ops.codegen.expr import sqrt
from towers.optim.optimizers.base import Optimizer
from towers.settings import Number, hyperparameter


class Adam(Optimizer):
    """TensorFlow's ``AdamOptimizer`` (bias correction folded into the step size)."""

    name = "adam"
    settings = {
        "beta1": hyperparameter(0.9, "Adam's first-moment decay (TF default 0.9)",
                                check=Number(0, 1, high_open=True, optional=True)),
        "beta2": hyperparameter(0.999, "Adam's second-moment decay (TF default 0.999)",
                                check=Number(0, 1, high_open=True, optional=True)),
        "epsilon": hyperparameter(1e-8, "Adam's epsilon (TF default 1e-8)",
                                  check=Number(0, low_open=True, optional=True)),
    }
    reads = ("beta1", "beta2", "epsilon")
    # The learning rate is TensorFlow's AdamOptimizer default.
    defaults = {"lr": 0.001, "lr_decay": 1.0, "l2": 1e-4}
    all_slots = slots = ("adam_m", "adam_v")
    scalars = ("lr_t", "b1", "b2", "eps")

    def __init__(self, params, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8, ema=None):
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)
        super().__init__(params, ema)

    @classmethod
    def from_config(cls, cfg, params, ema=None):
        return cls(params, cfg.beta1, cfg.beta2, cfg.epsilon, ema)

    def _scalars(self, lr, step):
        t = step + 1
        lr_t = lr * math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        return (lr_t, self.beta1, self.beta2, self.epsilon)

    def update(self, p, g, slot, k):
        slot.adam_m, slot.adam_v = moments(slot.adam_m, slot.adam_v, g, k.b1, k.b2)
        return p - (slot.adam_m / (sqrt(slot.adam_v) + k.eps)) * k.lr_t


def moments(m, v, g, b1, b2):
    """Adam's moments' new values (AdamW's too): ``m * b1 + g * (1 - b1)``, ``v * b2 + g^2 * (1 - b2)``."""
    return m * b1 + g * (1 - b1), v * b2 + (g * g) * (1 - b2)
