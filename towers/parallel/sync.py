"""Keeping data-parallel replicas together: sync modes and the replica check.

``--sync grads`` (default), as in the TF multi-GPU example and Ray's gradient
averaging: one all-reduce of the gradient buffer per step; every replica then
applies the same update, so replicas stay bit-identical.

``--sync weights --average-every K``, as in Ray's weight averaging (local SGD):
each tower updates with its own slice's gradient; every K steps the parameter
buffers (and momentum buffers, if any) are averaged with the same all-reduce.
This sends 1/K as many all-reduces (2/K with momentum).  The EMA follows the
averaged weights: it is updated right after each average, its decay warming
up with the number of averages.  With K=1 and plain SGD this is the same
computation as grads mode up to float rounding (the mean of the updated
weights equals the weights updated with the mean gradient).

Limits: between averages the replicas differ by design, so they are compared
only right after an average; a single process that owns every device has no
true asynchronous mode (see the README's table).
"""
from __future__ import annotations

import numpy

from towers.errors import TrainingError
from towers.devices.placement import to_host

MODES = ("grads", "weights", "ps", "async")  # ps, async: several hosts (towers.cluster)


def check_replicas(replicas, step: int, atol: float = 0.0) -> None:
    """Compare every replica's parameter buffer with the first one's.

    ``atol`` 0 demands bit-identical buffers.  Fetching device buffers to the
    host is a sync point: call this only at check steps.
    """
    ref = to_host(replicas[0].params)
    for i, r in enumerate(replicas[1:], start=1):
        other = to_host(r.params)
        if atol == 0.0:
            same = numpy.array_equal(ref, other)
        else:
            same = bool(numpy.all(numpy.abs(ref - other) <= atol))
        if not same:
            diff = numpy.abs(ref.astype(numpy.float64) - other)
            j = int(numpy.nanargmax(diff)) if not numpy.isnan(diff).all() else 0
            names = [(name, off, size) for name, _, off, size in r.model.layout()]
            where = next((f"{n}[{j - off}]" for n, off, size in names if off <= j < off + size), str(j))
            raise TrainingError(
                f"replica check failed at step {step}: tower {i} differs from tower 0 "
                f"by up to {float(diff[j]):.3g} (at {where}); replicas have diverged"
            )
