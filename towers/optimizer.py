"""Optimizer: learning-rate schedule, SGD (with optional momentum) and the EMA.

Per step, on every replica, after the all-reduce has left identical averaged
gradients ``g`` in each replica's flat gradient buffer:

    v = momentum * v + g                 (only when momentum > 0)
    p = p - lr * (v or g)
    ema = ema - (1 - d) * (ema - p)      (first tower only)

with TensorFlow's formulas:

* ``lr = lr0 * decay_rate ** (examples_seen / examples_per_epoch)``
  (``exponential_decay``; ``staircase`` floors the exponent);
* ``d = min(ema_decay, (1 + step) / (10 + step))``
  (``ExponentialMovingAverage(decay, num_updates=step)``), the shadow starting
  equal to the initial weights.

On a GPU the three lines are one fused elementwise kernel over the flat buffer.
On the CPU NumPy has no fusion, so they are a few in-place passes over
preallocated scratch (no allocation per step).  Every replica runs the same
arithmetic on the same inputs, so replicas stay bit-identical.
"""
from __future__ import annotations

import math

import numpy


def learning_rate(lr0: float, decay_rate: float, examples_seen: int, examples_per_epoch: int,
                  staircase: bool = False) -> float:
    """TF ``exponential_decay`` with ``decay_steps`` counted in examples (one epoch)."""
    exponent = examples_seen / examples_per_epoch
    if staircase:
        exponent = math.floor(exponent)
    return lr0 * decay_rate ** exponent


def ema_decay(decay: float, step: int) -> float:
    """TF ``ExponentialMovingAverage`` decay with ``num_updates=step``."""
    return min(decay, (1.0 + step) / (10.0 + step))


_KERNELS: dict = {}


def _gpu_kernel(momentum: bool, ema: bool):
    """The fused update as one CuPy ElementwiseKernel (built once per variant)."""
    key = (momentum, ema)
    if key not in _KERNELS:
        import cupy

        params = "T g, T lr, T mu, T one_minus_d"
        outs = "T p" + (", T v" if momentum else "") + (", T e" if ema else "")
        body = "T step = g;\n"
        if momentum:
            body += "v = mu * v + g;\nstep = v;\n"
        body += "T np_ = p - lr * step;\np = np_;\n"
        if ema:
            body += "e = e - one_minus_d * (e - np_);\n"
        _KERNELS[key] = cupy.ElementwiseKernel(
            params, outs, body, f"towers_sgd_m{int(momentum)}_e{int(ema)}"
        )
    return _KERNELS[key]


class SGD:
    """Update of one replica's flat buffer, with the EMA when this replica holds it."""

    def __init__(self, params, momentum: float = 0.0, ema=None):
        self.params = params
        self.xp = _array_module(params)
        self.dtype = params.dtype.type
        self.momentum = float(momentum)
        self.velocity = self.xp.zeros_like(params) if self.momentum else None
        self.ema = ema  # an EMA whose shadow lives on this replica's device, or None
        self._tmp = None if self.xp is not numpy else numpy.empty_like(params)

    def step(self, grads, lr: float, step: int, part: slice | None = None) -> None:
        """Apply one update with learning rate ``lr``; ``step`` counts earlier updates.

        ``part`` (CPU only) limits the update to a slice of the flat buffer, so
        that concurrent CPU towers can each update a share of it; ``grads`` is
        then that slice's gradients.
        """
        one_minus_d = 1.0 - ema_decay(self.ema.decay, step) if self.ema is not None else 0.0
        t = self.dtype
        if self.xp is numpy:
            self._cpu_step(grads, t(lr), t(one_minus_d), slice(None) if part is None else part)
        else:
            if part is not None:
                raise ValueError("SGD.step(part=...) is for CPU buffers only")
            args = [grads, t(lr), t(self.momentum), t(one_minus_d), self.params]
            if self.velocity is not None:
                args.append(self.velocity)
            if self.ema is not None:
                args.append(self.ema.shadow)
            _gpu_kernel(self.velocity is not None, self.ema is not None)(*args)

    def _cpu_step(self, g, lr, one_minus_d, part: slice) -> None:
        tmp, p = self._tmp[part], self.params[part]
        step = g
        if self.velocity is not None:
            v = self.velocity[part]
            v *= self.dtype(self.momentum)
            v += g
            step = v
        numpy.multiply(step, lr, out=tmp)
        p -= tmp
        if self.ema is not None:
            self.ema.apply(p, one_minus_d, tmp, part)


class EMA:
    """The moving average of the weights: one flat shadow buffer on one device.

    Usually updated inside ``SGD.step`` (fused with the update).  ``update`` is
    the standalone pass, for when the weights change outside the optimizer
    (weight averaging in ``--sync weights``).
    """

    def __init__(self, params, decay: float):
        self.decay = float(decay)
        self.shadow = params.copy()  # TF starts the shadow at the variable's value
        self._tmp = None

    def update(self, params, num_updates: int) -> None:
        """``shadow -= (1 - d) * (shadow - params)`` with d from ``num_updates``."""
        t = self.shadow.dtype.type
        one_minus_d = t(1.0 - ema_decay(self.decay, num_updates))
        if isinstance(self.shadow, numpy.ndarray):
            if self._tmp is None:
                self._tmp = numpy.empty_like(self.shadow)
            self.apply(params, one_minus_d, self._tmp)
        else:
            _gpu_ema_kernel()(params, one_minus_d, self.shadow)

    def apply(self, params, one_minus_d, tmp, part: slice = slice(None)) -> None:
        """The CPU pass over ``shadow[part]`` (``params``, ``tmp``: that slice's)."""
        e = self.shadow[part]
        numpy.subtract(e, params, out=tmp)
        tmp *= one_minus_d
        e -= tmp


def _gpu_ema_kernel():
    if "ema" not in _KERNELS:
        import cupy

        _KERNELS["ema"] = cupy.ElementwiseKernel(
            "T p, T one_minus_d", "T e", "e = e - one_minus_d * (e - p);", "towers_ema"
        )
    return _KERNELS["ema"]


def _array_module(a):
    return numpy if isinstance(a, numpy.ndarray) else __import__("cupy")
