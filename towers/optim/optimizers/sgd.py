"""SGD, with momentum as ``tf.train.MomentumOptimizer`` (and its ``use_nesterov``)::

    v = momentum * v + g                 (only when momentum > 0)
    p = p - lr * (v or g)
    p = p - lr * (g + momentum * v)      (instead, with nesterov)

Slot: ``momentum`` (only when momentum > 0).
"""
from __future__ import annotations

import numpy

from towers.errors import UserError
from towers.optim.optimizers.base import Optimizer
from towers.settings import NOTE, Number, hyperparameter, switch


class SGD(Optimizer):
    """Gradient descent, with momentum when ``momentum`` > 0 (Nesterov's with ``nesterov``)."""

    name = "sgd"
    settings = {
        "momentum": hyperparameter(
            0.0, "momentum (default: the model's; mlp 0, lenet5 with sgd and resnets 0.9; "
            "0: plain SGD)", check=Number(0, 1, high_open=True, optional=True), metavar="M", shown="the model's"),
        "nesterov": switch("Nesterov momentum (TF `use_nesterov`; needs sgd with --momentum > 0)",
                           group="optimization", resume=NOTE),
    }
    reads = ("momentum", "nesterov")
    # The book's MNIST example settings (batch 100, lr 0.8 decayed 0.99 per epoch).
    defaults = {"lr": 0.8, "lr_decay": 0.99, "momentum": 0.0, "l2": 1e-4}
    all_slots = ("momentum",)

    def __init__(self, params, momentum: float = 0.0, ema=None, nesterov: bool = False):
        self.momentum, self.nesterov = float(momentum), bool(nesterov) and bool(momentum)
        self.slots = ("momentum",) if self.momentum else ()
        self.variant = "_nesterov" if self.nesterov else ""
        super().__init__(params, ema)
        # The products and sums of ``_cpu_update``, in its order (``towers.optim.kernels``: no FMA contraction).
        step = "(momentum * mu + g)" if self.nesterov else "momentum"
        self.GPU_BODY = (f"momentum = momentum * mu + g;\nT p_new = p - {step} * lr;\n" if self.momentum
                         else "T p_new = p - g * lr;\n")

    @classmethod
    def from_config(cls, cfg, params, ema=None):
        return cls(params, cfg.momentum, ema, nesterov=cfg.nesterov)

    @classmethod
    def check(cls, cfg):
        if cfg.nesterov and not cfg.momentum:
            raise UserError("`nesterov` is a kind of momentum: it needs `optimizer` sgd and `momentum` > 0")

    @property
    def velocity(self):
        return self.state.get("momentum")

    def _scalar_names(self):
        return ("lr", "mu")

    def _scalars(self, lr, step):
        return (lr, self.momentum)

    def _cpu_update(self, p, g, tmp, scalars, state):
        lr, mu = scalars
        step = g
        if "momentum" in state:
            v = state["momentum"]
            v *= mu
            v += g
            step = v
            if self.nesterov:  # g + mu * v, in tmp
                numpy.multiply(v, mu, out=tmp)
                tmp += g
                step = tmp
        numpy.multiply(step, lr, out=tmp)
        p -= tmp

    def _loop_args(self, part, scalars):
        lr, mu = scalars
        v = self.state["momentum"][part] if "momentum" in self.state else self.params[part][:0]
        return (v, lr, mu, bool(self.momentum), self.nesterov)

    @staticmethod
    def cpu_loop(p, g, e, omd, v, lr, mu, momentum, nesterov):  # pragma: no cover - compiled by numba
        """``_cpu_update`` and the EMA one element at a time (``Optimizer.step``): the same roundings."""
        for i in range(p.size):
            step = g[i]
            if momentum:
                v[i] = v[i] * mu + g[i]
                step = v[i] * mu + g[i] if nesterov else v[i]
            pn = p[i] - step * lr
            p[i] = pn
            if e.size:
                e[i] = e[i] - (e[i] - pn) * omd
