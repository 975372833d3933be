"""The host actor: one host's ``towers.Trainer``, its slice of every global batch, and its own step loop.

Built in two calls so the driver can lay out the cluster first:
``Host(cfg, rank, ...)`` resolves the host's placement (``n_gpu`` towers on
the GPUs Ray gave it, as one host does); ``build(...)`` then loads the data
(every host reads the same files itself: nothing is shipped per step) and
makes a one-host ``Trainer`` (``hosts=1``) whose reducer reaches across hosts:

* grads, weights on GPUs: ``make_reducer(..., world=NcclWorld)``, one NCCL
  communicator over every host's GPU leaders (host 0 made the id,
  ``unique_id()``; the driver handed it to every host);
* grads, weights on CPUs: ``make_reducer(..., across=BoardMean)`` (hosts on
  one node) or ``ObjectStoreMean`` (several nodes), ``towers.cluster.reduce``;
* ps, async: the local reducer only; the host pulls weights from and pushes
  its mean gradient to the parameter server's board (``towers.cluster.ps``).

The host's ``Trainer`` is a ``Share`` of the run (``towers.local``): it
draws the run's global batches of ``hosts x towers x batch_size x accumulate``
examples from the shared seeded permutation and keeps its towers' rows, host
order then tower order: the examples each tower sees are those of one host with every
tower, and its input position after a step is the run's.

``run_steps(n, want_loss)`` runs n steps in the host's own loop (the driver
calls it once per segment) and returns the last step's losses when asked.
The driver reaches the rest of the host's ``Trainer`` through ``call``
(``towers.cluster.state.TrainerActor``).  Every method returns host (NumPy)
values.
"""
from __future__ import annotations

import dataclasses
import importlib
import os

import numpy

from towers.cluster.board import Board
from towers.cluster.ps import HostSide
from towers.cluster.reduce import BoardMean, ObjectStoreMean
from towers.cluster.session import same_priority
from towers.cluster.state import TrainerActor, cluster_state, towers_per_update
from towers.devices.cpu_threads import cpu_count
from towers.devices.placement import resolve, to_host
from towers.local import Share
from towers.parallel.reducers import make_reducer


def _losses(losses) -> list[float] | None:
    return None if losses is None else [float(v) for v in losses]


class Host(TrainerActor):
    """One host (a Ray actor; see the module docstring).

    ``nccl_module``: the import name of a module standing in for
    ``cupy.cuda.nccl`` (tests: ``nccl_standin``); None: the real one.
    """

    OWN = ("state_dict",)

    def __init__(self, cfg, rank: int, nccl_module: str | None = None, niceness: int | None = None):
        self.cfg, self.rank, self.trainer = cfg, rank, None
        if niceness is not None:
            same_priority(niceness)
        self.nccl = importlib.import_module(nccl_module) if nccl_module else None
        self.placement = resolve(cfg.n_gpu, cfg.devices, cfg.soft_placement)
        self.across = self.ps = None

    def describe(self) -> dict:
        """Towers, GPU leaders (NCCL ranks), placement notice, pid and node of this host."""
        import ray

        towers = self.placement.towers
        # NCCL ranks: one per device group (GPU hosts; with a stand-in NCCL module, the CPU group too).
        ranks = len(self.placement.groups) if any(d.is_gpu for d in towers) or self.nccl is not None else 0
        return {"towers": len(towers), "ranks": ranks, "devices": [str(d) for d in towers],
                "notice": self.placement.notice, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "cores": cpu_count(),
                "cpu": not any(d.is_gpu for d in towers)}

    def unique_id(self) -> bytes:
        """The NCCL id of the cross-host communicator (asked of host 0 only)."""
        from towers.parallel.allreduce import nccl_module

        return (self.nccl or nccl_module()).get_unique_id()

    def build(self, trainer_class, model, dataset, towers_per_host: list[int], world=None, board=None,
              exchange=None, cores: int = 0) -> None:
        """The host's ``trainer_class`` (the driver's ``Trainer``) with the cross-host reducer (or the server's
        board) of the run's mode; ``cores``: its share of its machine's cores (0: all of them)."""
        cfg, rank = self.cfg, self.rank
        self.towers = towers_per_host
        sync = cfg.sync if cfg.sync in ("grads", "weights") else "grads"
        one = dataclasses.replace(cfg, hosts=1, ray_address=None, sync=sync, logdir=None, resume=False,
                                  cache_images=False)  # the decoded-image cache is one host's (README)
        if cfg.sync in ("ps", "async"):
            reducer = None
            self.ps = HostSide(Board.attach(board), rank)
        elif world is not None:
            def reducer(placement, streams):
                return make_reducer(placement, streams, nccl=self.nccl, world=world)
        else:
            self.across = (BoardMean(Board.attach(board), rank, towers_per_host) if board is not None
                           else ObjectStoreMean(exchange, rank, towers_per_host))

            def reducer(placement, streams):
                return make_reducer(placement, streams, across=self.across)
        share = Share(first_tower=sum(towers_per_host[:rank]), draw_towers=sum(towers_per_host),
                      update_towers=towers_per_update(cfg, towers_per_host), cores=cores)
        self.trainer = trainer_class(one, model=model, dataset=dataset, reducer=reducer, placement=self.placement,
                               share=share)

    def nccl_ranks(self) -> list[tuple[int, int, bytes]]:
        """(world size, rank, id) of each local communicator (tests check the layout)."""
        across = getattr(self.trainer.reducer, "across", None)
        comms = across.comm.comms if across is not None and hasattr(across, "comm") else []
        return [(c.size(), c.rank_id(), getattr(c, "comm_id", b"")) for c in comms]

    # -- steps ------------------------------------------------------------------------------

    def run_steps(self, n: int, want_loss: bool = False, until: int | None = None):
        """``n`` steps of this host (async: until the server has applied ``until`` updates); the last losses."""
        if self.cfg.sync == "async":
            return self._run_async(until)
        t, ex, losses = self.trainer, self.trainer.executor, None
        if self.ps is None:
            losses = ex.run_steps(n, want_loss)[0]
        else:
            for k in range(n):
                self.ps.pull(t.model_state.set, at_least=int(self.ps.push_cell[self.rank]))
                losses = self._push(*ex.rows.next_batch(), want_loss and k == n - 1)
            # The server's newest weights, so host == server after a segment.
            self.ps.pull(t.model_state.set, at_least=int(self.ps.push_cell[self.rank]))
        return _losses(losses) if want_loss else None

    def train_step(self, x, y, want_loss: bool = False):
        """One step on this host's slice of a global batch; the losses as host floats."""
        return _losses(self.trainer.executor.train_step(x, y, want_loss))

    def _push(self, x, y, want_loss: bool):
        t = self.trainer
        losses = t.executor.gradients(x, y, want_loss)
        t.synchronize()
        reps = [tw.replica for tw in t.towers]
        bufs = to_host(reps[0].buffers, copy=True)
        for r in reps[1:]:  # forward passes may move each tower's buffers: the host sends their mean
            bufs += to_host(r.buffers)
        if len(reps) > 1:
            bufs *= numpy.float32(1 / len(reps))
        self.ps.push(reps[0].grads, bufs, _losses(losses))
        return losses

    def _run_async(self, until: int) -> None:
        """Gradients on the newest weights, one batch each, until the server has applied ``until`` updates.

        A gradient the server has not applied when the segment ends stays on
        the board: the next segment waits for its acknowledgement first.
        """
        ps, server, t = self.ps, self.ps.server, self.trainer
        ticket = int(ps.push_cell[self.rank])
        while True:
            ps.board.wait(lambda: ps.acked(ticket) or server[0] >= until)
            if server[0] >= until:
                return None
            ps.pull(t.model_state.set)
            self._push(*t.executor.rows.next_batch(), True)
            ticket = int(ps.push_cell[self.rank])

    # -- state, weights, evaluation -------------------------------------------------------------

    def state_dict(self) -> dict:
        """The host's ``Trainer.state_dict()`` with the run's metadata."""
        t = self.trainer
        return cluster_state(t.state_dict(), self.cfg, t.dataset, self.towers)

    def check_replicas(self):
        """(whether this host's towers were compared, its first replica's weights and buffers)."""
        ran = self.trainer.check_replicas()
        r = self.trainer.towers[0].replica
        return ran, to_host(r.params, copy=True), to_host(r.buffers, copy=True)

    def counters(self) -> dict:
        """The step engine's counters and the cross-host mean's time (the driver's figures)."""
        t = self.trainer
        across = self.across
        return {"step": t.step, "all_reduces": t.all_reduces,
                "cross_seconds": across.seconds if across is not None else 0.0,
                "cross_calls": across.calls if across is not None else 0,
                "blas_threads": getattr(t.executor, "blas_threads", None)}

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        for side in (self.ps,):
            if side is not None:
                side.board.close()
