"""What a ``Trainer`` asks of whoever runs its steps: the ``Executor`` protocol, written once.

``towers.Trainer`` is the public API (``fit``, ``train_step``, weights,
state, evaluation, the learning rate).  It owns the settings, the data set
as loaded in this process and the model's description, and checks what a
user passes in; everything that depends on where the towers are is asked of
its executor, one of two:

* ``towers.run.local.LocalExecutor``: this process's towers (``Tower``, the
  ``StepEngine``, the reducer, the EMA) and its input (the seeded global
  batches and the input position); one host;
* ``towers.cluster.driver.ClusterExecutor``: host actors on Ray, each
  running a ``LocalExecutor`` that takes its share of every global batch, and
  the sync mode's ``HostKeeping`` (``towers.cluster.keeping``; with ``sync``
  ps or async, a parameter server too); the driver starts them, runs segments
  of steps on them and gathers their state.

A host actor and a parameter server answer the driver through this same
protocol: a host is asked its ``LocalExecutor``'s methods, a parameter
server answers the state, weight and evaluation ones for the weights it
holds; a parameter server's hosts step through ``next_gradients`` and
``set_flat``, nothing reached around the protocol.

The loop (``towers.run.loop.fit``) drives either the same way: it asks the
extensions (``towers.run.extensions.Run``) where the next log line, checkpoint,
summary, replica check or user extension is due, runs the steps up to there
with ``run_steps`` (a segment), then calls the extensions due.  The
learning-rate schedule is each executor's ``schedule``, made by
``towers.optim.schedule.make_schedule`` from ``examples_per_step``.

Sync points: ``run_steps`` returns when the segment's steps are issued
(local) or done (cluster); ``get_weights``, ``get_gradients``,
``state_dict``, ``evaluate``, ``predict`` and ``check_replicas`` wait for the towers.
"""
from __future__ import annotations

import abc
import contextlib
from typing import Callable

from towers.errors import UserError


class Executor(abc.ABC):
    """Runs a ``Trainer``'s steps and holds its replicas (see the module docstring).

    Values crossing this interface are host values: NumPy arrays, dicts of
    name -> array, Python numbers (losses may be device scalars locally).
    Arguments are already checked by the ``Trainer`` against the data set.
    """

    cfg: object  # the run's resolved ``towers.Config``
    schedule: Callable[[int], float]  # lr(step): the learning rate of the step after ``step`` updates
    #: what ran the CPU towers' fused kernels, ``numba`` or ``numpy`` (a checkpoint records it); None: not
    #: decided here (a cluster's hosts each decide)
    cpu_kernels: str | None = None
    #: BLAS threads this process's CPU towers run (None: none set here: GPU towers, a cluster's driver)
    blas_threads: int | None = None

    # -- sizes and counters ------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def step(self) -> int:
        """Updates done so far."""

    @property
    @abc.abstractmethod
    def n_towers(self) -> int:
        """Towers behind one update (every host's; one host's with async)."""

    @property
    def examples_per_step(self) -> int:
        """Examples behind one update, which the schedule counts."""
        return self.n_towers * self.cfg.batch_size * self.cfg.accumulate

    @property
    def running_towers(self) -> int:
        """Towers that run steps, for the summary line: ``n_towers``, but every host's where an update is one
        host's (async)."""
        return self.n_towers

    @property
    @abc.abstractmethod
    def all_reduces(self) -> int:
        """Collectives issued so far."""

    def communication(self) -> tuple[int, str]:
        """(count so far, what it counts per step) for the communication figure of the summary line: the
        collectives, ``all-reduces/step``, unless the run communicates otherwise (a parameter server)."""
        return self.all_reduces, "all-reduces/step"

    @abc.abstractmethod
    def towers_text(self) -> str:
        """Where the towers run, for the summary line."""

    @abc.abstractmethod
    def placement_text(self) -> str:
        """The placement, as ``log_placement`` prints it."""

    @property
    @abc.abstractmethod
    def source(self):
        """The run's global batches (a ``towers.data.batches.BatchSource``): this process's cursor over them, or
        on a cluster the run's global batches from the first, drawn in the driver."""

    # -- steps -------------------------------------------------------------------------------

    def prefetching(self, last_step: int):
        """A context in which ``run_steps`` takes its batches from a background thread, up to ``last_step``."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def run_steps(self, n: int, want_loss: bool = False) -> tuple[list | None, object]:
        """``n`` steps on the run's own batches: (the last step's losses when asked, its host examples or None).

        At step ``cfg.steps`` it also ends training (``finish``).
        """

    @abc.abstractmethod
    def train_step(self, x, y, want_loss: bool = False):
        """One step on the given global batch (checked); the towers' losses when asked."""

    def train_step_at(self, indices, want_loss: bool = False):
        """One step on the training-set rows ``indices`` (checked here); the towers' losses when asked."""
        raise UserError("train_step_at takes row numbers of one host's training set: on a cluster give the "
                        "examples to train_step(x, y)")

    def next_gradients(self, want_loss: bool = False):
        """Phases 1-3 on the run's next batch, without an update (a parameter server applies it).

        Returns (the towers' losses when asked, else None; their mean
        gradient, a host flat array valid until the next step; their mean
        model buffers, a host flat copy).  A host sync point.
        """
        raise NotImplementedError(f"{type(self).__name__} does not serve a parameter server")

    def set_flat(self, weights, buffers=None) -> None:
        """Every replica's weights (and buffers; None: left as they are) from host flat arrays in the model's
        layout, unchecked: the weights a parameter server published.  Queued before the next step."""
        raise NotImplementedError(f"{type(self).__name__} does not serve a parameter server")

    @abc.abstractmethod
    def finish(self) -> None:
        """End of training: in weights mode, a last average if steps were taken since."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Host sync point: what was issued is done."""

    @abc.abstractmethod
    def check_replicas(self) -> bool:
        """Compare replicas now if they are meant to agree (a ``TrainingError`` if not); whether it ran."""

    # -- weights, state, evaluation ----------------------------------------------------------

    @abc.abstractmethod
    def get_weights(self, ema: bool = False) -> dict:
        """{name: float32 host copy}: weights (or the EMA's), then the model's buffers."""

    @abc.abstractmethod
    def set_weights(self, weights: dict, ema: bool = False) -> None:
        """Every replica's weights (checked strictly, as ``Trainer.set_weights`` says)."""

    @abc.abstractmethod
    def get_gradients(self) -> dict:
        """{name: float32 host copy} of the last update's mean gradient."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Everything a checkpoint holds (``towers.state`` lists the keys), with the format's metadata."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict, where: str) -> None:
        """Restore ``state_dict()`` output, strictly: a bad key is a ``UserError`` and nothing changes."""

    @abc.abstractmethod
    def evaluate(self, ema: bool, x, y, progress=None) -> dict:
        """{"loss", "accuracy"} on ``x``, ``y`` (checked), EMA or raw weights; ``progress(k)``: called as ``k``
        more examples are done (a progress bar's ``update``)."""

    @abc.abstractmethod
    def predict(self, ema: bool, x, batch: int):
        """The logits of ``x`` (checked) as a host float32 array, EMA or raw weights, in chunks of ``batch``."""

    def train_accuracy(self) -> float | None:
        """The accuracy on the examples of the last step whose losses were asked for, from that step's forward
        (``Replica.mean_loss_and_grads``' count); None where it was not counted (CUDA graphs)."""
        return None

    def loss_scaling(self) -> dict:
        """fp16's dynamic loss scaling so far: ``{"loss_scale": S, "skipped_steps": n}`` (n: the steps skipped
        for an inf or NaN gradient, over the whole run, resumes included); {} without loss scaling."""
        return {}

    def report(self, global_batch: int) -> str:
        """The phase timer's report (``profile``)."""
        return ""

    def results(self) -> dict:
        """Figures of this executor added to ``fit``'s result (async: the gradient staleness)."""
        return {}

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the executor started (idempotent)."""
