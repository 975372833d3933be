"""What an actor adds to the ``Trainer`` it holds: the run-level parts of its state, and ``call``.

A checkpoint of several hosts is ``Trainer.state_dict()`` of host 0 (or of
the parameter server): the model, optimizer, EMA, input-position and
step-engine keys are that trainer's own (a host's trainer draws the run's
global batches, so its input position is the run's).  The checkpoint
format's metadata describes the whole run instead (every host's towers, the
run's settings, so a resume on another host or tower count says so), and is
set here.

``TrainerActor.call(method, *args)`` is how the driver reaches an actor's
``Trainer``: one generic entry instead of a forwarder per method; the actor's
own method of that name, where it has one, is called instead (it adds what
only the actor knows).
"""
from __future__ import annotations

from towers.output import checkpoint


def towers_per_update(cfg, towers_per_host: list[int]) -> int:
    """Towers behind one update: every host's (async: one host's, which each update is)."""
    return towers_per_host[0] if cfg.sync == "async" else sum(towers_per_host)


def cluster_state(state: dict, cfg, dataset, towers_per_host: list[int]) -> dict:
    """``state`` (a host's or the server's own ``Trainer.state_dict()``) with the run's metadata; what ran its
    CPU kernels stays that trainer's."""
    n = towers_per_update(cfg, towers_per_host)
    state.update(checkpoint.metadata(cfg, dataset, n, n * cfg.batch_size * cfg.accumulate, str(state["cpu_kernels"])))
    return state


class TrainerActor:
    """An actor holding a ``towers.Trainer`` (``self.trainer``); the driver calls it through ``call``."""

    trainer = None
    OWN: tuple[str, ...] = ()  # the Trainer methods this actor answers itself

    def call(self, method: str, *args):
        """``method(*args)`` of this actor when it is one of ``OWN``, else of its ``Trainer``."""
        target = self if method in self.OWN else self.trainer
        return getattr(target, method)(*args)
