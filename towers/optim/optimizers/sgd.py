"""SGD, with momentum as ``tf.train.MomentumOptimizer`` (and its ``use_nesterov``)::

    v = momentum * v + g                 (only when momentum > 0)
    p = p - lr * (v or g)
    p = p - lr * (g + momentum * v)      (instead, with nesterov)

Slot: ``momentum`` (only when momentum > 0).
"""
from __future__ import annotations

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
    scalars = ("lr", "mu")

    def __init__(self, params, momentum: float = 0.0, ema=None, nesterov: bool = False):
        self.momentum, self.nesterov = float(momentum), bool(nesterov) and bool(momentum)
        self.slots = ("momentum",) if self.momentum else ()
        super().__init__(params, ema)

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

    def _scalars(self, lr, step):
        return (lr, self.momentum)

    def update(self, p, g, slot, k):
        if not self.momentum:
            return p - g * k.lr
        slot.momentum = slot.momentum * k.mu + g
        step = slot.momentum * k.mu + g if self.nesterov else slot.momentum
        return p - step * k.lr
