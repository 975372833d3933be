"""The parameter server (``sync`` ps and async): its two modes, its actor, and a host's end of its board.

``ParameterServer`` is a Ray actor on the driver's node that holds the run's
weights: one CPU replica's flat weights and model buffers, the optimizer with
the EMA fused into its update, the schedule, the step and the input position
of the updates applied (so its learning rate, its EMA and its checkpoint
count as every other mode's do).  No data, no towers, no ``Trainer``: it
applies the hosts' gradients, and answers the driver's questions of the run's
state, weights and evaluation through the ``Executor`` protocol's methods
(``call``), evaluating on the examples the driver hands it.

Each mode is a ``HostKeeping`` (``towers.cluster.keeping``) that owns both
loops, the hosts' and the server's, and its state:

* ``SynchronousServer`` (ps, TensorFlow's ``SyncReplicasOptimizer``): each
  host waits for the update after its last push, pulls it, pushes the mean
  gradient of its next batch; the server waits for every host's push and
  applies their mean weighted by tower counts (in host order), once per update;
* ``AsynchronousServer`` (async): each host pulls whatever is newest and
  pushes; the server applies each host's gradient as it arrives (oldest
  waiting host first), its staleness being the updates applied since the
  version that host pulled, then acknowledges it; it keeps the staleness
  figures (updates, sum, largest) and an update is one host's towers.

Hosts and server meet on a shared-memory board (``towers.cluster.board``), one
row per host, never through the driver.  A host (``HostSide``) waits for the
weights it needs, copies ``weights`` and ``wbufs`` into its replicas
(``Executor.set_flat``), computes its towers' mean gradient
(``Executor.next_gradients``), writes it, its towers' mean model buffers and
its losses into its row, records the version it pulled, then bumps its
``push`` counter.  After each update the server's model buffers become the
hosts' latest, weighted by tower counts; the new weights are published under
a sequence lock (``seq`` odd while writing) and ``version`` is bumped.

Checkpoint keys: the server's state dict has one host's keys (``params/``,
``buffers/``, ``ema/``, the optimizer's slots, ``data/``, ``step``,
``sync/n_averages``, always 0 here); the driver adds the run's metadata.

Sync points: ps is one barrier per update (all pushes, then the version);
async only waits for its own acknowledgement.  A segment ends when the server
has applied ``n`` updates; an async host's gradient still waiting then is
applied in the next segment.  Limits: the board is shared memory, so every
host must be on the driver's node.
"""
from __future__ import annotations

import os

import numpy

from towers.arrays import to_host
from towers.cluster.board import Board
from towers.cluster.keeping import HostKeeping, compare_hosts
from towers.cluster.session import same_priority
from towers.cluster.state import Answering
from towers.data.batches import InputPosition
from towers.errors import UserError
from towers.nn.replica import Replica
from towers.ops.forms import choose as choose_forms
from towers.optim.ema import EMA
from towers.optim.optimizers import make_optimizer
from towers.optim.schedule import make_schedule
from towers.parallel.sync import averages_state, read_averages
from towers.state import count
from towers.step.tower import QUIET, ModelState

# Server-owned cells: version, sequence lock, then one acknowledgement per host.
VERSION, SEQ, ACK = 0, 1, 2


def board_spec(n_hosts: int, n_params: int, n_buffers: int, max_towers: int) -> tuple[dict, dict]:
    """The board of a parameter server over ``n_hosts`` hosts."""
    f32 = numpy.float32
    return ({"grads": ((n_hosts, n_params), f32), "bufs": ((n_hosts, n_buffers), f32),
             "losses": ((n_hosts, max_towers), numpy.float64),
             "weights": ((n_params,), f32), "wbufs": ((n_buffers,), f32)},
            {"push": n_hosts, "pulled": n_hosts, "server": 2 + n_hosts})


def _floats(losses) -> list[float] | None:
    return None if losses is None else [float(v) for v in losses]


class HostSide:
    """A host's end of the server's board: ``pull`` the published weights, ``push`` a gradient."""

    def __init__(self, board: Board, rank: int):
        self.board, self.rank = board, rank
        self.server, self.push_cell, self.pulled = board.cell("server"), board.cell("push"), board.cell("pulled")
        self.version = 0  # of the weights pulled last

    def pull(self, set_flat, at_least: int = 0) -> int:
        """Wait for version ``at_least``; copy the newest weights and buffers consistently (a seqlock)."""
        b, server = self.board, self.server
        b.wait(lambda: server[VERSION] >= at_least)
        while True:
            b.wait(lambda: server[SEQ] % 2 == 0)
            seq, version = int(server[SEQ]), int(server[VERSION])
            weights, bufs = b["weights"].copy(), b["wbufs"].copy()
            if int(server[SEQ]) == seq:
                break
        set_flat(weights, bufs if bufs.size else None)
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


class ServerKeeping(HostKeeping):
    """What both parameter-server modes share: the board and the server, the hosts' push, the driver's side.

    Subclasses write the two loops: ``host_steps`` (a host's segment) and
    ``serve`` (the server's), and say whose losses a segment reports.
    """

    server = board = side = None  # the server actor and the board's handle (wire); on a host, its end
    applied = 0  # the driver's count of updates asked for since the start (the hosts' `until`)
    gradients = 0  # hosts' gradients applied (ps: every host's per update; async: one); the server's count

    @property
    def host_sync(self) -> str:
        return "grads"  # a host's towers average their gradients, which it pushes

    # -- the driver --

    def wire(self, cluster) -> None:
        if not cluster.one_node:
            raise UserError(f"`sync` {self.cfg.sync} needs every host on the driver's node (the server's board is "
                            "shared memory); use `sync` grads or weights across nodes")
        model, n = cluster.model, len(self.towers)
        self.board = cluster.board(*board_spec(n, model.size, model.buffer_size, max(self.towers)))
        self.server = cluster.start(ParameterServer, cluster.cfg, model, cluster.n_examples, self.board, self,
                                    os.getpriority(os.PRIO_PROCESS, 0), who="the parameter server", member=True)

    def source(self, cluster):
        return self.server

    def recorded_settings(self, host_cfg, run_cfg):
        return run_cfg  # the server's: the run's as given

    def run_steps(self, cluster, n: int, want_loss: bool) -> list | None:
        """``n`` updates of the server, the hosts pushing until it has applied them."""
        self.applied += n
        refs = [(a.run_steps.remote(n, want_loss, self.applied), h) for h, a in enumerate(cluster.hosts)]
        outs = cluster.wait([(self.server.serve.remote(n), None)] + refs)
        self.took(outs[0])
        return self.losses(outs[0], outs[1:]) if want_loss else None

    def took(self, served: dict) -> None:
        """Keep the figures the server returned for a segment (the driver's copy)."""
        self.gradients = served["gradients"]

    def losses(self, served: dict, host_losses: list) -> list:
        """The last update's losses, from what the server and the hosts returned."""
        raise NotImplementedError  # pragma: no cover - interface

    def train_step(self, cluster, x, y, want_loss: bool):
        raise UserError(f"train_step on a cluster needs `sync` grads or weights (with `sync` {self.cfg.sync} "
                        "the server applies the hosts' gradients): use run_steps(n) or fit()")

    def check(self, cluster) -> bool:
        """Each host's towers, then every host against the server's weights (pulled at the segment's end)."""
        out = cluster.wait([(a.check_replicas.remote(), h) for h, a in enumerate(cluster.hosts)])
        if not all(ran for ran, _ in out):
            return False
        ref = cluster.wait([(self.server.call.remote("get_weights"), None)])[0]
        compare_hosts(cluster, [w for _, w in out], ref, "the parameter server", 0.0)
        return True

    def communication(self, cluster) -> tuple[int, str]:
        """The hosts' gradients the server applied, not collectives, which no host runs across hosts."""
        return self.gradients, "host gradients/update to the parameter server"

    # -- a host --

    def reducer(self, rank: int, nccl):
        self.side = HostSide(Board.attach(self.board), rank)
        return None  # the host's towers reduce among themselves; the server is reached through the board

    def push(self, executor, want_loss: bool):
        """The mean gradient of this host's next batch, with its towers' mean buffers and losses, onto the board."""
        losses, grads, bufs = executor.next_gradients(want_loss)
        self.side.push(grads, bufs, _floats(losses))
        return losses

    def close_host(self) -> None:
        if self.side is not None:
            self.side.board.close()

    # -- the server --

    def serve(self, server: "ParameterServer", n: int) -> dict:
        """``n`` updates on ``server``: {"losses": the last update's, "gradients": hosts' gradients applied, ...}."""
        raise NotImplementedError  # pragma: no cover - interface

    def state_dict(self) -> dict:
        return averages_state(0)  # the key every mode writes; a server never averages weights

    def read_state(self, state: dict, where: str) -> None:
        read_averages(state, where)


class SynchronousServer(ServerKeeping):
    """``sync`` ps: every host's gradient, one mean, one update (see the module docstring)."""

    def host_steps(self, executor, n: int, want_loss: bool, until: int):
        side, losses = self.side, None
        for k in range(n):
            side.pull(executor.set_flat, at_least=int(side.push_cell[side.rank]))
            losses = self.push(executor, want_loss and k == n - 1)
        # The server's newest weights, so host == server after a segment.
        side.pull(executor.set_flat, at_least=int(side.push_cell[side.rank]))
        return losses

    def serve(self, server, n: int) -> dict:
        b, push, hosts, shares = server.board, server.push, len(self.towers), server.shares
        for _ in range(n):
            u = int(server.ctl[VERSION]) + 1
            b.wait(lambda: int(push.min()) >= u)  # every host pushed its gradient for update u
            mean = b["grads"][0] * shares[0]
            for h in range(1, hosts):
                mean += b["grads"][h] * shares[h]
            server.apply(mean)
            self.gradients += hosts
        return {"gradients": self.gradients}

    def losses(self, served, host_losses):
        return [v for per_host in host_losses for v in per_host]


class AsynchronousServer(ServerKeeping):
    """``sync`` async: each host's gradient as it arrives, its staleness kept (see the module docstring)."""

    stale = (0, 0, 0)  # updates, sum and largest staleness (the server's; the driver's copy: as of a segment)
    _next = 0  # the host the server looks at first

    def towers_per_update(self) -> int:
        return self.towers[0]  # an update is one host's gradient

    def host_steps(self, executor, n: int, want_loss: bool, until: int):
        """Gradients on the newest weights, one batch each, until the server has applied ``until`` updates.

        A gradient the server has not applied when the segment ends stays on
        the board: the next segment waits for its acknowledgement first.
        """
        side, server = self.side, self.side.server
        ticket = int(side.push_cell[side.rank])
        while True:
            side.board.wait(lambda: side.acked(ticket) or server[VERSION] >= until)
            if server[VERSION] >= until:
                return None
            side.pull(executor.set_flat)
            self.push(executor, True)
            ticket = int(side.push_cell[side.rank])

    def serve(self, server, n: int) -> dict:
        b, push, losses = server.board, server.push, None
        for _ in range(n):
            h = self._arrived(server)
            staleness = int(server.ctl[VERSION]) - int(server.pulled[h])
            self.stale = (self.stale[0] + 1, self.stale[1] + staleness, max(self.stale[2], staleness))
            server.apply(b["grads"][h])
            self.gradients += 1
            losses = b["losses"][h, :self.towers[h]].tolist()
            server.ctl[ACK + h] = push[h]
        return {"gradients": self.gradients, "losses": losses, "stale": self.stale}

    def _arrived(self, server) -> int:
        """A host whose pushed gradient waits, the one after the last served first (no host starves)."""
        push, ctl, n = server.push, server.ctl, len(self.towers)
        found = []

        def ready():
            for k in range(n):
                h = (self._next + k) % n
                if push[h] > ctl[ACK + h]:
                    found.append(h)
                    return True
            return False
        server.board.wait(ready)
        self._next = (found[0] + 1) % n
        return found[0]

    def took(self, served: dict) -> None:
        super().took(served)
        self.stale = served["stale"]

    def losses(self, served, host_losses):
        return served["losses"]

    def check(self, cluster) -> bool:
        return False  # hosts compute on weights of their own pace: never meant to agree

    def note(self) -> str:
        n, total, largest = self.stale
        return f"; gradient staleness mean {total / n:.2f}, max {largest}" if n else ""

    def results(self) -> dict:
        n, total, largest = self.stale
        return {"staleness_mean": total / n, "staleness_max": largest} if n else {}


class ParameterServer(Answering):
    """The server actor (see the module docstring): the run's weights, optimizer, EMA, schedule and position.

    ``cfg``: the run's settings (its steps resolved); ``model``: the driver's
    model; ``n_examples``: the training set's size (the schedule's and the
    position's); ``handle``: the board's; ``keeping``: the mode, whose
    ``serve`` runs the loop.
    """

    def __init__(self, cfg, model, n_examples: int, handle, keeping: ServerKeeping, niceness: int | None = None):
        if niceness is not None:
            same_priority(niceness)
        self.cfg, self.model, self.keeping, self.n_examples = cfg, model, keeping, n_examples
        self.answers = self
        # Examples behind one update: the schedule's and the input position's unit.
        self.per_update = keeping.towers_per_update() * cfg.batch_size * cfg.accumulate
        self.replica = Replica(model, numpy)
        self.replica.set_params(model.init_params(cfg.seed))  # every host's initial weights
        self.model_state = ModelState([self.replica], model)
        # Its optimizer's host form, current in ``serve`` and ``call``.
        self.forms = choose_forms(cfg.cpu_kernels, model, cpu_towers=True)
        self.cpu_kernels = self.forms.name
        self.ema = EMA(self.replica.params, cfg.ema_decay)
        self.optimizer = make_optimizer(cfg, self.replica.params, self.ema)  # the EMA follows every update
        with self.forms.active():
            self.optimizer.warm_up()
        self.schedule = make_schedule(cfg, n_examples, self.per_update)
        self.step = 0
        self.position = InputPosition(n_examples, self.per_update)
        total = sum(keeping.towers)
        self.shares = [numpy.float32(t / total) for t in keeping.towers]
        self.board = Board.attach(handle)
        self.ctl, self.push, self.pulled = self.board.cell("server"), self.board.cell("push"), self.board.cell("pulled")
        self.publish(bump=False)
        if self.replica.buffers.size:  # every host's row starts at the common initial buffers
            self.board["bufs"][...] = self.replica.buffers

    # -- updates --

    def serve(self, n: int) -> dict:
        """``n`` updates, as the mode serves them (``ServerKeeping.serve``), with the server's forms."""
        with self.forms.active():
            return self.keeping.serve(self, n)

    def call(self, method: str, *args):
        """``Answering.call`` with the server's forms current (its replica's evaluation, a load's copies)."""
        with self.forms.active():
            return super().call(method, *args)

    def apply(self, grads) -> None:
        """One update with the mean gradient ``grads`` (a host flat array): the optimizer's step (and the EMA's)
        at the schedule's rate; the model buffers become the hosts' latest, weighted; then published."""
        lr, step = self.schedule(self.step), self.step
        self.replica.grads[...] = grads  # kept: ``get_gradients`` gives the last one applied
        with numpy.errstate(**QUIET):
            self.optimizer.step(self.replica.grads, lr, step, None)
        self.step += 1
        if self.replica.buffers.size:
            rows = self.board["bufs"]
            mean = rows[0] * self.shares[0]
            for h in range(1, len(self.shares)):
                mean += rows[h] * self.shares[h]
            self.replica.set_buffers(mean)
        self.publish()

    def publish(self, bump: bool = True) -> None:
        """The weights and buffers onto the board under the sequence lock; ``bump``: one more update."""
        b, ctl = self.board, self.ctl
        ctl[SEQ] += 1
        b["weights"][...] = self.replica.params
        if self.replica.buffers.size:
            b["wbufs"][...] = self.replica.buffers
        ctl[SEQ] += 1
        if bump:  # the version counts updates applied on this board
            ctl[VERSION] += 1

    # -- the Executor protocol's questions of state, weights and evaluation (``call``) --

    def get_weights(self, ema: bool = False) -> dict:
        return self.model_state.named(self.ema.shadow if ema else None)

    def get_gradients(self) -> dict:
        return self.model_state.weights.split(self.replica.grads)

    def set_weights(self, weights: dict, ema: bool = False) -> None:
        self.model_state.set_named(weights, "set_weights", self.ema if ema else None)
        self.publish(bump=False)  # the hosts' next pull takes these weights

    def state_dict(self) -> dict:
        layout = self.model_state.weights
        return {**self.model_state.state_dict(), **self.ema.state_dict(layout), **self.optimizer.state_dict(layout),
                **self.position.state_dict(self.step), "step": numpy.int64(self.step), **self.keeping.state_dict(),
                "cpu_kernels": numpy.array(self.cpu_kernels)}

    def load_state_dict(self, state: dict, where: str) -> None:
        """Every part checks its keys first (nothing changes on a bad one), then all are set."""
        layout = self.model_state.weights
        set_model = self.model_state.prepare(state, where)
        ema = self.ema.read_state(state, layout, where)
        slots = self.optimizer.read_state(state, layout, where)
        position = self.position.read_state(state, where)
        step = count(state, "step", where)
        self.keeping.read_state(state, where)
        set_model()
        self.ema.set_state(ema)
        self.optimizer.set_state(slots)
        self.step, self.position = step, InputPosition(self.n_examples, self.per_update, step, position)
        self.publish(bump=False)  # the hosts' next pull takes these weights

    def evaluate(self, ema: bool, x, y, progress=None) -> dict:
        return self._scoring(ema).score(x, y, progress=progress)

    def predict(self, ema: bool, x, batch: int):
        return self._scoring(ema).predict(x, batch)

    def _scoring(self, ema: bool) -> Replica:
        r = self.replica
        return Replica.holding(self.model, numpy, self.ema.shadow if ema else r.params, r.buffers, self.cfg.input_scale)

    def finish(self) -> None:
        """Nothing to end: every update was applied whole."""

    def close(self) -> None:
        self.board.close()
