"""The host actor: one host's towers, its slice of every global batch, and the loop its sync mode gives it.

Built in two calls so the driver can lay out the cluster first:
``Host(cfg, rank, ...)`` resolves the host's placement (``n_gpu`` towers on
the GPUs Ray gave it, as one host does); ``build(...)`` then loads the data
(every host reads the same files itself: nothing is shipped per step) and
makes the host's ``LocalExecutor`` (through a one-host ``Trainer``, ``hosts``
1, which loads and checks as one host does) with the reducer of the run's
``HostKeeping`` (``towers.cluster.keeping``): the keeper the driver wired
(its boards, its NCCL layout) and handed over.  The host runs whatever
keeper it is given and knows no sync mode.

The host's executor is a ``Share`` of the run (``towers.run.local``): it draws
the run's global batches of ``hosts x towers x batch_size x accumulate``
examples from the shared seeded permutation and keeps its towers' rows, host
order then tower order: the examples each tower sees are those of one host
with every tower, and its input position after a step is the run's.

``run_steps(n, want_loss, ...)`` runs a segment in the keeper's host loop
(``HostKeeping.host_steps``) and returns the last step's losses when asked.
The driver asks the rest of the ``Executor`` protocol through ``call``
(``towers.cluster.state.Answering``); every answer is a host (NumPy) value.
"""
from __future__ import annotations

import dataclasses
import importlib
import os

from towers.cluster.session import same_priority
from towers.cluster.state import Answering
from towers.devices.cpu_threads import cpu_count
from towers.devices.placement import resolve
from towers.run.local import Share


def _losses(losses) -> list[float] | None:
    return None if losses is None else [float(v) for v in losses]


class Host(Answering):
    """One host (a Ray actor; see the module docstring).

    ``nccl_module``: the import name of a module standing in for
    ``cupy.cuda.nccl`` (tests: ``nccl_standin``); None: the real one.
    """

    def __init__(self, cfg, rank: int, nccl_module: str | None = None, niceness: int | None = None):
        self.cfg, self.rank, self.trainer, self.keeping = cfg, rank, None, None
        if niceness is not None:
            same_priority(niceness)
        self.nccl = importlib.import_module(nccl_module) if nccl_module else None
        self.placement = resolve(cfg.n_gpu, cfg.devices, cfg.soft_placement)

    def describe(self) -> dict:
        """Towers, GPU leaders (NCCL ranks), placement notice, pid and node of this host."""
        import ray

        towers = self.placement.towers
        # NCCL ranks: one per device group (GPU hosts; with a stand-in NCCL module, the CPU group too).
        ranks = len(self.placement.groups) if self.placement.gpus or self.nccl is not None else 0
        return {"towers": len(towers), "ranks": ranks, "devices": [str(d) for d in towers],
                "notice": self.placement.notice, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "cores": cpu_count(),
                "cpu": not self.placement.gpus}

    def unique_id(self) -> bytes:
        """The NCCL id of the cross-host communicator (asked of host 0 only)."""
        from towers.parallel.allreduce import nccl_module

        return (self.nccl or nccl_module()).get_unique_id()

    def build(self, trainer_class, model, dataset, keeping, cores: int = 0) -> None:
        """This host's executor, made by ``trainer_class`` (the driver's ``Trainer``) with ``keeping``'s reducer;
        ``cores``: its share of its machine's cores (0: all of them)."""
        cfg, rank, towers = self.cfg, self.rank, keeping.towers
        self.keeping = keeping
        one = dataclasses.replace(cfg, hosts=1, ray_address=None, sync=keeping.host_sync, logdir=None, resume=False,
                                  cache_images=False)  # the decoded-image cache is one host's (docs/data.md)
        share = Share(first_tower=sum(towers[:rank]), draw_towers=sum(towers),
                      update_towers=keeping.towers_per_update(), cores=cores)
        self.trainer = trainer_class(one, model=model, dataset=dataset, reducer=keeping.reducer(rank, self.nccl),
                                     placement=self.placement, share=share)
        self.answers = self.executor = self.trainer.executor

    def nccl_ranks(self) -> list[tuple[int, int, bytes]]:
        """(world size, rank, id) of each cross-host communicator (tests check the layout)."""
        return self.keeping.nccl_ranks()

    # -- steps ------------------------------------------------------------------------------

    def run_steps(self, n: int, want_loss: bool = False, *segment):
        """A segment in the keeper's host loop (``segment``: what else its driver side sends); the last losses."""
        losses = self.keeping.host_steps(self.executor, n, want_loss, *segment)
        return _losses(losses) if want_loss else None

    def train_step(self, x, y, want_loss: bool = False):
        """One step on this host's slice of a global batch; the losses as host floats."""
        return _losses(self.executor.train_step(x, y, want_loss))

    # -- checks, counters -----------------------------------------------------------------------

    def check_replicas(self):
        """(whether this host's towers were compared, then its weights: None if not)."""
        ran = self.executor.check_replicas()
        return ran, self.executor.get_weights() if ran else None

    def counters(self) -> dict:
        """The step engine's counters, the cross-host mean's time and BLAS threads (the driver's figures)."""
        ex = self.executor
        return {"step": ex.step, "all_reduces": ex.all_reduces, "blas_threads": ex.blas_threads,
                **self.keeping.host_counters()}

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        if self.keeping is not None:
            self.keeping.close_host()
