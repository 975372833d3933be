"""Gradient buckets: the flat gradient buffer cut, at layer boundaries, into the pieces averaged one by one.

Backward walks the layers from the last to the first, so the gradients of
the last layers are final first.  ``plan_buckets`` groups the layers, from
the last one backward, into buckets of about ``bucket_bytes``: a bucket takes
layers until its gradients reach that size, then the next one starts (a
layer is never split, so a bucket smaller than a layer holds that one layer;
layers without parameters join the bucket being filled).  Bucket 0 holds the
last layers and is averaged first; the last bucket holds the first layer.

A bucket's gradients are the ranges of the flat buffer its layers' parameters
fill (``Sequential.layer_spans``), merged where adjacent: two ranges in
general, because the buffer holds the regularized parameters (weights) of
every layer first, then the others (biases), each part in layer order; one
range when the bucket holds every layer.  So the buckets together cover the
buffer once, and a plan with one bucket is the whole buffer, one range.

The plan is made once, when the step engine is built, from the model's
layout; it holds no state of a step (``towers.parallel.overlap`` issues the
buckets while backward runs).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    """Bucket ``index`` (0 is averaged first): its lowest layer with parameters ``first_layer``, and the
    (start, stop) ``ranges`` of the flat gradient buffer it holds, in buffer order."""

    index: int
    first_layer: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        """Its gradients, in elements."""
        return sum(hi - lo for lo, hi in self.ranges)


def plan_buckets(spans: list[list[tuple[int, int]]], bucket_bytes: float, itemsize: int = 4) -> list[Bucket]:
    """The buckets of a model whose layer i fills ``spans[i]`` of the flat buffer (module doc).

    ``bucket_bytes`` > 0: the size a bucket is closed at, in bytes of ``itemsize``-byte elements.
    """
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes!r}")
    groups: list[list[int]] = []  # each bucket's layers with parameters, last layer first
    filled = 0
    for layer in range(len(spans) - 1, -1, -1):
        size = sum(hi - lo for lo, hi in spans[layer])
        if not size:
            continue
        if not groups or filled * itemsize >= bucket_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(layer)
        filled += size
    return [Bucket(b, min(layers), _merged([r for layer in layers for r in spans[layer]]))
            for b, layers in enumerate(groups)]


def _merged(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``ranges`` sorted, adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)
