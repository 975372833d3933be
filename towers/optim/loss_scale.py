"""Dynamic loss scaling for ``--precision fp16``: the scale, its growth and back-off, the skipped steps.

What a user sees (defaults, log lines, metrics) is docs/training.md's "Low precision".  The loss's
gradient is multiplied by a scale S before backward (``towers.nn.replica``: every gradient comes out S
times larger), and after the all-reduce the keeper (``towers.parallel.sync.GradientAveraging``) calls
``unscale``, which decides the step:

* the averaged gradient holds an inf or NaN (the all-reduce carries any tower's overflow): the step is
  skipped -- no optimizer update, no EMA update, the slots untouched -- and S halves (``BACKOFF``), its
  clean-step count restarting at 0;
* otherwise the gradients are multiplied by 1/S (exact: S is a power of two) and the update runs; after
  ``growth_every`` clean steps in a row S doubles (``GROWTH``) and the count restarts.

S stays a power of two between 1 and 2**24.  Every tower and host agrees: the decision is made on the
averaged gradient, the same bytes on every replica, so the first replica's answers for all (on a GPU,
the one host sync point of a step: the finite check's flag read back).  A skipped step still counts as
a step of the run (step count, schedule, input position, checkpoints); it changes no weights, slots or
EMA, so Adam's bias correction and the EMA's warm-up then see one more step than updates applied.
``skipped`` counts them.

State (``state_dict``/``prepare``, under ``loss_scale/``): ``scale`` (float64), ``clean_steps`` and
``skipped`` (int64).  Strict: an unknown key under the prefix, or a bad value, is a ``UserError`` naming
it; a checkpoint without the keys resumes at the initial scale.
"""
from __future__ import annotations

import contextlib
import math

import numpy

from towers.arrays import array_module
from towers.errors import UserError
from towers.state import count, under

INITIAL = 2.0 ** 16
BACKOFF = 0.5
GROWTH = 2.0
LOWEST, HIGHEST = 1.0, 2.0 ** 24
PREFIX = "loss_scale"
KEYS = ("scale", "clean_steps", "skipped")


class LossScaler:
    """fp16's dynamic loss scale (module doc): ``scale``, ``clean_steps`` since the last change, ``skipped``."""

    def __init__(self, growth_every: int = 2000, scale: float = INITIAL):
        if growth_every < 1:
            raise ValueError(f"growth_every must be >= 1, got {growth_every}")
        self.growth_every = int(growth_every)
        self.scale, self.clean_steps, self.skipped = float(scale), 0, 0

    def unscale(self, grads: list, scopes: list | None = None) -> bool:
        """After the all-reduce: whether the step may update (module doc); if so every buffer of ``grads`` (the
        averaged gradients, host or device) is multiplied by 1/S, each inside its ``scopes`` entry (a context
        factory: its tower's device and stream, so the pass is ordered after the all-reduce on that stream).

        Moves the scale either way.  Sync point: the finite check of ``grads[0]`` is read back to the host.
        """
        scopes = scopes or [contextlib.nullcontext] * len(grads)
        first = grads[0]
        with scopes[0]():
            finite = bool(array_module(first).isfinite(first).all())
        if not finite:
            self.skipped += 1
            self.clean_steps = 0
            self.scale = max(self.scale * BACKOFF, LOWEST)
            return False
        inverse = first.dtype.type(1.0 / self.scale)
        for g, scope in zip(grads, scopes):
            with scope():
                g *= inverse
        self.clean_steps += 1
        if self.clean_steps >= self.growth_every:
            self.clean_steps = 0
            self.scale = min(self.scale * GROWTH, HIGHEST)
        return True

    # -- state

    def state_dict(self) -> dict:
        return {f"{PREFIX}/scale": numpy.float64(self.scale), f"{PREFIX}/clean_steps": numpy.int64(self.clean_steps),
                f"{PREFIX}/skipped": numpy.int64(self.skipped)}

    def prepare(self, state: dict, where: str):
        """Check the ``loss_scale/`` keys of ``state`` (``read_state``); return the function that sets them."""
        values = read_state(state, where)

        def apply():
            if values is None:  # a checkpoint without them: the initial scale
                self.scale, self.clean_steps, self.skipped = INITIAL, 0, 0
            else:
                self.scale, self.clean_steps, self.skipped = values
        return apply


def read_state(state: dict, where: str):
    """(scale, clean_steps, skipped) from ``state``'s ``loss_scale/`` keys, None when it has none; a
    ``UserError`` naming a key that is unknown, missing or bad (a scale not a power of two in [1, 2**24])."""
    mine = under(state, PREFIX)
    if not mine:
        return None
    for key in mine:
        if key not in KEYS:
            raise UserError(f"{where}: {PREFIX + '/' + key!r} is not a loss-scale key (they are "
                            f"{', '.join(PREFIX + '/' + k for k in KEYS)})")
    if "scale" not in mine:
        raise UserError(f"{where}: {PREFIX + '/scale'!r} is missing")
    a = numpy.asarray(mine["scale"])
    s = float(a) if a.shape == () and numpy.issubdtype(a.dtype, numpy.floating) else math.nan
    if not (LOWEST <= s <= HIGHEST) or math.frexp(s)[0] != 0.5:
        raise UserError(f"{where}: {PREFIX + '/scale'!r} must be a power of two in [1, 2**24], got {a.tolist()!r}")
    return s, count(state, f"{PREFIX}/clean_steps", where), count(state, f"{PREFIX}/skipped", where)
