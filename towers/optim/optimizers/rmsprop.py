"""RMSProp as TensorFlow 1's ``tf.train.RMSPropOptimizer`` (its ``ApplyRMSProp`` kernels)::

    ms  = decay * ms + (1 - decay) * g * g
    mg  = decay * mg + (1 - decay) * g                    (centered only)
    mom = momentum * mom + lr * g / sqrt(ms + epsilon)    (centered: sqrt(ms - mg^2 + epsilon))
    p   = p - mom

As in TF 1, ``ms`` starts at ones (Keras' RMSprop starts it at zeros), the
others at zeros.  Slots: ``rmsprop_ms``, ``rmsprop_mom``, and ``rmsprop_mg``
when centered (a resume that turns ``rmsprop_centered`` on starts it at zero).
"""
from __future__ import annotations

from towers.ops.codegen.expr import sqrt
from towers.optim.optimizers.base import Optimizer
from towers.settings import NOTE, Number, hyperparameter, switch


class RMSProp(Optimizer):
    """TF 1's ``RMSPropOptimizer``; reads SGD's ``momentum`` (TF's default 0 is the generic one)."""

    name = "rmsprop"
    settings = {
        "rmsprop_decay": hyperparameter(0.9, "RMSProp's decay of the mean square (TF `decay`, default 0.9)",
                                        check=Number(0, 1, high_open=True, optional=True), metavar="RHO"),
        "rmsprop_epsilon": hyperparameter(1e-10, "RMSProp's epsilon, inside the square root (TF default 1e-10)",
                                          check=Number(0, low_open=True, optional=True), metavar="EPS"),
        "rmsprop_centered": switch("centered RMSProp: divide by the estimated variance, ms - mg^2, "
                                    "not the mean square (TF `centered`)", group="optimization", resume=NOTE),
    }
    reads = ("rmsprop_decay", "momentum", "rmsprop_epsilon", "rmsprop_centered")
    defaults = {"lr": 0.001, "lr_decay": 1.0, "momentum": 0.0, "l2": 1e-4}
    all_slots = ("rmsprop_ms", "rmsprop_mom", "rmsprop_mg")
    slot_init = {"rmsprop_ms": 1.0}
    scalars = ("lr", "rho", "mu", "eps")

    def __init__(self, params, decay=0.9, momentum=0.0, epsilon=1e-10, centered=False, ema=None):
        self.decay, self.momentum, self.epsilon = float(decay), float(momentum), float(epsilon)
        self.centered = bool(centered)
        self.slots = ("rmsprop_ms", "rmsprop_mom") + (("rmsprop_mg",) if self.centered else ())
        super().__init__(params, ema)

    @classmethod
    def from_config(cls, cfg, params, ema=None):
        return cls(params, cfg.rmsprop_decay, cfg.momentum, cfg.rmsprop_epsilon, cfg.rmsprop_centered, ema)

    def _scalars(self, lr, step):
        return (lr, self.decay, self.momentum, self.epsilon)

    def update(self, p, g, slot, k):
        slot.rmsprop_ms = slot.rmsprop_ms * k.rho + (g * g) * (1 - k.rho)
        mean_square = slot.rmsprop_ms
        if self.centered:
            slot.rmsprop_mg = slot.rmsprop_mg * k.rho + g * (1 - k.rho)
            mean_square = slot.rmsprop_ms - slot.rmsprop_mg * slot.rmsprop_mg
        slot.rmsprop_mom = slot.rmsprop_mom * k.mu + (g / sqrt(mean_square + k.eps)) * k.lr
        return p - slot.rmsprop_mom
