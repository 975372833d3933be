"""The learning-rate schedule: TensorFlow's ``exponential_decay``, counted in examples.

``lr = lr0 * decay_rate ** (examples_seen / examples_per_epoch)``; ``staircase``
floors the exponent.  Counting examples rather than steps makes N towers x B
follow the same schedule as 1 tower x N*B.
"""
from __future__ import annotations

import math


def learning_rate(lr0: float, decay_rate: float, examples_seen: int, examples_per_epoch: int,
                  staircase: bool = False) -> float:
    """TF ``exponential_decay`` with ``decay_steps`` counted in examples (one epoch)."""
    exponent = examples_seen / examples_per_epoch
    if staircase:
        exponent = math.floor(exponent)
    return lr0 * decay_rate ** exponent
