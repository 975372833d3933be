"""``ClusterTrainer``: the driver of a run over several hosts (``hosts`` > 1).

The driver is the command itself.  It starts (or joins) Ray, starts one host
actor per host (``towers.cluster.hosts``), and runs ``Trainer.fit``'s loop
unchanged: the same batches, log lines, progress bar, ``metrics.jsonl``,
TensorBoard and checkpoints as one host.  For that it is a ``Trainer`` whose
single CPU replica is a *mirror*: it never trains; ``synchronize`` copies the
state of host 0 (or of the parameter server) into it, so checkpoints,
summaries and evaluation read it as they read one host's.

Each step the driver draws one global batch of ``hosts x towers x batch_size``
examples, split in host order then tower order (so 2 hosts x 1 tower see the
examples 1 host x 2 towers see), and sends each host its slice:

* grads, weights: every host runs ``train_step``; the cross-host mean happens
  inside (NCCL across hosts on GPUs, ``towers.cluster.reduce`` on CPUs);
* ps: hosts return their mean gradients, the parameter server applies their
  weighted mean once, hosts pull the new weights (the driver passes only
  ObjectRefs: gradients and weights go host <-> server directly);
* async: each host gets the server's newest weights and its own next batch
  (``towers x batch_size`` examples, one update's worth); the server applies
  each gradient as it arrives; ``steps`` counts applied updates.

Sync points: the driver waits for a step's results one step later (or at once
when the loss is wanted), so it queues step k+1 while the hosts finish step k.
A host actor that dies raises ``ActorDiedError`` on its results; the driver
stops the run with one line naming the host (``TrainingError``, exit 1).
"""
from __future__ import annotations

import dataclasses
import sys

import numpy

from towers.cluster import session
from towers.cluster.hosts import Host
from towers.cluster.ps import ParameterServer
from towers.cluster.reduce import Exchange
from towers.config import Config
from towers.data.loading import load_dataset
from towers.data.tfrecord.records import close_dataset
from towers.devices.cpu_threads import input_workers
from towers.devices.placement import CPU, Placement
from towers.errors import TrainingError, UserError
from towers.parallel.allreduce import world_layout
from towers.trainer import Trainer


class ClusterTrainer(Trainer):
    """A Trainer over ``cfg.hosts`` host actors (see the module docstring).

    ``nccl``: a module standing in for ``cupy.cuda.nccl`` in the host actors
    (passed by its import name; tests use ``tests.nccl_standin``).
    """

    def __init__(self, cfg: Config | None = None, *, model=None, dataset=None, nccl=None):
        self._ray = self._hosts = self._ps = self._exchange = None
        self._owned, self._dead, self._pending, self._pulled = False, False, [], None
        self._stale = [0, 0, 0]  # updates, sum and max of their staleness (async)
        cfg = (cfg if cfg is not None else Config()).resolved(model)
        if cfg.hosts < 2:
            raise UserError("ClusterTrainer is for `hosts` 2 or more; use towers.Trainer for one host")
        owned = None
        if dataset is None:  # every error a file can cause, before Ray starts
            dataset = owned = load_dataset(cfg.data, cfg.x_key, cfg.y_key, cfg.test_data, decode=cfg.decode,
                                           on_error=cfg.on_error, workers=input_workers(cfg.input_workers, 0))
        try:
            self._ray, self._owned = session.connect(cfg.ray_address, cfg.ray_logs, cfg.hosts)
            self._start(cfg, model, dataset, getattr(nccl, "__name__", nccl))
            super().__init__(cfg, model=model, dataset=dataset, placement=Placement(towers=[CPU]),
                             quiet_placement=True)
        except BaseException:
            self._shutdown()
            if owned is not None:
                close_dataset(owned)
            raise
        self._owned_data = owned  # its TFRecord workers (the driver's batches) end with close()

    # -- start-up --------------------------------------------------------------------------

    def _start(self, cfg, model, dataset, nccl_name) -> None:
        ray, n = self._ray, cfg.hosts
        towers = cfg.n_gpu or (len(cfg.devices.split(",")) if cfg.devices and cfg.devices != "cpu" else 1)
        gpus = session.gpus_per_host(ray, n, towers, cfg.devices, cfg.soft_placement)
        host_cfg = cfg if gpus else dataclasses.replace(cfg, devices="cpu", n_gpu=towers)
        opts = {"num_cpus": 1, "num_gpus": gpus, "max_restarts": 0}
        group = session.spread(ray, n, gpus) if cfg.ray_address is not None else None
        actor = ray.remote(Host)
        self._hosts = []
        for h in range(n):
            if group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=h)
            self._hosts.append(actor.options(**opts).remote(host_cfg, h, nccl_name))
        self.host_info = self._gather([(a.describe.remote(), h) for h, a in enumerate(self._hosts)])
        notice = self.host_info[0]["notice"]
        if gpus == 0 and int(ray.cluster_resources().get("GPU", 0)) and cfg.devices != "cpu":
            notice = f"{n} hosts x {towers} GPUs asked for, the Ray cluster has fewer GPUs: hosts run on the CPU"
        if notice:
            print(notice, flush=True, file=sys.stderr)
        self._towers = [i["towers"] for i in self.host_info]
        data = ray.put(dataset)
        world, exchange = [None] * n, None
        if cfg.sync in ("grads", "weights"):
            if all(i["ranks"] for i in self.host_info):  # GPU hosts: one communicator over every host
                uid = ray.get(self._hosts[0].unique_id.remote())
                world = world_layout([i["ranks"] for i in self.host_info], self._towers, uid)
            else:
                self._exchange = exchange = ray.remote(Exchange).options(num_cpus=0).remote(n)
        else:
            per_update = sum(self._towers) if cfg.sync == "ps" else self._towers[0]
            self._ps = ray.remote(ParameterServer).options(num_cpus=0).remote(
                cfg, model, data, per_update * cfg.batch_size)
        # All at once: NCCL communicators are made only when every rank has joined.
        self._gather([(a.build.remote(model, data, world[h], exchange, self._towers), h)
                      for h, a in enumerate(self._hosts)])
        self._weights_ref = None  # async: the server's newest weights

    # -- sizes -----------------------------------------------------------------------------

    @property
    def n_towers(self) -> int:
        """Towers behind one update: every host's (one host's with async)."""
        return self._towers[0] if self.cfg.sync == "async" else sum(self._towers)

    def towers_text(self) -> str:
        hosts = " | ".join(", ".join(i["devices"]) for i in self.host_info)
        t = self._towers[0]
        text = f"{len(self._towers)} hosts x {t} tower{'s' if t > 1 else ''}: {hosts}"
        if self.cfg.sync == "async" and self._stale[0]:
            text += f"; gradient staleness mean {self._stale[1] / self._stale[0]:.2f}, max {self._stale[2]}"
        return text

    # -- talking to the actors -------------------------------------------------------------

    def _gather(self, refs_hosts):
        """Results of [(ref, host or None)], in order; a dead host stops the run naming it."""
        ray = self._ray
        refs = [r for r, _ in refs_hosts]
        pending = list(refs)
        try:
            while pending:  # wait for any: a host blocked on a dead one must not hide it
                ready, pending = ray.wait(pending, num_returns=1)
                ray.get(ready)
            return ray.get(refs)
        except ray.exceptions.RayError as e:
            self._dead = True
            raise self._explain(e, refs_hosts) from None

    def _explain(self, e, refs_hosts) -> Exception:
        ray = self._ray
        cause = getattr(e, "cause", None)
        if isinstance(cause, (UserError, TrainingError)):
            return cause
        if isinstance(e, ray.exceptions.RayActorError):
            dead = getattr(e, "actor_id", None)
            for h, a in enumerate(self._hosts or []):
                if dead is not None and a._actor_id.hex() == dead:
                    info = self.host_info[h] if getattr(self, "host_info", None) else {}
                    where = f" ({info['node']}, pid {info['pid']})" if info else ""
                    return TrainingError(
                        f"host {h}{where} died at step {self.step if hasattr(self, 'step') else 0}: run stopped; "
                        f"its last checkpoint is kept, rerun with `resume` to continue from it")
            if self._ps is not None and self._ps._actor_id.hex() == dead:
                return TrainingError(f"the parameter server died at step {getattr(self, 'step', 0)}: run stopped; "
                                     "rerun with `resume` to continue from the last checkpoint")
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return TrainingError(f"the Ray cluster failed at step {getattr(self, 'step', 0)}: {first}")

    def _slices(self, x, y):
        b, start = self.cfg.batch_size, 0
        for t in self._towers:
            yield x[start: start + t * b], y[start: start + t * b]
            start += t * b

    # -- one step --------------------------------------------------------------------------

    def train_step(self, x, y, want_loss: bool = False):
        if len(x) != self.global_batch:
            raise UserError(f"train_step takes one global batch of {self.global_batch} examples, got {len(x)}")
        if self.cfg.sync == "async":
            raise UserError("with `sync` async the hosts run at their own pace: use fit()")
        hosts = self._hosts
        if self.cfg.sync == "ps":
            outs = [a.gradients.options(num_returns=2).remote(xs, ys, want_loss)
                    for a, (xs, ys) in zip(hosts, self._slices(x, y))]
            shares = [t / sum(self._towers) for t in self._towers]
            new = self._ps.apply.remote(shares, *[g for g, _ in outs])
            losses = [(l, h) for h, (_, l) in enumerate(outs)]
            waits = losses + [(a.set_params.remote(new), h) for h, a in enumerate(hosts)]
        else:
            losses = waits = [(a.train_step.remote(xs, ys, want_loss), h)
                              for h, (a, (xs, ys)) in enumerate(zip(hosts, self._slices(x, y)))]
        previous, self._pending = self._pending, waits
        self._gather(previous)  # the step before: its hosts are done
        result = None
        if want_loss:
            result = [v for per_host in self._gather(losses) for v in per_host]
        self.step += 1
        if self.cfg.sync != "weights":
            self.all_reduces += 1
        elif self.step % self.cfg.average_every == 0:
            self.all_reduces += 1
            self.last_average = self.step
        return result

    def _loop(self, run, prefetch) -> None:
        if self.cfg.sync != "async":
            return super()._loop(run, prefetch)
        ray, free = self._ray, list(range(len(self._hosts)))
        to_draw, inflight = self.cfg.steps - self.step, {}
        while self.step < self.cfg.steps:
            while free and to_draw > 0:
                h = free.pop(0)
                x, y = prefetch.get()
                to_draw -= 1
                g, l = self._hosts[h].gradients.options(num_returns=2).remote(x, y, True, self._weights_ref)
                inflight[g] = (h, self.step, l)
            ready, _ = ray.wait(list(inflight), num_returns=1)
            h, version, l = inflight.pop(ready[0])
            self._weights_ref, info = self._ps.apply_async.options(num_returns=2).remote(ready[0], version)
            staleness, losses = self._gather([(info, None), (l, h)])
            self._stale = [self._stale[0] + 1, self._stale[1] + staleness, max(self._stale[2], staleness)]
            free.append(h)
            self.step += 1
            run.after_step(losses)

    def fit(self, extensions=()) -> dict:
        result = super().fit(extensions)
        if self.cfg.sync == "async" and self._stale[0]:
            result.update(staleness_mean=self._stale[1] / self._stale[0], staleness_max=self._stale[2])
        return result

    def scaling(self, rate: float) -> tuple[float, float]:
        return float("nan"), float("nan")  # a 1-tower run is one host's business, not the driver's

    def finish(self) -> None:
        if self.cfg.sync == "weights":
            self._gather([(a.finish.remote(), h) for h, a in enumerate(self._hosts)])
            self.last_average = self.step

    # -- state -----------------------------------------------------------------------------

    def _source(self):
        return self._ps if self._ps is not None else self._hosts[0]

    def synchronize(self) -> None:
        """Wait for the hosts, then copy the state into the mirror (once per step)."""
        if self._dead or self._hosts is None or not hasattr(self, "replicas"):
            return
        self._gather(self._pending)
        self._pending = []
        if self._pulled == self.step:
            return
        state = self._gather([(self._source().state.remote(), None)])[0]
        mirror = self.replicas[0]
        mirror.params[...] = state["params"]
        mirror.grads[...] = state["grads"]
        self.ema.shadow[...] = state["ema"]
        for k, buf in self.optimizers[0].state.items():
            buf[...] = state[f"state/{k}"]
        self.n_averages = state["n_averages"]
        self._pulled = self.step

    def load_state_dict(self, state: dict, where: str = "load_state_dict") -> None:
        super().load_state_dict(state, where)
        targets = [(a, h) for h, a in enumerate(self._hosts)] + ([(self._ps, None)] if self._ps else [])
        self._gather([(a.load_state_dict.remote(state), h) for a, h in targets])
        self._pulled, self._weights_ref = self.step, None

    def check_replicas(self) -> bool:
        """Each host's towers, then every host against host 0 (or the server, with ps)."""
        if self.cfg.sync == "async":
            return False  # hosts compute on different versions by design
        ran = self._gather([(a.check_replicas.remote(), h) for h, a in enumerate(self._hosts)])
        if not all(ran):
            return False
        ref = self._gather([(self._source().params.remote(), None)])[0]
        atol = 1e-6 * max(1.0, float(numpy.abs(ref).max())) if self.cfg.sync == "weights" else 0.0
        for h, a in enumerate(self._hosts):
            p = self._gather([(a.params.remote(), h)])[0]
            if numpy.any(numpy.abs(p - ref) > atol):
                raise TrainingError(f"replica check failed at step {self.step}: host {h} differs from "
                                    f"{'the parameter server' if self._ps else 'host 0'} by up to "
                                    f"{float(numpy.abs(p - ref).max()):.3g}; hosts have diverged")
        return True

    def cross_host_seconds(self) -> list[float]:
        """Seconds each host spent in the cross-host mean (CPU hosts; the benchmark reads it)."""
        return self._gather([(a.cross_host_seconds.remote(), h) for h, a in enumerate(self._hosts)])

    def host_pids(self) -> list[int]:
        return [i["pid"] for i in self.host_info]

    # -- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        ray, self._pending = self._ray, []
        if ray is None:
            return
        for a in (self._hosts or []) + [self._ps, self._exchange]:
            if a is not None:
                ray.kill(a)
        self._hosts, self._ps, self._exchange = [], None, None
        self._dead = True
        if self._owned:
            ray.shutdown()
        self._ray = None
