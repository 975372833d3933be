"""The run-level parts of a cluster's state dict, which no single host's ``Trainer`` knows.

A checkpoint of several hosts is ``Trainer.state_dict()`` of host 0 (or of
the parameter server): the model, optimizer, EMA and step-engine keys are
that trainer's own.  Two parts describe the whole run instead, and are set
here: the checkpoint format's metadata (every host's towers, the global batch,
the run's settings, so a resume on another host or tower count says so) and,
for a host, the input position of the run's global batches (the host's own
trainer counts only its slice).
"""
from __future__ import annotations

from towers.output import checkpoint


def towers_per_update(cfg, towers_per_host: list[int]) -> int:
    """Towers behind one update: every host's (async: one host's, which each update is)."""
    return towers_per_host[0] if cfg.sync == "async" else sum(towers_per_host)


def cluster_state(state: dict, cfg, dataset, towers_per_host: list[int], position=None, step=None) -> dict:
    """``state`` with the run's metadata (and ``position.state_dict(step)`` when given)."""
    n = towers_per_update(cfg, towers_per_host)
    state.update(checkpoint.metadata(cfg, dataset, n, n * cfg.batch_size))
    if position is not None:
        state.update(position.state_dict(step))
    return state
