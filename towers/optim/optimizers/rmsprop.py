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

import numpy

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

    def __init__(self, params, decay=0.9, momentum=0.0, epsilon=1e-10, centered=False, ema=None):
        self.decay, self.momentum, self.epsilon = float(decay), float(momentum), float(epsilon)
        self.centered = bool(centered)
        self.slots = ("rmsprop_ms", "rmsprop_mom") + (("rmsprop_mg",) if self.centered else ())
        self.variant = "_centered" if self.centered else ""
        super().__init__(params, ema)
        mean_square = "rmsprop_ms - rmsprop_mg * rmsprop_mg" if self.centered else "rmsprop_ms"
        # The products and sums of ``_cpu_update``, in its order (``towers.optim.kernels``: no FMA contraction).
        self.GPU_BODY = ("rmsprop_ms = rmsprop_ms * rho + (g * g) * (1 - rho);\n"
                         + ("rmsprop_mg = rmsprop_mg * rho + g * (1 - rho);\n" if self.centered else "")
                         + f"rmsprop_mom = rmsprop_mom * mu + (g / sqrt({mean_square} + eps)) * lr;\n"
                         "T p_new = p - rmsprop_mom;\n")

    @classmethod
    def from_config(cls, cfg, params, ema=None):
        return cls(params, cfg.rmsprop_decay, cfg.momentum, cfg.rmsprop_epsilon, cfg.rmsprop_centered, ema)

    def _scalar_names(self):
        return ("lr", "rho", "mu", "eps")

    def _scalars(self, lr, step):
        return (lr, self.decay, self.momentum, self.epsilon)

    def _cpu_update(self, p, g, tmp, scalars, state):
        lr, rho, mu, eps = scalars
        ms, mom = state["rmsprop_ms"], state["rmsprop_mom"]
        ms *= rho
        numpy.multiply(g, g, out=tmp)
        tmp *= 1 - rho
        ms += tmp
        if self.centered:
            mg = state["rmsprop_mg"]
            mg *= rho
            numpy.multiply(g, 1 - rho, out=tmp)
            mg += tmp
            numpy.multiply(mg, mg, out=tmp)
            numpy.subtract(ms, tmp, out=tmp)
        else:
            tmp[...] = ms
        tmp += eps
        numpy.sqrt(tmp, out=tmp)
        numpy.divide(g, tmp, out=tmp)
        tmp *= lr
        mom *= mu
        mom += tmp
        p -= mom

    def _loop_args(self, part, scalars):
        lr, rho, mu, eps = scalars
        mg = self.state["rmsprop_mg"][part] if self.centered else self.params[part][:0]
        return (self.state["rmsprop_ms"][part], self.state["rmsprop_mom"][part], mg, lr, rho, rho.dtype.type(1) - rho,
                mu, eps, self.centered)

    @staticmethod
    def cpu_loop(p, g, e, omd, ms, mom, mg, lr, rho, c, mu, eps, centered):  # pragma: no cover - compiled by numba
        """``_cpu_update`` (``c``: 1 - rho) and the EMA one element at a time: the same roundings."""
        for i in range(p.size):
            msi = ms[i] * rho + (g[i] * g[i]) * c
            ms[i] = msi
            d = msi
            if centered:
                mgi = mg[i] * rho + g[i] * c
                mg[i] = mgi
                d = msi - mgi * mgi
            mi = mom[i] * mu + (g[i] / numpy.sqrt(d + eps)) * lr
            mom[i] = mi
            pn = p[i] - mi
            p[i] = pn
            if e.size:
                e[i] = e[i] - (e[i] - pn) * omd
