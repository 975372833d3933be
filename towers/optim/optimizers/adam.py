"""Adam as ``tf.train.AdamOptimizer`` (``t`` = updates so far + 1; bias correction folded into the step)::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + epsilon)

Slots: ``adam_m``, ``adam_v``.
"""
from __future__ import annotations

import math

import numpy

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
    # The products and sums of ``_cpu_update``, in its order (``towers.optim.kernels``: no FMA contraction).
    GPU_BODY = ("adam_m = adam_m * b1 + g * (1 - b1);\n"
                "adam_v = adam_v * b2 + (g * g) * (1 - b2);\n"
                "T p_new = p - (adam_m / (sqrt(adam_v) + eps)) * lr_t;\n")

    def __init__(self, params, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8, ema=None):
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)
        super().__init__(params, ema)

    @classmethod
    def from_config(cls, cfg, params, ema=None):
        return cls(params, cfg.beta1, cfg.beta2, cfg.epsilon, ema)

    def _scalar_names(self):
        return ("lr_t", "b1", "b2", "eps")

    def _scalars(self, lr, step):
        t = step + 1
        lr_t = lr * math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        return (lr_t, self.beta1, self.beta2, self.epsilon)

    def _cpu_update(self, p, g, tmp, scalars, state):
        lr_t, b1, b2, eps = scalars
        m, v = state["adam_m"], state["adam_v"]
        moments(m, v, g, tmp, b1, b2)
        numpy.sqrt(v, out=tmp)
        tmp += eps
        numpy.divide(m, tmp, out=tmp)
        tmp *= lr_t
        p -= tmp

    def _loop_args(self, part, scalars):
        lr_t, b1, b2, eps = scalars
        return (self.state["adam_m"][part], self.state["adam_v"][part], lr_t, b1, b2, b1.dtype.type(1) - b1,
                b2.dtype.type(1) - b2, eps)

    @staticmethod
    def cpu_loop(p, g, e, omd, m, v, lr_t, b1, b2, c1, c2, eps):  # pragma: no cover - compiled by numba
        """``_cpu_update`` (``c1``, ``c2``: 1 - b1, 1 - b2) and the EMA one element at a time: the same roundings."""
        for i in range(p.size):
            mi = m[i] * b1 + g[i] * c1
            vi = v[i] * b2 + (g[i] * g[i]) * c2
            m[i], v[i] = mi, vi
            pn = p[i] - (mi / (numpy.sqrt(vi) + eps)) * lr_t
            p[i] = pn
            if e.size:
                e[i] = e[i] - (e[i] - pn) * omd


def moments(m, v, g, tmp, b1, b2) -> None:
    """Adam's moment updates in place (``tmp``: scratch): m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2."""
    m *= b1
    numpy.multiply(g, 1 - b1, out=tmp)
    m += tmp
    v *= b2
    numpy.multiply(g, g, out=tmp)
    tmp *= 1 - b2
    v += tmp
