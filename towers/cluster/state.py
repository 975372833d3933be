"""A cluster's state dict, and ``call``: how the driver asks an actor the ``Executor`` protocol's questions.

A checkpoint of several hosts is the state dict of whoever holds the run's
state (host 0's ``LocalExecutor``, or the parameter server): the model,
optimizer, EMA, input-position, step and keeper keys are its own (a host
draws the run's global batches, so its input position is the run's).  The
checkpoint format's metadata describes the whole run instead (every host's
towers, the run's settings, so a resume on another host or tower count says
so); the driver sets it (``cluster_state``), from its own copy of the data.

``Answering.call(method, *args)`` is the driver's way into an actor: one
generic entry instead of a forwarder per method, answered by the actor's
``answers`` (a host's executor, or the parameter server itself).
"""
from __future__ import annotations

from towers.output import checkpoint


def cluster_state(state: dict, cfg, dataset, n_towers: int) -> dict:
    """``state`` (an actor's own) with the run's metadata, in the checkpoint format's order: ``n_towers`` behind
    an update, the run's settings and data; what ran its CPU kernels stays the actor's."""
    kernels = str(state["cpu_kernels"])
    state = {k: v for k, v in state.items() if k not in checkpoint.META}
    state.update(checkpoint.metadata(cfg, dataset, n_towers, n_towers * cfg.batch_size * cfg.accumulate, kernels))
    return state


class Answering:
    """An actor that answers the driver's ``Executor`` questions through ``call``."""

    answers = None  # whose methods ``call`` runs

    def call(self, method: str, *args):
        """``method(*args)`` of ``answers``."""
        return getattr(self.answers, method)(*args)
