"""``ClusterExecutor``: the executor of a ``towers.Trainer`` over several hosts (``hosts`` > 1).

The driver is the command itself (or the user's process).  Its ``Trainer``
loads the data once to check it (before Ray starts) and to answer the
outputs' questions; this executor starts (or joins) Ray, starts one host
actor per host (``towers.cluster.hosts``: each loads the data itself and
draws its own share of every global batch), and makes the sync mode's
``HostKeeping`` by name (``towers.parallel.sync.MODES``), once, which wires
what the hosts meet on (``wire``: boards, an NCCL id, an exchange or a
parameter server, through this executor's ``board`` and ``start``) and is
handed to every host.  Everything that differs between sync modes is the
keeper's: this module has no branch on the mode.

Who calls whom:

* per step: nobody calls the driver.  Hosts step in their own loop; the
  cross-host mean runs inside each host's step (``towers.cluster.reduce``:
  shared memory on one node, the object store across nodes; NCCL on GPUs);
  ps/async hosts and the server meet on a shared-memory board;
* per segment (up to the next step where a log line, checkpoint, summary,
  replica check or user extension is due; the loop, ``towers.run.loop``, is one
  host's): the keeper's ``run_steps(n)``, ``run_steps`` on every host (and
  ``serve(n)`` on the server), waiting for all of them through ``wait``,
  which polls every ``POLL_S`` so a dead host is seen within a second;
* between segments, the ``Trainer``'s questions (weights, state,
  evaluation) go to the keeper's ``source`` (host 0, or the server; its
  ``state_dict``, never serialized by hand, with the run's metadata added
  here) through the actors' one generic ``call(method, *args)``, answered by
  the ``Executor`` protocol's method of that name.

The outputs are one host's: ``Run`` writes the same log lines, progress bar,
``metrics.jsonl``, TensorBoard and checkpoints, and the learning rate they
show comes from the same schedule.  A host or server that dies aborts the
shared boards (so the others stop waiting), and the run stops with one line
naming it (``TrainingError``); the last checkpoint stays and ``resume``
continues from it.  An actor that cannot start (an import or its ``__init__``
failing on its node) is named with its exception's own message instead.
"""
from __future__ import annotations

import os

import numpy

from towers.cluster import session
from towers.cluster.board import Aborted, Board
from towers.cluster.state import cluster_state
from towers.config import steps_of_epochs
from towers.data.batches import BatchSource
from towers.errors import TrainingError, UserError
from towers.errors import notice as say_notice
from towers.run.executor import Executor
from towers.optim.schedule import make_schedule
from towers.parallel.sync import MODES

POLL_S = 0.2
DEATH_WAIT_S = 5.0  # after a failure: how long the other hosts' errors may take to show which host died


def core_shares(host_info: list[dict]) -> list[int]:
    """Each host's share of its machine's cores (0: the one-host rule), from the hosts' ``describe()``.

    CPU hosts on one machine split its cores less one, as one host's towers
    split them (``towers.devices.cpu_threads.blas_threads``: the spare core is
    the machine's, left once), at least one each: each host's BLAS is sized
    from its share (``towers.run.local.Share``) instead of every host taking them
    all (each sgemm's threads would spin against the other host's).  A host
    alone on its machine, and GPU hosts, get 0: one host's rule.  With one BLAS
    thread a tower either way, N hosts x 1 tower equal 1 host x N towers bit for
    bit (docs/hosts.md).
    """
    crowd: dict = {}
    for info in host_info:
        if info["cpu"]:
            crowd[info["node_id"]] = crowd.get(info["node_id"], 0) + 1
    return [max(1, (info["cores"] - 1) // crowd[info["node_id"]]) if info["cpu"] and crowd[info["node_id"]] > 1 else 0
            for info in host_info]


class ClusterExecutor(Executor):
    """Host actors on Ray behind a ``Trainer`` (see the module docstring).

    ``model``: the driver's ``Model``; ``model_arg``, ``dataset``: as given to
    the ``Trainer`` (a model object, a ``Dataset``, or None: each host makes
    or loads its own); ``nccl``: a module (or its import name) standing in for
    ``cupy.cuda.nccl`` in the host actors.

    What the sync mode's keeper uses of it: ``cfg`` (its steps resolved),
    ``model``, ``n_examples``, ``hosts``, ``host_info``, ``one_node``,
    ``step``, ``all_reduces``, ``wait``, ``board`` and ``start``.
    """

    def __init__(self, trainer_class, cfg, driver_data, model, model_arg=None, dataset=None, nccl=None):
        self._trainer_class = trainer_class  # what each host builds (no import: a cycle)
        self._ray, self.hosts, self._actors, self._members = None, [], [], []
        self._boards, self._owned, self._closed, self._source, self._draws = [], False, False, None, None
        self.cfg, self.model, self.dataset, self.n_examples = cfg, model, driver_data, len(driver_data.x)
        self._step = 0
        try:
            self._ray, self._owned = session.connect(cfg.ray_address, cfg.ray_logs, cfg.hosts)
            self._start(model_arg, dataset, getattr(nccl, "__name__", nccl))
        except BaseException:
            self.close()
            raise
        self.schedule = make_schedule(self.cfg, self.n_examples, self.examples_per_step)

    # -- start-up --------------------------------------------------------------------------

    def _start(self, model, dataset, nccl_name) -> None:
        from towers.cluster.hosts import Host

        ray, cfg, n = self._ray, self.cfg, self.cfg.hosts
        towers = cfg.n_gpu or (len(cfg.devices.split(",")) if cfg.devices and cfg.devices != "cpu" else 1)
        gpus = session.gpus_per_host(ray, n, towers, cfg.devices, cfg.soft_placement)
        host_cfg = cfg if gpus else _replace(cfg, devices="cpu", n_gpu=towers)
        self._env = env = session.actor_env(ray, self._owned)
        opts = {"num_cpus": 1, "num_gpus": gpus, "max_restarts": 0, "runtime_env": env}
        group = session.spread(ray, n, gpus) if cfg.ray_address is not None else None
        actor = ray.remote(Host)
        for h in range(n):
            if group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=h)
            self.hosts.append(actor.options(**opts).remote(host_cfg, h, nccl_name, os.getpriority(os.PRIO_PROCESS, 0)))
        self._members = list(self.hosts)
        self.host_info = self.wait([(a.describe.remote(), h) for h, a in enumerate(self.hosts)])
        notice = self.host_info[0]["notice"]
        if gpus == 0 and int(ray.cluster_resources().get("GPU", 0)) and cfg.devices != "cpu":
            notice = f"{n} hosts x {towers} GPUs asked for, the Ray cluster has fewer GPUs: hosts run on the CPU"
        if notice:  # the same notice one host gives, through the same logger
            say_notice(notice)
        self.towers_per_host = [i["towers"] for i in self.host_info]
        here = ray.get_runtime_context().get_node_id()
        self.one_node = all(i["node_id"] == here for i in self.host_info)
        self.keeping = MODES[cfg.sync].host_keeping()(cfg, self.towers_per_host)
        self._recorded = self.keeping.recorded_settings(host_cfg, cfg)  # what a checkpoint's `config` says
        # `epochs` gives the step count once the hosts' towers are known; each host derives the same from its
        # share (the run's examples per update), so the hosts get `epochs` as given.
        self.cfg = steps_of_epochs(cfg, self.n_examples, self.examples_per_step)
        self.keeping.wire(self)
        self._source = self.keeping.source(self)
        data = ray.put(dataset) if dataset is not None else None
        # All at once: NCCL communicators are made only when every rank has joined.
        cores = core_shares(self.host_info)
        refs = [(a.build.remote(self._trainer_class, model, data, self.keeping, cores[h]), h)
                for h, a in enumerate(self.hosts)]
        self.wait(refs + [(a.__ray_ready__.remote(), None) for a, _ in self._actors])

    def board(self, spec, counters):
        """A shared-memory board of this run (``towers.cluster.board``), aborted on a failure, closed at the end;
        its handle, which the actors attach to."""
        board = Board.create(spec, counters)
        self._boards.append(board)
        return board.handle

    def start(self, actor_class, *args, who: str, member: bool = False):
        """An actor of this run besides the hosts, on no CPU of its own, named ``who`` when it dies; a
        ``member`` answers ``call`` (``set_weights``, ``load_state_dict`` and ``finish`` reach it with the
        hosts)."""
        actor = self._ray.remote(actor_class).options(num_cpus=0, max_restarts=0, runtime_env=self._env).remote(*args)
        self._actors.append((actor, who))
        if member:
            self._members.append(actor)
        return actor

    # -- sizes, counters ---------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self._step

    @property
    def n_towers(self) -> int:
        return self.keeping.towers_per_update()

    @property
    def running_towers(self) -> int:
        """Every host's towers (with async an update is one host's, ``n_towers``, but all of them run)."""
        return sum(self.towers_per_host)

    @property
    def all_reduces(self) -> int:
        """Host 0's collectives (with a server: only among its own towers)."""
        return self.wait([(self.hosts[0].counters.remote(), 0)])[0]["all_reduces"]

    def communication(self) -> tuple[int, str]:
        """The mode's: the collectives, or the hosts' gradients a parameter server applied."""
        return self.keeping.communication(self)

    @property
    def source(self) -> BatchSource:
        """The run's global batches from the first, drawn here (every host's towers' rows; the hosts draw their
        own)."""
        if self._draws is None:
            rows = sum(self.towers_per_host) * self.cfg.batch_size * self.cfg.accumulate
            self._draws = BatchSource(self.dataset, rows, self.cfg.seed)
        return self._draws

    def towers_text(self) -> str:
        hosts = " | ".join(", ".join(i["devices"]) for i in self.host_info)
        t = self.towers_per_host[0]
        return f"{len(self.towers_per_host)} hosts x {t} tower{'s' if t > 1 else ''}: {hosts}{self.keeping.note()}"

    def placement_text(self) -> str:
        return self.towers_text()

    def report(self, global_batch: int) -> str:
        return self.wait([(self.hosts[0].call.remote("report", global_batch), 0)])[0]

    def results(self) -> dict:
        return self.keeping.results()

    # -- talking to the actors ----------------------------------------------------------------

    def wait(self, refs_hosts):
        """Results of [(ref, host or None)], in order; a failure aborts the boards and names the host."""
        if self._closed:
            raise UserError("this Trainer is closed: make a new one")
        ray = self._ray
        refs = [r for r, _ in refs_hosts]
        pending = list(refs)
        try:
            while pending:  # poll: a host blocked on a dead one must not hide it
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
                ray.get(ready)
            return ray.get(refs)
        except ray.exceptions.RayError as e:
            refused = self._refused(refs_hosts)
            if refused is not None:  # every host refused the call's input and changed nothing: the run goes on
                raise refused from None
            for b in self._boards:
                b.abort()  # the hosts still waiting on a board stop now
            raise self._explain(e, refs_hosts) from None

    def _refused(self, refs_hosts) -> UserError | None:
        """The ``UserError`` of a call every host refused (``set_weights``, ``load_state_dict`` of bad input: each
        checks it before changing anything), once every host has answered; None for any other failure, or when a
        host is still busy (it may be waiting on a board for the one that failed)."""
        ray = self._ray
        refs = [r for r, _ in refs_hosts]
        _, busy = ray.wait(refs, num_returns=len(refs), timeout=DEATH_WAIT_S)
        if busy:
            return None
        causes = []
        for r in refs:
            try:
                ray.get(r)
            except ray.exceptions.RayError as err:
                causes.append(getattr(err, "cause", None))
            else:
                return None  # a host took it: the hosts no longer agree, as any other failure
        return causes[0] if all(isinstance(c, UserError) for c in causes) else None

    def _explain(self, e, refs_hosts) -> Exception:
        """The one line for a failure: the dead host (preferred), a host's own error, or Ray's first line."""
        ray = self._ray
        _, rest = ray.wait([r for r, _ in refs_hosts], num_returns=len(refs_hosts), timeout=DEATH_WAIT_S)
        errors = [(e, None)]
        for r, h in refs_hosts:
            if r not in rest:
                try:
                    ray.get(r)
                except ray.exceptions.RayError as other:
                    errors.append((other, h))
        for err, _ in errors:
            if isinstance(err, ray.exceptions.RayActorError):
                line = self._dead(err)
                if line:
                    return TrainingError(line)
        causes = [(getattr(err, "cause", None), h) for err, h in errors]
        causes = [(c, h) for c, h in causes if c is not None and not isinstance(c, Aborted)]
        for cause, _ in causes:
            if isinstance(cause, (UserError, TrainingError)):
                return cause
        if causes:  # a failure inside an actor: its own exception's first line, never Ray's banner
            cause, h = causes[-1]
            first = (str(cause).strip().splitlines() or [""])[0]
            who = f"host {h}" if h is not None else "an actor"
            return TrainingError(f"{who} failed at step {self.step}: {type(cause).__name__}: {first}")
        first = (strip_ansi(str(e)).strip().splitlines() or [type(e).__name__])[0]
        return TrainingError(f"the Ray cluster failed at step {self.step}: {first}")

    def _dead(self, err) -> str | None:
        """The line for an actor of this run that ``err`` (a ``RayActorError``) says died, or could not start:
        then its own exception, which Ray gives only as the text of the creation task's traceback (an import
        that fails on the node, an error in its ``__init__``): a failure to start has no checkpoint to keep."""
        actor_id = getattr(err, "actor_id", None)
        who = None
        for h, a in enumerate(self.hosts or []):
            if actor_id is not None and a._actor_id.hex() == actor_id:  # noqa: SLF001 - Ray's only id
                info = self.host_info[h] if getattr(self, "host_info", None) else {}
                who = f"host {h}" + (f" ({info['node']}, pid {info['pid']})" if info else "")
        for a, name in self._actors:
            if actor_id is not None and a._actor_id.hex() == actor_id:  # noqa: SLF001
                who = name
        if who is None:
            return None
        if getattr(err, "actor_init_failed", False):
            return f"{who} could not start: {raised(strip_ansi(str(err)))}"
        keep = "its last checkpoint is kept, rerun with `resume` to continue from it"
        return f"{who} died at step {self.step}: run stopped; {keep}"

    def _all(self, method: str, *args):
        """``method(*args)`` of every host's executor (and of every member actor: a server), together."""
        return self.wait([(a.call.remote(method, *args), h if h < len(self.hosts) else None)
                          for h, a in enumerate(self._members)])

    def _source_call(self, method: str, *args):
        """``method(*args)`` of whoever holds the run's state (the keeper's ``source``: host 0, or the server)."""
        return self.wait([(self._source.call.remote(method, *args), None)])[0]

    # -- steps ------------------------------------------------------------------------------

    def run_steps(self, n: int, want_loss: bool = False):
        """``n`` steps of the run, as its keeper runs a segment; (the last step's losses when asked, None)."""
        if n <= 0:
            return None, None
        losses = self.keeping.run_steps(self, n, want_loss)
        self._step += n
        return losses, None

    def train_step(self, x, y, want_loss: bool = False):
        """Each host's towers take their slice of the global batch ``x``, ``y`` (host order, then tower order);
        a mode whose server applies the hosts' gradients refuses it."""
        losses = self.keeping.train_step(self, x, y, want_loss)
        self._step += 1
        return losses

    def finish(self) -> None:
        """Hosts end training themselves when they reach ``steps``; after ``train_step`` calls, on request."""
        self._all("finish")

    def synchronize(self) -> None:
        """Nothing runs between segments: the hosts are idle when the driver asks them anything."""

    # -- weights, state, evaluation -------------------------------------------------------

    def get_weights(self, ema: bool = False) -> dict[str, numpy.ndarray]:
        return self._source_call("get_weights", ema)

    def get_gradients(self) -> dict[str, numpy.ndarray]:
        """The mean gradient of the last update: host 0's after its all-reduce, or the one the server applied."""
        return self._source_call("get_gradients")

    def set_weights(self, weights: dict, ema: bool = False) -> None:
        """Every host's (and the server's) weights; each checks them as one host does."""
        self._all("set_weights", weights, ema)

    def state_dict(self) -> dict:
        """The state of whoever holds it, with the run's metadata (``towers.cluster.state.cluster_state``)."""
        return cluster_state(self._source_call("state_dict"), self._recorded, self.dataset, self.n_towers)

    def load_state_dict(self, state: dict, where: str) -> None:
        """Every host (and the server) loads ``state``; each checks it strictly, as one host does."""
        self._all("load_state_dict", state, where)
        self._step = int(numpy.asarray(state["step"]))

    def train_accuracy(self) -> float | None:
        """The mean of the hosts' own (each counts its towers' examples of the last step whose losses were asked
        for: the same number on every host); None where a host did not count."""
        values = self.wait([(a.call.remote("train_accuracy"), h) for h, a in enumerate(self.hosts)])
        return None if any(v is None for v in values) else sum(values) / len(values)

    def evaluate(self, ema: bool, x, y, progress=None) -> dict:
        result = self._source_call("evaluate", ema, x, y)
        if progress is not None:  # host 0 (or the server) evaluates: its chunks are not seen from here
            progress(len(x))
        return result

    def predict(self, ema: bool, x, batch: int):
        return self._source_call("predict", ema, x, batch)

    def check_replicas(self) -> bool:
        """The keeper's check: each host's towers, then every host against host 0 (or the server); whether it
        ran (async: never, by design)."""
        return self.keeping.check(self)

    def cross_host_seconds(self) -> list[tuple[float, int]] | None:
        """(seconds, calls) each host spent in the cross-host mean (CPU hosts; the benchmark reads it); None: the
        mode has no cross-host mean (a parameter server)."""
        counters = self.wait([(a.counters.remote(), h) for h, a in enumerate(self.hosts)])
        if counters[0]["cross_seconds"] is None:
            return None
        return [(c["cross_seconds"], c["cross_calls"]) for c in counters]

    def host_blas_threads(self) -> list[int | None]:
        """Each host's BLAS threads (None: a GPU host, which sets none)."""
        return [c["blas_threads"] for c in self.wait([(a.counters.remote(), h) for h, a in enumerate(self.hosts)])]

    def host_pids(self) -> list[int]:
        return [i["pid"] for i in self.host_info]

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the actors, the boards and the Ray instance this executor started (idempotent)."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        try:
            if ray is not None:
                for b in self._boards:
                    b.abort()
                for a in self.hosts + [a for a, _ in self._actors]:
                    ray.kill(a)
                if self._owned:
                    session.disconnect(ray)
        finally:
            for b in self._boards:
                b.close()
            self._boards, self.hosts, self._actors, self._members, self._ray = [], [], [], [], None


def raised(traceback_text: str) -> str:
    """The exception at the end of a Python traceback's text, on one line (``ModuleNotFoundError: No module
    named 'towers'``): from its last line that starts with an exception's name, the text after it joined."""
    import re

    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    starts = [k for k, line in enumerate(lines) if re.match(r"[A-Za-z_][\w.]*: ", line)]
    if not starts:
        return lines[-1].strip() if lines else "no reason given"
    name, _, message = " ".join(line.strip() for line in lines[starts[-1]:]).partition(": ")
    return f"{name.rsplit('.', 1)[-1]}: {message}"


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes (Ray colours the names in its messages)."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)
