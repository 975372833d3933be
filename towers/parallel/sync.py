"""Keeping data-parallel replicas together: the sync modes by name, one host's keepers, the replica check.

What each ``--sync`` value does is docs/training.md's "Keeping replicas together"; the keeper interface
and how to add a mode, docs/architecture.md's "Sync modes".  A keeper is a strategy of buffers in and
buffers out: after compute the step engine (``towers.step.engine``) asks ``average(towers, part, on)``
for the gradients each tower's update applies, or None to skip the update, and calls ``step_done`` at
the end of every step.  A keeper reduces through ``Counted(reducer)`` (the run's all-reduce count,
``towers.parallel.reducers``) and never runs a tower's optimizer:

* ``GradientAveraging`` (grads mode; also a parameter server's hosts, whose towers average their
  gradients before the push): ``shared`` -- on tower threads the engine puts its barrier between
  compute and average; ``average`` makes the gradient buffers (whole, or slice ``part`` of every
  tower's by each thread) their mean and returns them; fp16's ``LossScaler`` then unscales the mean or
  skips the step (None), a decision of the averaged gradient, the same bytes on every replica; the
  scale is this keeper's state, which the next step's backward reads (``loss_scale``).  With
  ``allreduce_bucket_mib`` the average runs during backward, bucket by bucket (``bind`` plans them
  once, ``buckets`` gives each step's hooks; ``towers.parallel.overlap``), and ``average`` waits for the
  last.  CPU towers that reduce through the host's own mean share one parameter buffer
  (``same_updates``, ``towers.step.tower.build_towers``);
* ``PeriodicAveraging(every)`` (weights mode): not shared -- ``average`` returns each tower's own
  gradient, with no barrier; every ``every`` steps (``averages_at``: the engine joins the tower threads
  first) ``step_done`` averages the parameters, every optimizer slot and the model buffers, then
  updates the EMA.  It owns the averages' count (saved as ``sync/n_averages``) and the step of the last
  average, when replicas are compared.

A keeper is made by the run (``Keeping.build``), taking what it needs of the settings itself
(``period``: ``average_every``).  ``MODES`` is the one registry of the ``sync`` setting: each name is a
``Mode`` whose ``keeper`` keeps one host's towers together (None: several hosts only) and whose
``hosts`` keeps a cluster's (``towers.cluster.keeping.HostKeeping``, imported only with ``hosts`` > 1,
so one host never imports ``towers.cluster``).  The setting's check, the default checkpoint interval,
the one-host executor and the cluster's driver all look the mode up here.

Limits: between averages the replicas differ by design, so they are compared only right after an
average.
"""
from __future__ import annotations

import importlib

import numpy

from towers.arrays import to_host
from towers.errors import TrainingError, UserError
from towers.ops.precision import ALLREDUCE_DTYPES, round_to
from towers.optim.loss_scale import LossScaler
from towers.parallel.buckets import plan_buckets
from towers.parallel.overlap import Overlap
from towers.parallel.reducers import Counted
from towers.state import count


def tolerance(params) -> float:
    """The replica check's tolerance after an average: the reducer's rounding, relative to the largest weight."""
    return 1e-6 * max(1.0, float(abs(to_host(params)).max()))


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


class Keeping:
    """How replicas stay together: the strategy the step engine asks (see the module docstring).

    ``reducer`` is wrapped in ``Counted`` (``reducer.count``: the all-reduces);
    ``timer`` is the run's ``PhaseTimer``.  The defaults are those of a keeper
    whose replicas always agree and that saves no averages.
    """

    #: whether a tower's update needs every tower's gradients (a barrier after compute)
    shared = True
    #: whether every replica applies the same update to the same weights at every step, so that CPU
    #: towers may share one parameter buffer, updated once (``towers.step.tower.build_towers``)
    same_updates = False
    #: whether the EMA follows every update, fused into the first tower's optimizer step (else the keeper
    #: updates it itself)
    fuses_ema = False
    #: the settings this keeper reads, each with the value that means "not used" (any other value given
    #: to another mode's run is refused: ``Mode.check``)
    settings: dict = {}
    #: whether tower threads may each reduce and update a slice of the buffers (else tower 0's thread does
    #: whole buffers: a decision over the whole gradient, fp16's finite check, needs them whole)
    splits = True
    #: what the loss's gradient is multiplied by at the next step (fp16's loss scale; 1: none)
    loss_scale = 1.0

    def __init__(self, reducer, timer):
        self.reducer, self.timer = Counted(reducer), timer

    @classmethod
    def build(cls, reducer, timer, ema, cfg) -> "Keeping":
        """The keeper of a run with settings ``cfg`` over ``reducer``, its ``timer`` and its ``ema``."""
        return cls(reducer, timer)

    @classmethod
    def period(cls, cfg) -> int:
        """Steps between the moments the replicas agree (checkpoints fall on them): 1, every step."""
        return 1

    def bind(self, towers: list, threads: bool) -> None:
        """The step engine's ``towers`` (on threads when ``threads``), once, before its first step."""

    def buckets(self):
        """A new step's ``towers.parallel.overlap.BucketedStep`` (its towers' backward hooks), or None: the
        gradients are not averaged while backward runs."""
        return None

    def close(self) -> None:
        """Stop what ``bind`` started (idempotent)."""

    def average(self, towers: list, part: slice | None, on: int, buckets=None) -> list | None:
        """Phase 3 of a step, after compute: the gradient buffers the engine's update applies, one per tower of
        ``towers`` in order, or None to skip the update.  ``towers``: all of them when ``shared`` (with ``part``
        a slice of their flat buffers, or None: whole), else the worker's own (whole buffers); ``on``: the
        worker, whose timer the reducer runs on; ``buckets``: the step's ``buckets()``, whose hooks the towers'
        backward was given (None when it gave none).  A keeper reduces buffers and decides; it does not update."""
        raise NotImplementedError  # pragma: no cover - interface

    def averages_at(self, step: int) -> bool:
        """Whether ``step_done`` at ``step`` reads the towers' buffers (the engine joins the tower threads first)."""
        return False

    def step_done(self, towers: list, step: int) -> None:
        """The step count became ``step`` (the tower threads joined when ``averages_at(step)``)."""

    def finish(self, towers: list, step: int) -> None:
        """End of training at ``step`` (the tower threads joined)."""

    def agreed(self, step: int) -> None:
        """The replicas were just set to one value at ``step`` (a load, ``set_weights``)."""

    def comparable(self, step: int) -> bool:
        """Whether replicas are meant to agree now (the engine then compares them)."""
        return True

    @classmethod
    def atol(cls, params) -> float:
        """The replica check's tolerance (0: bit-identical), given the first replica's weights ``params``
        (host or device; after a host sync point).  A cluster's hosts are checked with their keeper's."""
        return 0.0

    def state_dict(self) -> dict:
        # Every mode writes the key, so a checkpoint's keys do not depend on `sync`.
        return averages_state(0)

    def prepare(self, state: dict, where: str):
        """Check ``sync/n_averages``; return the function of the loaded step that sets this keeper."""
        n = read_averages(state, where)
        return lambda step: self._loaded(step, n)

    def _loaded(self, step: int, n_averages: int) -> None:
        pass

    def _mean(self, buffers: list, on: int = 0, part: slice | None = None) -> None:
        """The reducer over ``buffers``, timed on worker ``on`` and counted."""
        if self.reducer.noop:
            return
        with self.timer("all-reduce", on):
            self.reducer.average(buffers, part)


class GradientAveraging(Keeping):
    """Grads mode: ``average`` returns the gradients' mean, which every replica's update applies.

    ``bucket_mib`` > 0 (``allreduce_bucket_mib``): the gradients are averaged
    in buckets of about that many MiB while the towers' backward runs
    (``towers.parallel.overlap``, ``bind``), not after compute; the update
    waits for the last bucket.  Rounding and counting are the same per range.

    ``allreduce_dtype`` bf16: each tower's gradient (or its slice) is rounded
    to bfloat16 (``towers.ops.precision``) before the reducer averages it;
    the mean itself stays float32, so every replica holds the float32 mean of
    the rounded gradients, the same bytes everywhere.  ``scaler`` (fp16's
    ``towers.optim.loss_scale.LossScaler``): after the all-reduce it unscales
    the averaged gradients and decides whether the step updates; a skipped
    step (``average`` returns None) runs no optimizer update and so no EMA
    update (fused into it).  Its decision needs the whole gradient, so with
    it tower threads do not split the update (``splits``), and its state is
    saved under ``loss_scale/``.
    """

    same_updates = True
    fuses_ema = True
    settings = {"allreduce_bucket_mib": 0.0}

    def __init__(self, reducer, timer, allreduce_dtype: str = "fp32", scaler=None, bucket_mib: float = 0.0):
        super().__init__(reducer, timer)
        if allreduce_dtype not in ALLREDUCE_DTYPES:
            raise ValueError(f"allreduce_dtype {allreduce_dtype!r}: use one of {', '.join(ALLREDUCE_DTYPES)}")
        self.allreduce_dtype, self.scaler = allreduce_dtype, scaler
        self.splits = scaler is None
        self.bucket_mib = bucket_mib
        self.overlap = None  # the buckets, once bound to towers

    @classmethod
    def build(cls, reducer, timer, ema, cfg) -> "GradientAveraging":
        scaler = LossScaler(cfg.loss_scale_growth) if cfg.precision == "fp16" else None
        return cls(reducer, timer, cfg.allreduce_dtype, scaler, cfg.allreduce_bucket_mib)

    def bind(self, towers, threads) -> None:
        """The buckets of ``towers``' model, planned once (``towers.parallel.buckets``); none for one tower."""
        if not self.bucket_mib or self.reducer.noop:
            return
        if threads and any(t.stream is not None for t in towers):
            raise UserError("`allreduce_bucket_mib` with `sync_bn` on GPUs: sync-BN runs the towers on threads "
                            "whose statistics and buckets would share the NCCL communicators; drop one of them")
        replica = towers[0].replica
        plan = plan_buckets(replica.model.layer_spans(), self.bucket_mib * 2 ** 20, replica.dtype.itemsize)
        self.overlap = Overlap(plan, towers, self.reducer, self._average)

    def buckets(self):
        return None if self.overlap is None else self.overlap.step()

    def close(self) -> None:
        if self.overlap is not None:
            self.overlap.close()

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.scale

    def average(self, towers, part=None, on=0, buckets=None) -> list | None:
        """Every tower's gradient buffer (or its slice ``part``) made the mean over all towers (of the gradients
        rounded to ``allreduce_dtype``, each on its tower's device and stream), returned; with ``buckets`` the
        means were issued during backward and are waited for here.  fp16: the mean unscaled, or None when it
        is not finite (the step is skipped: no update, so no EMA)."""
        grads = [t.replica.grads if part is None else t.replica.grads[part] for t in towers]
        if buckets is None:
            self._average(grads, [t.scope for t in towers], self.reducer, on, part)
        else:
            buckets.finish()  # averaged bucket by bucket during the towers' backward
        if self.scaler is None:
            return grads
        # The averaged gradient decides, the same on every replica (part is None: ``splits``); a tower that
        # shares another's buffer has nothing of its own to unscale.
        own = [(g, t.scope) for t, g in zip(towers, grads) if not t.shares_params]
        return grads if self.scaler.unscale([g for g, _ in own], [scope for _, scope in own]) else None

    def _average(self, buffers: list, scopes: list, reducer, on: int, part: slice | None = None) -> None:
        """``buffers`` (one per tower) rounded to ``allreduce_dtype``, each in its tower's ``scopes[i]()``, then
        averaged through ``reducer`` (the keeper's, or its view on other streams), timed on worker ``on``."""
        if reducer.noop:  # one tower alone has no all-reduce
            return
        if self.allreduce_dtype != "fp32":
            for scope, g in zip(scopes, buffers):
                with scope():
                    round_to(g, self.allreduce_dtype)
        with self.timer("all-reduce", on):
            reducer.average(buffers, part)

    def state_dict(self) -> dict:
        return {**super().state_dict(), **(self.scaler.state_dict() if self.scaler is not None else {})}

    def prepare(self, state: dict, where: str):
        set_averages = super().prepare(state, where)
        # Checked whatever the run: a checkpoint's keys of another precision are allowed, not wrong ones.
        set_scale = (self.scaler or LossScaler()).prepare(state, where)

        def apply(step):
            set_averages(step)
            set_scale()
        return apply


class PeriodicAveraging(Keeping):
    """Weights mode: each tower updates alone; every ``every`` steps average, then the EMA follows."""

    shared = False
    settings = {"average_every": 1}

    def __init__(self, reducer, timer, ema, every: int):
        super().__init__(reducer, timer)
        self.ema, self.every = ema, every
        self.n_averages = 0  # weight averages so far: the EMA's count
        self.last_average = None  # step count right after the last average

    @classmethod
    def build(cls, reducer, timer, ema, cfg) -> "PeriodicAveraging":
        return cls(reducer, timer, ema, cfg.average_every)

    @classmethod
    def period(cls, cfg) -> int:
        return cfg.average_every

    def average(self, towers, part, on, buckets=None) -> list:
        """Each tower's own gradient, unaveraged: the replicas meet in ``step_done``."""
        return [t.replica.grads for t in towers]

    def averages_at(self, step: int) -> bool:
        return step % self.every == 0

    def step_done(self, towers, step) -> None:
        if self.averages_at(step):
            self.average_weights(towers, step)

    def average_weights(self, towers: list, step: int) -> None:
        """Average parameters, optimizer state and model buffers over the towers, then update the EMA (the
        tower threads' updates complete: the engine joined them)."""
        reps = [t.replica for t in towers]
        self._mean([r.params for r in reps])
        for slot in towers[0].optimizer.state:
            self._mean([t.optimizer.state[slot] for t in towers])
        if reps[0].buffers.size:
            self._mean([r.buffers for r in reps])
        self.n_averages += 1
        with towers[0].scope():
            self.ema.update(reps[0].params, self.n_averages)  # this average included, as TF counts
        self.last_average = step

    def finish(self, towers, step) -> None:
        """A last average if steps were taken since."""
        if self.last_average != step:
            self.average_weights(towers, step)

    def agreed(self, step: int) -> None:
        self.last_average = step

    def comparable(self, step: int) -> bool:
        return self.last_average == step  # between averages replicas differ by design

    @classmethod
    def atol(cls, params) -> float:
        # An average leaves them equal up to the reducer's rounding.
        return tolerance(params)

    def state_dict(self) -> dict:
        return averages_state(self.n_averages)

    def _loaded(self, step: int, n_averages: int) -> None:
        # Checkpoints are taken right after an average.
        self.n_averages, self.last_average = n_averages, step


def averages_state(n_averages: int) -> dict:
    """The keeper's key of a state dict: ``sync/n_averages``, the weight averages so far (0 but in weights mode)."""
    return {"sync/n_averages": numpy.int64(n_averages)}


def read_averages(state: dict, where: str) -> int:
    """``sync/n_averages`` of a state dict, checked (0 when absent: checkpoints written before the key)."""
    return count(state, "sync/n_averages", where) if "sync/n_averages" in state else 0


class Mode:
    """One value of the ``sync`` setting (see the module docstring).

    ``keeper``: the ``Keeping`` class of one host's towers (None: the mode
    needs several hosts; ``several`` then says why, in its refusal).
    ``hosts``: the ``towers.cluster.keeping.HostKeeping`` class of a cluster
    run, or its ``"module:Class"`` name (imported only when a cluster asks:
    ``host_keeping``).
    """

    def __init__(self, hosts, keeper: type[Keeping] | None = None, several: str = ""):
        self.hosts, self.keeper, self.several = hosts, keeper, several

    def host_keeping(self):
        """The cluster's ``HostKeeping`` class of this mode."""
        if not isinstance(self.hosts, str):
            return self.hosts
        module, _, name = self.hosts.partition(":")
        return getattr(importlib.import_module(module), name)

    def period(self, cfg) -> int:
        """Steps between the moments every replica agrees (a checkpoint holds such weights)."""
        return (self.keeper or Keeping).period(cfg)

    def check(self, name: str, cfg) -> None:
        """The rules between this mode and the other settings of ``cfg`` (a ``UserError`` naming them)."""
        if cfg.hosts == 1 and self.keeper is None:
            raise UserError(f"`sync` {name} {self.several}: set `hosts` 2 or more")
        mine = (self.keeper or Keeping).settings
        for other, mode in MODES.items():
            for setting, unused in (mode.keeper or Keeping).settings.items():
                if setting not in mine and getattr(cfg, setting) != unused:
                    raise UserError(f"`{setting}` applies to `sync` {other}; set `sync` {other} or drop it")


#: The sync modes by the ``sync`` setting's value (the one registry; see the module docstring).
MODES: dict[str, Mode] = {
    "grads": Mode("towers.cluster.keeping:AllReduce", GradientAveraging),
    "weights": Mode("towers.cluster.keeping:AllReduce", PeriodicAveraging),
    "ps": Mode("towers.cluster.ps:SynchronousServer", several="is a parameter server for several hosts"),
    "async": Mode("towers.cluster.ps:AsynchronousServer", several="is a parameter server for several hosts"),
}
