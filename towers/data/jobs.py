"""Jobs: what an input worker runs for a chunk of rows, the per-example operations bound to their source.

A job is what the worker pool (``towers.data.workers``) registers and
runs: ``make(refs, epochs, indices, out)`` writes the rows ``refs`` (what
``refs(rows)`` picked to travel) into ``out`` and returns the ``(k,
message)`` of those that cannot be made; ``shape`` and ``dtype`` are one
row's; ``draws``: whether its rows draw random numbers (else their epochs
are not sent).  Two kinds, chosen once by the loader (``towers.data.loading``):

- :class:`Gather`: the source makes the whole chunk at once
  (``source.read_rows``): raw TFRecord examples, gathered and parsed a batch
  at a time; decoded images gathered from their cache (which returns the
  rows that failed).  No per-example operation runs.
- :class:`Transformed`: each example read (``source.read``) and turned into
  the towers' array by a ``towers.data.image.augment.Transform`` (decode,
  augment, normalize).  With ``epochs`` (training) each example draws its
  randomness from (seed, epoch, index), so the result does not depend on
  which worker makes it; without, it takes the deterministic path.

A job is small and picklable (its source's paths and positions, the
transform's settings): it travels to each worker once.
"""
from __future__ import annotations

import numpy as np

from towers.data.image.augment import uniforms
from towers.data.image.codec import ImageError
from towers.data.sources import SourceError


class Gather:
    """Rows the source makes a chunk at a time (``read_rows``), as they are stored."""

    draws = False  # nothing random: the rows' epochs need not travel

    def __init__(self, source):
        self.source = source
        self.shape, self.dtype = tuple(source.example_shape), np.dtype(source.dtype)

    def refs(self, rows):
        return self.source.refs(rows)

    def make(self, refs, epochs, indices, out) -> list[tuple[int, str]]:
        return self.source.read_rows(refs, out) or []

    def close(self) -> None:
        self.source.close()


class Transformed:
    """Each row read from ``source`` and made by ``transform`` (its ``shape``/``dtype`` are the rows')."""

    def __init__(self, source, transform):
        self.source, self.transform = source, transform
        self.shape, self.dtype = tuple(transform.shape), np.dtype(transform.dtype)
        self.draws = bool(transform.draws)  # training draws: each row's epoch travels with its chunk

    def refs(self, rows):
        return self.source.refs(rows)

    def make(self, refs, epochs, indices, out) -> list[tuple[int, str]]:
        """``out[k]`` = the transformed example of ``refs[k]``; (k, message) of those that cannot be made.

        ``epochs`` None: the deterministic (evaluation) path; else each example
        draws its randomness from (seed, epoch, index).
        """
        transform = self.transform
        u = None
        if epochs is not None and transform.draws:
            u = uniforms(transform.seed, epochs, indices, transform.draws)
        failed = []
        for k, ref in enumerate(refs):
            try:
                out[k] = transform(self.source.read(ref), None if u is None else u[k])
            except ImageError as e:
                failed.append((k, self.undecodable(ref, e)))
            except SourceError as e:
                failed.append((k, str(e)))
        return failed

    def undecodable(self, ref, error) -> str:
        """The message of a row whose image does not decode."""
        return f"{self.source.where(ref)}: not a decodable image: {error}"

    def close(self) -> None:
        self.source.close()
