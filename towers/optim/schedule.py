"""Learning-rate schedules: exponential decay (counted in examples), piecewise constant, cosine, linear warm-up.

``make_schedule(cfg, n_examples, examples_per_step)`` returns ``lr(step)``,
the learning rate of the step after ``step`` updates, a pure function of the
step (so a resumed run continues the schedule exactly):

* ``exponential`` (the default; TensorFlow's ``exponential_decay``):
  ``lr0 * decay_rate ** (examples_seen / examples_per_epoch)``, ``staircase``
  floors the exponent.  Counting examples rather than steps makes N towers x B
  follow the same schedule as 1 tower x N*B.  ``decay_steps`` N counts steps
  instead, as TF's ``decay_steps`` does: ``lr0 * decay_rate ** (step / N)``;
* ``piecewise`` (TensorFlow's ``piecewise_constant``; He et al.'s ResNet
  recipe): ``values[i]`` from ``boundaries[i - 1]`` (inclusive) to
  ``boundaries[i]`` (exclusive), in steps; without ``lr_values``, ``lr`` divided
  by 10 at each boundary.  The boundaries are ``lr_boundaries`` (steps) or
  ``lr_epochs`` (epochs: boundary ``ceil(e * examples_per_epoch /
  examples_per_step)``, so a recipe holds for any data size and tower count);
* ``cosine`` (Loshchilov and Hutter, without restarts): ``lr0 * (1 + cos(pi *
  step / steps)) / 2``, from ``lr0`` to 0 at ``steps``;
* ``warmup_steps`` W > 0 multiplies any of them by ``(step + 1) / W`` while
  ``step < W`` (Goyal et al.'s linear warm-up); ``warmup_epochs`` E gives W =
  ``ceil(E * examples_per_epoch / examples_per_step)``.
"""
from __future__ import annotations

import math
from typing import Callable

from towers.errors import UserError

SCHEDULES = ("exponential", "piecewise", "cosine")


def learning_rate(lr0: float, decay_rate: float, seen: int, per_decay: int, staircase: bool = False) -> float:
    """TF ``exponential_decay``: ``lr0 * decay_rate ** (seen / per_decay)``, counted in examples (``per_decay``
    one epoch's) or in steps (``per_decay`` the ``decay_steps``)."""
    exponent = seen / per_decay
    if staircase:
        exponent = math.floor(exponent)
    return lr0 * decay_rate ** exponent


def parse_list(text, name: str, kind=float) -> list:
    """``"32000,48000"`` -> [32000, 48000]; None -> []; anything else is a UserError naming ``name``."""
    if text is None:
        return []
    try:
        values = [kind(v) for v in str(text).split(",")]
    except ValueError:
        raise UserError(f"`{name}` must be comma-separated {kind.__name__}s, got {text!r}") from None
    if not all(math.isfinite(v) for v in values):
        raise UserError(f"`{name}` must hold finite numbers, got {text!r}")
    return values


def steps_of(epochs: float, n_examples: int, examples_per_step: int) -> int:
    """The steps ``epochs`` epochs of ``n_examples`` take at ``examples_per_step``, rounded up."""
    return math.ceil(epochs * n_examples / examples_per_step - 1e-9)


def piecewise_values(cfg, n_examples: int | None = None, examples_per_step: int | None = None
                     ) -> tuple[list, list[float]]:
    """(boundaries, values) of a piecewise schedule, checked: increasing positive boundaries, one more value.

    The boundaries are steps: ``lr_boundaries``, or ``lr_epochs`` turned into steps with ``n_examples`` and
    ``examples_per_step``; without those two (a check before the data is known) ``lr_epochs`` as epochs."""
    if cfg.lr_epochs:
        epochs = parse_list(cfg.lr_epochs, "lr_epochs")
        if epochs[0] <= 0 or any(b <= a for a, b in zip(epochs, epochs[1:])):
            raise UserError(f"`lr_epochs` must be increasing epochs > 0, got {cfg.lr_epochs!r}")
        bounds = epochs if n_examples is None else [steps_of(e, n_examples, examples_per_step) for e in epochs]
    else:
        bounds = parse_list(cfg.lr_boundaries, "lr_boundaries", int)
        if not bounds:
            raise UserError("`lr_schedule` piecewise needs `lr_boundaries` (steps, e.g. 32000,48000) or `lr_epochs`")
        if bounds[0] < 1 or any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise UserError(f"`lr_boundaries` must be increasing steps >= 1, got {cfg.lr_boundaries!r}")
    values = parse_list(cfg.lr_values, "lr_values") or [cfg.lr * 0.1 ** i for i in range(len(bounds) + 1)]
    if len(values) != len(bounds) + 1 or min(values) <= 0:
        raise UserError(f"`lr_values` must be {len(bounds) + 1} numbers > 0 (one more than `lr_boundaries`), "
                        f"got {cfg.lr_values!r}")
    return bounds, values


def make_schedule(cfg, n_examples: int, examples_per_step: int) -> Callable[[int], float]:
    """``lr(step)`` for ``cfg`` (a resolved ``towers.Config``): see the module doc."""
    kind = cfg.lr_schedule or ("piecewise" if cfg.lr_boundaries or cfg.lr_epochs else "exponential")
    if kind == "exponential":
        def base(step):
            if cfg.decay_steps:
                return learning_rate(cfg.lr, cfg.lr_decay, step, cfg.decay_steps, cfg.staircase)
            return learning_rate(cfg.lr, cfg.lr_decay, step * examples_per_step, n_examples, cfg.staircase)
    elif kind == "piecewise":
        bounds, values = piecewise_values(cfg, n_examples, examples_per_step)

        def base(step):
            return values[sum(step >= b for b in bounds)]
    elif kind == "cosine":
        lr0, total = cfg.lr, cfg.steps

        def base(step):
            return lr0 * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    else:
        raise UserError(f"`lr_schedule` {kind!r} is unknown: use one of {', '.join(SCHEDULES)}")
    warmup = cfg.warmup_steps
    if cfg.warmup_epochs:
        warmup = steps_of(cfg.warmup_epochs, n_examples, examples_per_step)
    if not warmup:
        return base  # exactly today's exponential decay when nothing new is set

    def warmed(step):
        return base(step) * min(1.0, (step + 1) / warmup)
    return warmed
