"""How a cluster's hosts stay together: ``HostKeeping``, one object per sync mode, and ``AllReduce``.

``towers.parallel.sync.MODES`` names, for each value of the ``sync``
setting, the ``HostKeeping`` class of a cluster run; the driver makes it once
(``HostKeeping(cfg, towers_per_host)``) and it owns everything the mode does
across hosts, in the three processes it runs in:

* on the driver (``towers.cluster.driver.ClusterExecutor``, the ``cluster``
  argument): ``wire`` makes what the hosts meet on (shared-memory boards, an
  NCCL id, an exchange actor, a parameter server); ``run_steps`` issues a
  segment and collects its losses; ``train_step`` hands a given global batch
  to the hosts (or refuses it); ``check`` compares the hosts; ``source`` is
  the actor that answers for the run's state; ``communication``, ``note`` and
  ``results`` are the mode's figures;
* on each host (``towers.cluster.hosts.Host``, which runs whatever keeper it
  is given, pickled with what ``wire`` made): ``host_sync`` is the sync mode
  of its own towers (``towers.parallel.sync``), ``reducer`` the cross-host
  reducer they reduce through (None: the host's own), ``host_steps`` the
  host's loop for a segment, over its ``LocalExecutor`` (the ``Executor``
  protocol only);
* on a parameter server (``towers.cluster.ps``): ``serve``, the server's loop.

``AllReduce`` (``grads`` and ``weights``): the hosts' towers are one set of
replicas whose reducer reaches across hosts -- one NCCL communicator over
every host's GPUs, or on CPU hosts a shared-memory mean on one node
(``BoardMean``) or the object store across nodes (``ObjectStoreMean``,
``towers.cluster.reduce``) -- so each host runs its own steps
(``LocalExecutor.run_steps``) and its one-host keeper does the rest
(``GradientAveraging``, ``PeriodicAveraging``).  The parameter-server modes
are ``SynchronousServer`` and ``AsynchronousServer`` (``towers.cluster.ps``).

Adding a mode: a ``HostKeeping`` subclass (its wiring, its host loop, and a
server loop if it has a server) and one ``MODES`` entry naming it (docs/architecture.md,
Sync modes).

Sync points: ``run_steps`` and ``check`` wait for every host (and the
server); what happens inside a segment is the mode's (its docstring).
"""
from __future__ import annotations

import numpy

from towers.errors import TrainingError
from towers.parallel.sync import MODES


class HostKeeping:
    """How a cluster's hosts stay together (see the module docstring); the defaults are ``AllReduce``'s.

    ``cfg``: the run's settings; ``towers``: each host's tower count.  Made on
    the driver and copied to every host (and server): what a method keeps
    lives in the process that runs it.
    """

    def __init__(self, cfg, towers: list[int]):
        self.cfg, self.towers = cfg, list(towers)

    # -- the driver ----------------------------------------------------------------------------

    def towers_per_update(self) -> int:
        """Towers behind one update, which the schedule and a checkpoint count: every host's."""
        return sum(self.towers)

    def wire(self, cluster) -> None:
        """Make what the hosts meet on, before they build (boards, ids, actors; through ``cluster``)."""

    def source(self, cluster):
        """The actor that answers for the run's weights and state: host 0."""
        return cluster.hosts[0]

    def recorded_settings(self, host_cfg, run_cfg):
        """The settings a checkpoint records: those of the actor that holds the state, here a host's
        (``host_cfg``: where the hosts run, e.g. ``devices`` cpu when the cluster has too few GPUs)."""
        return host_cfg

    def run_steps(self, cluster, n: int, want_loss: bool) -> list | None:
        """``n`` steps of every host in its own loop; the last step's losses (host order) when asked."""
        outs = cluster.wait([(a.run_steps.remote(n, want_loss), h) for h, a in enumerate(cluster.hosts)])
        return [v for per_host in outs for v in per_host] if want_loss else None

    def train_step(self, cluster, x, y, want_loss: bool) -> list | None:
        """One step of every host on its towers' slice of the global batch ``x``, ``y`` (host order, then tower
        order, as the run's own batches)."""
        b, refs, lo = self.cfg.batch_size * self.cfg.accumulate, [], 0  # a tower's rows
        for h, a in enumerate(cluster.hosts):
            hi = lo + self.towers[h] * b
            refs.append((a.train_step.remote(x[lo:hi], y[lo:hi], want_loss), h))
            lo = hi
        outs = cluster.wait(refs)
        return [v for per_host in outs for v in per_host] if want_loss else None

    def check(self, cluster) -> bool:
        """Each host's towers, then every host's weights against host 0's; whether the hosts were compared."""
        out = cluster.wait([(a.check_replicas.remote(), h) for h, a in enumerate(cluster.hosts)])
        if not all(ran for ran, _ in out):
            return False
        compare_hosts(cluster, [w for _, w in out], out[0][1], "host 0",
                      MODES[self.host_sync].keeper.atol(flat(out[0][1], cluster.model)))
        return True

    def communication(self, cluster) -> tuple[int, str]:
        """(count so far, what it counts per step) for the summary line: host 0's collectives."""
        return cluster.all_reduces, "all-reduces/step"

    def note(self) -> str:
        """What the summary line's towers text adds ("" or "; ...")."""
        return ""

    def results(self) -> dict:
        """Figures of the mode added to ``fit``'s result."""
        return {}

    # -- a host ------------------------------------------------------------------------------

    @property
    def host_sync(self) -> str:
        """The sync mode of each host's own towers: the run's."""
        return self.cfg.sync

    def reducer(self, rank: int, nccl):
        """Host ``rank``'s reducer, or a function of its placement and streams that makes it; None: its own."""
        return None

    def host_steps(self, executor, n: int, want_loss: bool, *segment):
        """``n`` steps of this host over its ``executor``; the last step's losses when asked."""
        return executor.run_steps(n, want_loss)[0]

    def host_counters(self) -> dict:
        """Seconds and calls of the cross-host mean on this host (None: the mode has none)."""
        return {"cross_seconds": None, "cross_calls": None}

    def nccl_ranks(self) -> list:
        """(world size, rank, id) of this host's cross-host communicators (the layout test's)."""
        return []

    def close_host(self) -> None:
        """Release what ``reducer`` attached on this host."""


class AllReduce(HostKeeping):
    """``grads`` and ``weights``: one reducer over every host's towers, each host stepping alone (module doc).

    ``wire`` picks the cross-host mean: NCCL over every host's GPU leaders
    when each host has ranks (host 0 made the id), else a shared-memory board
    when every host is on the driver's node, else the object store through an
    ``Exchange`` actor.
    """

    world = board = exchange = None  # what wire made (one of them; world: each host's layout, by rank)
    across = made = None  # on a host: its cross-host mean (CPU hosts), the reducer made over it

    def wire(self, cluster) -> None:
        from towers.cluster.reduce import Exchange, board_spec
        from towers.parallel.allreduce import world_layout

        n, info = len(self.towers), cluster.host_info
        if all(i["ranks"] for i in info):  # GPU hosts: one communicator over every host
            uid = cluster.wait([(cluster.hosts[0].unique_id.remote(), 0)])[0]
            self.world = world_layout([i["ranks"] for i in info], self.towers, uid)
        elif cluster.one_node:
            self.board = cluster.board(*board_spec(n, max(cluster.model.size, cluster.model.buffer_size, 1)))
        else:
            self.exchange = cluster.start(Exchange, n, who="the exchange")

    def reducer(self, rank: int, nccl):
        from towers.cluster.board import Board
        from towers.cluster.reduce import BoardMean, ObjectStoreMean
        from towers.parallel.reducers import make_reducer

        if self.world is not None:
            kw = {"nccl": nccl, "world": self.world[rank]}
        else:
            self.across = (BoardMean(Board.attach(self.board), rank, self.towers) if self.board is not None
                           else ObjectStoreMean(self.exchange, rank, self.towers))
            kw = {"across": self.across}

        def make(placement, streams):
            self.made = make_reducer(placement, streams, **kw)
            return self.made
        return make

    def host_counters(self) -> dict:
        a = self.across
        return {"cross_seconds": a.seconds if a is not None else 0.0, "cross_calls": a.calls if a is not None else 0}

    def nccl_ranks(self) -> list:
        across = getattr(self.made, "across", None)
        comms = across.comm.comms if across is not None and hasattr(across, "comm") else []
        return [(c.size(), c.rank_id(), getattr(c, "comm_id", b"")) for c in comms]


def flat(weights: dict, model) -> numpy.ndarray:
    """The trainable weights of ``weights`` ({name: array}, as ``get_weights`` gives) as one flat float32 array."""
    return numpy.concatenate([numpy.ravel(weights[name]) for name, *_ in model.layout()])


def compare_hosts(cluster, weights: list[dict], ref: dict, ref_name: str, atol: float) -> None:
    """Every host's trainable weights against ``ref`` (named ``ref_name``), within ``atol``; a
    ``TrainingError`` naming the first host that differs."""
    want = flat(ref, cluster.model)
    for h, w in enumerate(weights):
        diff = numpy.abs(flat(w, cluster.model) - want)
        if numpy.any(diff > atol):
            raise TrainingError(f"replica check failed at step {cluster.step}: host {h} differs from {ref_name} by "
                                f"up to {float(diff.max()):.3g}; hosts have diverged")
