"""Optimizers: the update every replica applies after the all-reduce, SGD and Adam.

After the all-reduce each replica's flat gradient buffer holds the same averaged
gradient ``g``; every replica then runs the same arithmetic on the same inputs,
so replicas stay bit-identical.  The first tower's optimizer also updates the
EMA of the weights (``towers.optim.ema``) in the same pass.

SGD (with optional momentum, as ``tf.train.MomentumOptimizer``)::

    v = momentum * v + g                 (only when momentum > 0)
    p = p - lr * (v or g)
    p = p - lr * (g + momentum * v)      (instead, with nesterov: use_nesterov=True)

Adam (``tf.train.AdamOptimizer``; ``t`` = updates so far + 1)::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + epsilon)

State buffers (``slots``: momentum, Adam's two moments) have the parameters'
flat layout, so checkpoints name them like the weights and weights mode
averages them with the same all-reduce.

On a GPU each update, EMA included, is one fused elementwise kernel over the
flat buffer.  On the CPU NumPy has no fusion, so it is a few in-place passes
over preallocated scratch (no allocation per step); ``part`` restricts them to a
slice, so concurrent CPU tower threads can each update a share.
"""
from __future__ import annotations

import math

import numpy

from towers.errors import UserError
from towers.optim.ema import ema_decay
from towers.devices.placement import array_module
from towers.optim.kernels import flat_kernel

OPTIMIZERS = ("sgd", "adam")


class Optimizer:
    """The update of one replica's flat buffer, with the EMA when this replica holds it."""

    slots: tuple[str, ...] = ()  # state buffer names, as checkpoints store them

    def __init__(self, params, ema=None):
        self.params = params
        self.xp = array_module(params)
        self.dtype = params.dtype.type
        self.ema = ema  # an EMA whose shadow lives on this replica's device, or None
        self.state = {name: self.xp.zeros_like(params) for name in self.slots}
        self._tmp = numpy.empty_like(params) if self.xp is numpy else None
        self._kernel = None  # the fused GPU update, built on the first GPU step

    # -- state: the slots, named like the weights (``momentum/layer1/weights``)

    def state_dict(self, layout) -> dict:
        """{slot/name: host array} for every slot (``layout``: ``towers.state.Layout`` of the weights)."""
        return {k: v for slot, buf in self.state.items() for k, v in layout.split(buf, slot + "/").items()}

    def read_state(self, state: dict, layout, where: str) -> dict:
        """This optimizer's slots in ``state`` as checked host flat buffers (a ``UserError`` names a bad one).

        Slots of another optimizer (``SLOTS``) are checked and left out: after a
        change of optimizer or momentum the slots this one lacks start at zero.
        """
        from towers.state import under

        flats = {}
        for slot in SLOTS:
            named = under(state, slot)
            if named:
                flat = layout.join(layout.check(named, f"{where} ({slot})"))
                if slot in self.state:
                    flats[slot] = flat
        return flats

    def set_state(self, flats: dict) -> None:
        """Set the slots from ``read_state``'s output; slots it lacks become zero."""
        for slot, buf in self.state.items():
            buf[...] = self.xp.asarray(flats[slot]) if slot in flats else 0

    def step(self, grads, lr: float, step: int, part: slice | None = None) -> None:
        """Apply one update with learning rate ``lr``; ``step`` counts earlier updates.

        ``part`` (CPU only) limits the update to a slice of the flat buffer;
        ``grads`` is then that slice's gradients.
        """
        t = self.dtype
        one_minus_d = t(1.0 - ema_decay(self.ema.decay, step)) if self.ema is not None else t(0.0)
        scalars = [t(v) for v in self._scalars(lr, step)]
        if self.xp is numpy:
            part = slice(None) if part is None else part
            p, tmp = self.params[part], self._tmp[part]
            self._cpu_update(p, grads, tmp, scalars, {k: v[part] for k, v in self.state.items()})
            if self.ema is not None:
                self.ema.apply(p, one_minus_d, tmp, part)
            return
        if part is not None:
            raise ValueError("Optimizer.step(part=...) is for CPU buffers only")
        if self._kernel is None:
            self._kernel = self._gpu_kernel()
        self._kernel(grads, *scalars, one_minus_d, self.params, *self.state.values(),
                     *([self.ema.shadow] if self.ema is not None else []))

    def _gpu_kernel(self):
        names = list(self.state)
        outs = ("p", *names, *(("e",) if self.ema is not None else ()))
        body = self.GPU_BODY + "p = p_new;\n" + (self.ema.GPU_BODY.format(p="p_new") if self.ema is not None else "")
        return flat_kernel(("g",), (*self._scalar_names(), "one_minus_d"), outs, body,
                           f"towers_{type(self).__name__.lower()}_{len(names)}_e{int(self.ema is not None)}"
                           + ("_nesterov" if getattr(self, "nesterov", False) else ""))

    # -- subclasses
    GPU_BODY = ""  # CUDA source that sets ``T p_new`` (and updates the slots)

    def _scalar_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _scalars(self, lr: float, step: int) -> tuple[float, ...]:
        raise NotImplementedError

    def _cpu_update(self, p, g, tmp, scalars, state) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """Gradient descent, with momentum when ``momentum`` > 0 (Nesterov's with ``nesterov``)."""

    def __init__(self, params, momentum: float = 0.0, ema=None, nesterov: bool = False):
        self.momentum, self.nesterov = float(momentum), bool(nesterov) and bool(momentum)
        self.slots = ("momentum",) if self.momentum else ()
        super().__init__(params, ema)
        step = "(g + mu * momentum)" if self.nesterov else "momentum"
        self.GPU_BODY = (f"momentum = mu * momentum + g;\nT p_new = p - lr * {step};\n" if self.momentum
                         else "T p_new = p - lr * g;\n")

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


class Adam(Optimizer):
    """TensorFlow's ``AdamOptimizer`` (bias correction folded into the step size)."""

    slots = ("adam_m", "adam_v")
    GPU_BODY = ("adam_m = b1 * adam_m + (1 - b1) * g;\n"
                "adam_v = b2 * adam_v + (1 - b2) * g * g;\n"
                "T p_new = p - lr_t * adam_m / (sqrt(adam_v) + eps);\n")

    def __init__(self, params, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8, ema=None):
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)
        super().__init__(params, ema)

    def _scalar_names(self):
        return ("lr_t", "b1", "b2", "eps")

    def _scalars(self, lr, step):
        t = step + 1
        lr_t = lr * math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        return (lr_t, self.beta1, self.beta2, self.epsilon)

    def _cpu_update(self, p, g, tmp, scalars, state):
        lr_t, b1, b2, eps = scalars
        m, v = state["adam_m"], state["adam_v"]
        m *= b1
        numpy.multiply(g, 1 - b1, out=tmp)
        m += tmp
        v *= b2
        numpy.multiply(g, g, out=tmp)
        tmp *= 1 - b2
        v += tmp
        numpy.sqrt(v, out=tmp)
        tmp += eps
        numpy.divide(m, tmp, out=tmp)
        tmp *= lr_t
        p -= tmp


# Every optimizer's slot names: a checkpoint may hold another optimizer's (then they are dropped).
SLOTS = ("momentum", "adam_m", "adam_v")


def make_optimizer(cfg, params, ema=None) -> Optimizer:
    """The optimizer ``cfg.optimizer`` names, for one replica's flat buffer."""
    if cfg.optimizer == "sgd":
        return SGD(params, cfg.momentum, ema, nesterov=cfg.nesterov)
    if cfg.optimizer == "adam":
        return Adam(params, cfg.beta1, cfg.beta2, cfg.epsilon, ema)
    raise UserError(f"optimizer {cfg.optimizer!r} is unknown: use one of {', '.join(OPTIMIZERS)}")
