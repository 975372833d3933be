"""State dicts: flat buffers as named host arrays, and strict loading that names the bad key.

Every component of a run owns its state and saves it under its own prefix
(``Trainer.state_dict`` is their union):

=================  ==========================================  ===========================
component          keys                                        module
=================  ==========================================  ===========================
model (replicas)   ``params/<name>``, ``buffers/<name>``       ``towers.step.tower``
optimizer          its slots: ``momentum/<name>``, ...         ``towers.optim.optimizers``
EMA                ``ema/<name>``                              ``towers.optim.ema``
input position     ``data/epoch``, ``data/index``              ``towers.data.batches``
step engine        ``step``                                    ``towers.step.engine``
replica keeper     ``sync/n_averages``                         ``towers.parallel.sync``
loss scale (fp16)  ``loss_scale/`` ``scale``, ``clean_steps``,  ``towers.optim.loss_scale``
                   ``skipped``
checkpoint format  ``format``, ``config``, ``data/shape``, ...  ``towers.output.checkpoint``
=================  ==========================================  ===========================

A ``Layout`` maps names to slices of one flat float32 buffer (the model's
``layout()`` for weights and optimizer slots, ``buffer_layout()`` for
non-trainable buffers).  Loading is two-phase: a component's ``prepare``
checks its part of a state dict and returns a function that applies it, so a
bad key anywhere changes nothing anywhere.
"""
from __future__ import annotations

import numpy

from towers.arrays import check_host, to_host
from towers.errors import UserError


class Layout:
    """(name, shape, offset, size) rows of one flat buffer, and the conversions both ways; ``minimums``: {name:
    least value} that ``check`` enforces (a model's ``minimums()``: batch norm's moving variance >= 0)."""

    def __init__(self, rows, minimums: dict | None = None):
        self.rows = [(name, tuple(shape), int(off), int(size)) for name, shape, off, size in rows]
        self.size = sum(size for *_, size in self.rows)
        self.minimums = dict(minimums or {})

    @property
    def names(self) -> list[str]:
        return [name for name, *_ in self.rows]

    def split(self, flat, prefix: str = "") -> dict[str, numpy.ndarray]:
        """A flat (host or device) buffer as {prefix + name: host array} (a host copy)."""
        host = to_host(flat, copy=True)
        return {prefix + name: host[off: off + size].reshape(shape) for name, shape, off, size in self.rows}

    def join(self, named: dict) -> numpy.ndarray:
        """Named arrays (checked) as one host float32 flat buffer."""
        flat = numpy.empty(self.size, dtype=numpy.float32)
        for name, shape, off, size in self.rows:
            flat[off: off + size] = numpy.asarray(named[name], dtype=numpy.float32).reshape(-1)
        return flat

    def check(self, named: dict, where: str, what: str = "weight") -> dict:
        """``named`` if it holds exactly these names with their shapes, as finite real numbers within float32's
        range and at least each name's minimum.

        Otherwise a ``UserError`` naming the first bad name.
        """
        if not isinstance(named, dict):
            raise UserError(f"{where}: give a dict of name -> array, got {type(named).__name__}")
        want = {name: shape for name, shape, _, _ in self.rows}
        for name in want:
            if name not in named:
                raise UserError(f"{where}: {name!r} is missing (the model has {', '.join(want)})")
        for name, a in named.items():
            if name not in want:
                raise UserError(f"{where}: {name!r} is not a {what} of this model (it has {', '.join(want)})")
            check_array(a, want[name], f"{where}: {name!r}", "the model's")
            low = self.minimums.get(name)
            if low is not None and (numpy.asarray(a) < low).any():
                i = int(numpy.argmax(numpy.ravel(numpy.asarray(a)) < low))
                raise UserError(f"{where}: {name!r} holds {numpy.ravel(a)[i]:g} at flat index {i}, below its least "
                                f"value {low:g}; give values >= {low:g}")
        return named


def check_array(a, shape: tuple, what: str, whose: str = "expected") -> None:
    """A real, finite host array of ``shape``, or a ``UserError`` that starts with ``what``."""
    check_host(a, what)
    if tuple(numpy.shape(a)) != tuple(shape):
        raise UserError(f"{what} has shape {tuple(numpy.shape(a))}, {whose} is {tuple(shape)}")
    a = numpy.asarray(a)
    if not (numpy.issubdtype(a.dtype, numpy.floating) or numpy.issubdtype(a.dtype, numpy.integer)):
        raise UserError(f"{what} is {a.dtype}; give real numbers (float32)")
    if not numpy.isfinite(a).all():
        raise UserError(f"{what} holds NaN or inf")
    big = numpy.finfo(numpy.float32).max
    if a.dtype.itemsize > 4 and numpy.issubdtype(a.dtype, numpy.floating) and (numpy.abs(a) > big).any():
        i = int(numpy.argmax(numpy.ravel(numpy.abs(a) > big)))
        raise UserError(f"{what} holds {numpy.ravel(a)[i]:g} at flat index {i}, beyond float32's range (+-{big:.4g}): "
                        "towers keeps weights in float32, where it would be inf")


def under(state: dict, prefix: str) -> dict:
    """The entries of ``state`` under ``prefix/``, without the prefix."""
    return {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + "/")}


def count(state: dict, key: str, where: str, minimum: int = 0) -> int:
    """``state[key]`` as an int of at least ``minimum``, or a ``UserError`` naming the key."""
    if key not in state:
        raise UserError(f"{where}: {key!r} is missing")
    a = numpy.asarray(state[key])
    if a.shape != () or not numpy.issubdtype(a.dtype, numpy.integer) or int(a) < minimum:
        raise UserError(f"{where}: {key!r} must be an integer >= {minimum}, got {a.dtype} {a.tolist()!r}")
    return int(a)
