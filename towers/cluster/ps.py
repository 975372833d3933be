"""The parameter server (``sync`` ps and async): a Ray actor that applies the hosts' gradients.

It holds a one-tower ``towers.Trainer`` on its CPU whose ``batch_size`` x
``accumulate`` is the examples behind one update (every host's towers for ps,
one host's for async), so its learning-rate schedule, its input position and
its EMA count as every other mode's do.  It loads the data itself (for the position, the metadata
and evaluation); it never trains on it.

Hosts and server meet on a shared-memory board (``towers.cluster.board``), one
row per host, never through the driver:

* a host waits for the weights it needs (ps: the update after its last
  push; async: whatever is newest), copies ``weights`` and ``wbufs`` into its
  replicas (``pull``), computes its towers' mean gradient, writes it, its
  towers' mean model buffers and its losses into its row, records the version
  it pulled, then bumps its ``push`` counter;
* ``serve(n)`` applies ``n`` updates:
  ps (TensorFlow's ``SyncReplicasOptimizer``): waits for every host's push,
  applies their mean weighted by tower counts (in host order) once;
  async: applies each host's gradient as it arrives (oldest waiting host
  first), its staleness being the updates applied since the version it
  pulled, then acknowledges it (``ack``);
  either way the model buffers become the hosts' weighted mean, the new
  weights are published under a sequence lock (``seq`` odd while writing) and
  ``version`` is bumped.

Sync points: ps is one barrier per update (all pushes, then the version);
async only waits for its own acknowledgement.  A segment ends when the server
has applied ``n`` updates; an async host's gradient still waiting then is
applied in the next segment.
"""
from __future__ import annotations

import dataclasses

import numpy

from towers.cluster.board import Board
from towers.cluster.session import same_priority
from towers.cluster.state import TrainerActor, cluster_state
from towers.devices.placement import CPU, Placement, to_host

# Server-owned cells: version, sequence lock, then one acknowledgement per host.
VERSION, SEQ, ACK = 0, 1, 2


def board_spec(n_hosts: int, n_params: int, n_buffers: int, max_towers: int) -> tuple[dict, dict]:
    """The board of a parameter server over ``n_hosts`` hosts."""
    f32 = numpy.float32
    return ({"grads": ((n_hosts, n_params), f32), "bufs": ((n_hosts, n_buffers), f32),
             "losses": ((n_hosts, max_towers), numpy.float64),
             "weights": ((n_params,), f32), "wbufs": ((n_buffers,), f32)},
            {"push": n_hosts, "pulled": n_hosts, "server": 2 + n_hosts})


class HostSide:
    """A host's end of the server's board: ``pull`` the published weights, ``push`` a gradient."""

    def __init__(self, board: Board, rank: int):
        self.board, self.rank = board, rank
        self.server, self.push_cell, self.pulled = board.cell("server"), board.cell("push"), board.cell("pulled")
        self.version = 0  # of the weights pulled last

    def pull(self, set_model, at_least: int = 0) -> int:
        """Wait for version ``at_least``; copy the newest weights and buffers consistently (a seqlock)."""
        b, server = self.board, self.server
        b.wait(lambda: server[VERSION] >= at_least)
        while True:
            b.wait(lambda: server[SEQ] % 2 == 0)
            seq, version = int(server[SEQ]), int(server[VERSION])
            weights, bufs = b["weights"].copy(), b["wbufs"].copy()
            if int(server[SEQ]) == seq:
                break
        set_model(weights, bufs if bufs.size else None)
        self.version = version
        return version

    def push(self, grads, bufs, losses) -> int:
        """Write this host's gradient, buffers and losses; return the push count (its ticket)."""
        b, h = self.board, self.rank
        b["grads"][h] = to_host(grads)
        if bufs.size:
            b["bufs"][h] = to_host(bufs)
        if losses is not None:
            b["losses"][h, :len(losses)] = losses
        self.pulled[h] = self.version
        ticket = int(self.push_cell[h]) + 1
        self.push_cell[h] = ticket
        return ticket

    def acked(self, ticket: int) -> bool:
        return self.server[ACK + self.rank] >= ticket


class ParameterServer(TrainerActor):
    """The server actor (see the module docstring); the driver reaches its ``Trainer`` through ``call``."""

    OWN = ("state_dict", "load_state_dict", "set_weights")

    def __init__(self, trainer_class, cfg, model, dataset, handle, towers_per_host: list[int],
                 niceness: int | None = None):
        if niceness is not None:
            same_priority(niceness)
        self.cfg, self.towers = cfg, towers_per_host
        per_update = sum(towers_per_host) if cfg.sync == "ps" else towers_per_host[0]
        one = dataclasses.replace(cfg, hosts=1, n_gpu=1, devices="cpu", batch_size=per_update * cfg.batch_size,
                                  sync="grads", ray_address=None, logdir=None, resume=False, cache_images=False)
        self.trainer = trainer_class(one, model=model, dataset=dataset, placement=Placement(towers=[CPU]))
        self.board = Board.attach(handle)
        self.server = self.board.cell("server")
        total = sum(towers_per_host)
        self.shares = [numpy.float32(t / total) for t in towers_per_host]
        self.stale = [0, 0, 0]  # updates, sum and largest staleness (async)
        self.gradients = 0  # hosts' gradients applied (ps: every host's per update; async: one)
        self._next = 0  # async: the host looked at first
        self.publish(bump=False)
        bufs = self.replica.buffers
        if bufs.size:  # every host's row starts at the common initial buffers
            self.board["bufs"][...] = bufs

    @property
    def replica(self):
        return self.trainer.towers[0].replica

    def publish(self, bump: bool = True) -> None:
        """The server's weights and buffers onto the board under the sequence lock; ``bump``: one more update."""
        b, server = self.board, self.server
        server[SEQ] += 1
        b["weights"][...] = self.replica.params
        if self.replica.buffers.size:
            b["wbufs"][...] = self.replica.buffers
        server[SEQ] += 1
        if bump:  # the version counts updates applied on this board
            server[VERSION] += 1

    def serve(self, n: int) -> dict:
        """Apply ``n`` updates (see the module docstring); the last update's losses, the staleness and the count of
        hosts' gradients applied so far."""
        b, push, server, hosts = self.board, self.board.cell("push"), self.server, len(self.towers)
        losses = None
        for _ in range(n):
            if self.cfg.sync == "ps":
                u = int(server[VERSION]) + 1
                b.wait(lambda: int(push.min()) >= u)  # every host pushed its gradient for update u
                mean = b["grads"][0] * self.shares[0]
                for h in range(1, hosts):
                    mean += b["grads"][h] * self.shares[h]
                self.trainer.executor.apply_gradients(mean)
                self.gradients += hosts
                losses = [b["losses"][h, :t].tolist() for h, t in enumerate(self.towers)]
                self._buffers(range(hosts))
                self.publish()
            else:
                h = self._arrived()
                staleness = int(server[VERSION]) - int(b.cell("pulled")[h])
                self.stale = [self.stale[0] + 1, self.stale[1] + staleness, max(self.stale[2], staleness)]
                self.trainer.executor.apply_gradients(b["grads"][h])
                self.gradients += 1
                losses = [b["losses"][h, :self.towers[h]].tolist()]
                self._buffers(range(hosts))
                self.publish()
                server[ACK + h] = push[h]
        return {"losses": [v for per_host in losses for v in per_host] if losses else None,
                "stale": list(self.stale), "gradients": self.gradients}

    def _arrived(self) -> int:
        """Async: a host whose pushed gradient waits, the one after the last served first (no host starves)."""
        push, server, n = self.board.cell("push"), self.server, len(self.towers)
        found = []

        def ready():
            for k in range(n):
                h = (self._next + k) % n
                if push[h] > server[ACK + h]:
                    found.append(h)
                    return True
            return False
        self.board.wait(ready)
        self._next = (found[0] + 1) % n
        return found[0]

    def _buffers(self, hosts) -> None:
        """The model buffers: the hosts' latest, weighted by tower counts."""
        if not self.replica.buffers.size:
            return
        rows = self.board["bufs"]
        mean = rows[0] * self.shares[0]
        for h in list(hosts)[1:]:
            mean += rows[h] * self.shares[h]
        self.replica.set_buffers(mean)

    # -- what the server adds to its Trainer's answers (the rest: ``call``) ----------------------

    def state_dict(self) -> dict:
        return cluster_state(self.trainer.state_dict(), self.cfg, self.trainer.dataset, self.towers)

    def load_state_dict(self, state: dict, where: str) -> None:
        self.trainer.load_state_dict(state, where)
        self.publish(bump=False)  # the hosts' next pull takes these weights

    def set_weights(self, weights: dict, ema: bool) -> None:
        self.trainer.set_weights(weights, ema)
        self.publish(bump=False)

    def params(self) -> numpy.ndarray:
        return to_host(self.replica.params, copy=True)

    def close(self) -> None:
        self.trainer.close()
        self.board.close()
