"""The host actor: one ``towers.Trainer`` over one host's towers, driven by the driver.

Built in two calls so the driver can lay out the cluster first:
``Host(cfg, rank, ...)`` resolves the host's placement (as one host does,
``n_gpu`` towers on the GPUs Ray gave it); ``build(...)`` then makes the
Trainer with the cross-host hook of the run's ``sync`` mode:

* grads, weights on GPUs: an ``NcclWorld``: one communicator over every host's
  GPU leaders, ranks numbered host by host; host 0 made the id
  (``unique_id()``), the driver handed it to every host;
* grads, weights on the CPU: a ``CrossHostMean`` (``towers.cluster.reduce``);
* ps, async: none; ``gradients`` returns the host's mean gradient and the
  parameter server applies it (``towers.cluster.ps``).

Every method returns host (NumPy) values, so nothing the driver receives
depends on the host's devices.
"""
from __future__ import annotations

import os

import numpy

from towers.devices.placement import on_stream, resolve, to_host
from towers.trainer import Trainer


class HostTrainer(Trainer):
    """One host's Trainer: its learning-rate schedule counts every host's examples."""

    def __init__(self, examples_per_step: int, *args, **kwargs):
        self._examples_per_step = examples_per_step
        super().__init__(*args, **kwargs)

    @property
    def examples_per_step(self) -> int:
        return self._examples_per_step


def losses_to_host(losses) -> list[float] | None:
    return None if losses is None else [float(v) for v in losses]


def flat_state(trainer) -> dict:
    """What the driver mirrors: the first replica's weights and gradients, the EMA, optimizer state."""
    trainer.synchronize()
    state = {"params": to_host(trainer.replicas[0].params, copy=True),
             "grads": to_host(trainer.replicas[0].grads, copy=True),
             "ema": to_host(trainer.ema.shadow, copy=True),
             "n_averages": trainer.n_averages, "step": trainer.step}
    state.update({f"state/{k}": to_host(v, copy=True) for k, v in trainer.optimizers[0].state.items()})
    return state


def set_params(trainer, flat: numpy.ndarray) -> None:
    """Every replica's weights from one host array."""
    trainer.synchronize()
    for dev, stream, r in zip(trainer.devices, trainer.streams, trainer.replicas):
        with dev.scope(), on_stream(stream):
            r.params[...] = dev.xp.asarray(flat)


class Host:
    """One host's towers (a Ray actor; see the module docstring)."""

    def __init__(self, cfg, rank: int, nccl_module: str | None = None):
        import importlib

        self.cfg, self.rank, self.trainer = cfg, rank, None
        self.nccl = importlib.import_module(nccl_module) if nccl_module else None
        self.placement = resolve(cfg.n_gpu, cfg.devices, cfg.soft_placement)

    def describe(self) -> dict:
        """Towers, GPU leaders (NCCL ranks), placement notice, pid and node of this host."""
        import ray

        towers = self.placement.towers
        gpu = any(d.is_gpu for d in towers)
        if gpu:
            ranks = len(self.placement.groups)
        elif self.nccl is not None:  # a stand-in: each CPU tower plays a GPU
            ranks = len(towers)
        else:
            ranks = 0
        return {"towers": len(towers), "ranks": ranks, "devices": [str(d) for d in towers],
                "notice": self.placement.notice, "pid": os.getpid(),
                "node": ray.util.get_node_ip_address()}

    def unique_id(self) -> bytes:
        """The NCCL id of the cross-host communicator (asked of host 0 only)."""
        from towers.parallel.allreduce import nccl_module

        return (self.nccl or nccl_module()).get_unique_id()

    def build(self, model, dataset, world=None, exchange=None, towers_per_host=None) -> None:
        from towers.cluster.reduce import CrossHostMean
        cross = CrossHostMean(exchange, self.rank, towers_per_host) if exchange is not None else None
        self.trainer = HostTrainer(sum(towers_per_host) * self.cfg.batch_size, self.cfg, model=model, dataset=dataset, nccl=self.nccl, placement=self.placement,
                               quiet_placement=True, cross_host=cross, nccl_world=world)

    def nccl_ranks(self) -> list[tuple[int, int, bytes]]:
        """(world size, rank, id) of each local communicator (tests check the layout)."""
        comms = self.trainer.allreduce.nccl.comms if self.trainer.allreduce.nccl else []
        return [(c.size(), c.rank_id(), getattr(c, "comm_id", b"")) for c in comms]

    # -- steps ------------------------------------------------------------------------------

    def train_step(self, x, y, want_loss: bool):
        """grads, weights: one step of every host together (the cross-host mean inside)."""
        return losses_to_host(self.trainer.train_step(x, y, want_loss))

    def gradients(self, x, y, want_loss: bool, params=None):
        """ps, async: the host's mean gradient at ``params`` (None: its current weights), and its losses."""
        if params is not None:
            set_params(self.trainer, params)
        losses = self.trainer.gradients(x, y, want_loss)
        self.trainer.synchronize()
        return to_host(self.trainer.replicas[0].grads, copy=True), losses_to_host(losses)

    def set_params(self, flat) -> None:
        set_params(self.trainer, flat)

    def finish(self) -> None:
        self.trainer.finish()

    # -- state ------------------------------------------------------------------------------

    def state(self) -> dict:
        return flat_state(self.trainer)

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state, where="resume")

    def check_replicas(self) -> bool:
        return self.trainer.check_replicas()

    def params(self) -> numpy.ndarray:
        self.trainer.synchronize()
        return to_host(self.trainer.replicas[0].params, copy=True)

    def cross_host_seconds(self) -> float:
        cross = self.trainer.cross_host
        return cross.seconds if cross is not None else 0.0

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
