"""The local executor: this process's towers, their step engine and reducer, and its input.

``LocalExecutor(cfg, dataset, model, placement, reducer, share)`` builds one
``Tower`` per device (``towers.step.tower``), the reducer
(``towers.parallel.reducers``), the optimizers and the EMA (``towers.optim``)
and the ``StepEngine`` that runs a step over them (``towers.step.engine``)
with the sync mode's keeper (``towers.parallel.sync``).

Its input: the run's global batches from the seeded shuffle
(``towers.data.batches.BatchSource``), of which this process takes the rows
of its towers (``Rows``; all of them on one host), and the input position
(``InputPosition``), kept here once and saved as ``data/epoch`` and
``data/index``.  A host of a cluster is a ``Share`` of the run: its first
tower among every host's, the towers of each global batch drawn, and the
towers behind one update (which the schedule and the checkpoint count).

State: each part saves its own keys (``towers.state`` lists them).

Sync points: ``get_weights``, ``state_dict``, ``evaluate``, ``predict`` and
``check_replicas`` wait for the towers (``synchronize``); steps do not.
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy

from towers.arrays import to_host
from towers.config import steps_of_epochs
from towers.data.batches import BatchSource, InputPosition, Prefetcher, start_batch, workers_of
from towers.data.device_data import DeviceData, fits_on
from towers.devices import kernels, matmul
from towers.devices.cpu_threads import limit_blas
from towers.devices.placement import Placement
from towers.run.executor import Executor
from towers.nn.replica import Replica
from towers.optim.ema import EMA
from towers.optim.optimizers import make_optimizer
from towers.optim.schedule import make_schedule
from towers.output import checkpoint
from towers.parallel.reducers import Reducer, make_reducer
from towers.parallel.sync import MODES
from towers.run.profiling import PhaseTimer
from towers.step.engine import StepEngine, check_indices
from towers.step.tower import ModelState, build_towers


@dataclasses.dataclass(frozen=True)
class Share:
    """This process's part of a run of several hosts (None: the whole run).

    ``first_tower``: its first tower among every host's (dropout masks and
    batch rows are per global tower); ``draw_towers``: the towers of each
    global batch drawn from the shuffle; ``update_towers``: the towers behind
    one update (async: one host's), which the schedule and the checkpoint count;
    ``cores``: the cores of its machine that are its own, which its BLAS
    threads are sized from (0: every core it may run on; a CPU host that shares
    its machine with others gets its share, ``towers.cluster.driver.core_shares``).
    """

    first_tower: int
    draw_towers: int
    update_towers: int
    cores: int = 0


class Rows:
    """Rows ``lo:hi`` of each global batch that ``source`` draws (this process's towers' slices)."""

    def __init__(self, source: BatchSource, lo: int, hi: int):
        self.source, self.lo, self.hi = source, lo, hi

    @property
    def x(self):
        return self.source.x

    def next_indices(self):
        return self.source.next_indices()[self.lo: self.hi]

    def submit_batch(self):
        idx, epochs = self.source.next_positions()
        return start_batch(self.source.x, self.source.y, idx[self.lo: self.hi], epochs[self.lo: self.hi])

    def next_batch(self):
        return self.submit_batch().result()


class LocalExecutor(Executor):
    """This process's towers and input (see the module docstring)."""

    def __init__(self, cfg, dataset, model, placement: Placement, reducer=None, share: Share | None = None):
        self.cfg, self.dataset, self.model, self.placement = cfg, dataset, model, placement
        self._blas = self._tf32 = self.engine = self.reducer = self._prefetch = self.blas_threads = None
        self.towers = []
        n = len(placement.towers)
        self.share = share or Share(0, n, n)
        # `epochs` gives the step count, once the data's size and a step's examples are known (every host's).
        self.cfg = cfg = steps_of_epochs(cfg, len(dataset.x), self.examples_per_step)
        self._draw = self.share.draw_towers * self.tower_batch  # the run's global batch
        self._start_input(0, (0, 0))  # checks the batch fits, before any device memory
        try:
            self._build(reducer)
        except BaseException:
            self.close()  # what was made so far: BLAS limits, communicators, tower threads
            raise

    def _build(self, reducer) -> None:
        cfg, devices = self.cfg, self.placement.towers
        self.timer = PhaseTimer(cfg.profile, len(devices))
        keeping = MODES[cfg.sync].keeper  # how these towers stay together (towers.parallel.sync)
        # CPU towers share one parameter buffer when every replica applies the same
        # update (``build_towers``); a reducer handed in (NCCL ranks, a stand-in for
        # them) reduces every tower's own buffers, so its towers keep their own.
        self.towers = build_towers(self.placement, self.model, self.dataset, cfg, self.timer, self.share.first_tower,
                                   share=keeping.same_updates and reducer is None)
        # The forms of the ops the towers run, chosen by build_towers (a checkpoint records the CPU's): current
        # in each tower's scope and in the step engine's calls (the reducer, weights mode's average); evaluation
        # enters them itself (_scoring).
        self.forms = self.towers[0].forms
        self.cpu_kernels = self.forms.name
        streams = [t.stream for t in self.towers]
        self.timer.syncs = [s.synchronize if s is not None else None for s in streams]
        # GPU towers: a training set that fits stays on the devices (steps then
        # gather each batch there); kernels are compiled or loaded now, not in
        # the first step; `tf32` switches float32 matmuls to TF32 tensor cores.
        self.device_data = None
        gpus = sorted({d.index for d in devices if d.is_gpu})
        if gpus:
            if fits_on(devices, self.dataset):
                self.device_data = DeviceData(devices, streams, self.dataset, cfg.batch_size, cfg.accumulate,
                                              cfg.input_scale)
            for index in gpus:
                with devices[0].xp.cuda.Device(index):
                    kernels.warm_up()
            if cfg.tf32:
                self._tf32 = matmul.set_tf32(True)
        with devices[0].scope():
            self.ema = EMA(self.towers[0].replica.params, cfg.ema_decay)
        # In grads mode the EMA is fused into the first tower's update; in
        # weights mode it follows the averaged weights (``Keeping.fuses_ema``).
        for t in self.towers:
            with t.device.scope(), t.forms.active():
                fused = self.ema if t.index == 0 and keeping.fuses_ema else None
                # A tower that shares another's buffer is updated by that tower's optimizer.
                t.optimizer = None if t.shares_params else make_optimizer(cfg, t.replica.params, fused)
                if t.optimizer is not None:
                    t.optimizer.warm_up()  # its compiled CPU form, where chosen: loaded now, not in the first step
        # Devices were validated by placement.resolve before any communicator.
        if reducer is None:
            reducer = make_reducer(self.placement, streams)
        elif not isinstance(reducer, Reducer):
            reducer = reducer(self.placement, streams)
        self.reducer = reducer
        # CPU towers: concurrent threads sharing the cores but one between their
        # BLAS threads (or serial with all cores in BLAS); see
        # towers.devices.cpu_threads.blas_threads for why.  Threads need a reducer
        # that splits (not NCCL, not across hosts).  A cluster host's cores are its
        # share of its machine's (Share).
        n = len(devices)
        threads = False
        if not any(d.is_gpu for d in devices):
            threads = n > 1 and cfg.cpu_towers == "threads" and reducer.splittable
        self.blas_threads, self._blas = limit_blas(devices, cfg.blas_threads, threads, self.share.cores)
        self.schedule = make_schedule(cfg, len(self.dataset.x), self.examples_per_step)
        keeper = keeping.build(reducer, self.timer, self.ema, cfg)
        self.engine = StepEngine(self.towers, keeper, self.schedule, l2=cfg.l2, timer=self.timer, threads=threads,
                                 device_data=self.device_data, sync_bn=cfg.sync_bn, nccl_timeout=cfg.nccl_timeout)
        self.model_state = ModelState([t.replica for t in self.towers], self.model, [t.scope for t in self.towers])
        # What was built above (initial weights, the EMA's shadow, optimizer
        # slots, the training set on the devices) was copied on CuPy's legacy
        # default stream, which the towers' non-blocking streams are not
        # ordered with: wait for it once, so the first step reads whole values.
        for index in gpus:
            devices[0].xp.cuda.Device(index).synchronize()

    def _start_input(self, step: int, position) -> None:
        """The shuffle from ``position`` (epoch, index), reached after ``step`` steps."""
        lo = self.share.first_tower * self.tower_batch
        self._source = BatchSource(self.dataset, self._draw, self.cfg.seed, *position)
        self.rows = Rows(self._source, lo, lo + self.local_batch)
        self.position = InputPosition(len(self.dataset.x), self._draw, step, position)

    # -- sizes, counters ---------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.engine.step

    @property
    def n_towers(self) -> int:
        return self.share.update_towers

    @property
    def tower_batch(self) -> int:
        """Examples of one step on one tower: ``batch_size`` x ``accumulate`` (its micro-batches)."""
        return self.cfg.batch_size * self.cfg.accumulate

    @property
    def local_batch(self) -> int:
        """Examples of one step on this process's towers."""
        return self.tower_batch * len(self.placement.towers)

    @property
    def all_reduces(self) -> int:
        return self.engine.all_reduces

    @property
    def replicas(self) -> list[Replica]:
        return [t.replica for t in self.towers]

    @property
    def optimizers(self) -> list:
        return [t.optimizer for t in self.towers if t.optimizer is not None]

    @property
    def source(self) -> BatchSource:
        """The cursor this process's steps draw the run's global batches from (``rows`` keeps its towers' rows)."""
        return self._source

    def towers_text(self) -> str:
        return ", ".join(map(str, self.towers))

    def placement_text(self) -> str:
        return self.placement.table(self.cfg.allreduce_dtype, self.cfg.allreduce_bucket_mib, self.cfg.precision)

    def report(self, global_batch: int) -> str:
        return self.timer.report(global_batch)

    # -- steps -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def prefetching(self, last_step: int):
        if self.device_data is not None:  # rows are drawn (cheaply) at each step and gathered on the devices
            yield
            return
        self._prefetch = Prefetcher(self.rows, max(last_step - self.step, 0), workers=workers_of(self.rows.x))
        try:
            yield
        finally:
            self._prefetch.close()
            self._prefetch = None

    def run_steps(self, n: int, want_loss: bool = False):
        losses = x = None
        for k in range(n):
            want = want_loss and k == n - 1
            x = None
            if self.device_data is not None:
                losses = self.train_step_at(self.rows.next_indices(), want)
            else:
                if self._prefetch is not None:
                    with self.timer("input wait"):
                        x, y = self._prefetch.get()
                else:
                    x, y = self.rows.next_batch()
                losses = self.engine.run(x, y, want)
            if self.step == self.cfg.steps:
                self.finish()  # weights mode: a last average before the final checkpoint
        return losses, x

    def train_step(self, x, y, want_loss: bool = False):
        return self.engine.run(x, y, want_loss)

    def train_step_at(self, indices, want_loss: bool = False):
        """One step on the training-set rows ``indices`` (this process's towers' rows, host ints).

        With the data set on the devices (``device_data``) each tower gathers its
        slice there; otherwise the rows are taken on the host.  Either way the
        same float32 batch reaches each tower.
        """
        indices = check_indices(indices, self.local_batch, len(self.dataset.x))
        if self.device_data is None:
            return self.engine.run(self.dataset.x[indices], self.dataset.y[indices], want_loss)
        return self.engine.run(None, None, want_loss, indices)

    def next_gradients(self, want_loss: bool = False):
        losses = self.engine.gradients(*self.rows.next_batch(), want_loss)
        self.synchronize()
        reps = self.replicas
        bufs = to_host(reps[0].buffers, copy=True)
        for r in reps[1:]:  # forward passes may move each tower's buffers: their mean goes with the gradient
            bufs += to_host(r.buffers)
        if len(reps) > 1:
            bufs *= numpy.float32(1 / len(reps))
        return losses, to_host(reps[0].grads), bufs

    def set_flat(self, weights, buffers=None) -> None:
        self.model_state.set(weights, buffers)

    def finish(self) -> None:
        self.engine.finish()

    def check_replicas(self) -> bool:
        return self.engine.check_replicas()

    def synchronize(self) -> None:
        if self.engine is not None:
            self.engine.synchronize()

    # -- weights and state as name -> array dicts ----------------------------------------------

    def get_weights(self, ema: bool = False) -> dict:
        self.synchronize()
        return self.model_state.named(self.ema.shadow if ema else None)

    def get_gradients(self) -> dict:
        self.synchronize()
        return self.model_state.weights.split(self.towers[0].replica.grads)

    def set_weights(self, weights: dict, ema: bool = False) -> None:
        self.synchronize()
        # The EMA lives on tower 0's device: its stream orders the copy.
        self.model_state.set_named(weights, "set_weights", self.ema if ema else None, self.towers[0].scope)
        if not ema:
            self.engine.agreed()  # the next comparison is against these weights

    def state_dict(self) -> dict:
        self.synchronize()
        layout = self.model_state.weights
        state = {**self.model_state.state_dict(), **self.ema.state_dict(layout),
                 **self.towers[0].optimizer.state_dict(layout), **self.position.state_dict(self.step),
                 **self.engine.state_dict()}
        n = self.share.update_towers
        state.update(checkpoint.metadata(self.cfg, self.dataset, n, n * self.tower_batch, self.cpu_kernels))
        return state

    def load_state_dict(self, state: dict, where: str) -> None:
        layout = self.model_state.weights
        # Every part checks its keys first; then all are applied, so a bad key changes nothing.
        set_model = self.model_state.prepare(state, where)
        ema = self.ema.read_state(state, layout, where)
        slots = self.towers[0].optimizer.read_state(state, layout, where)
        position = self.position.read_state(state, where)
        set_counters = self.engine.prepare(state, where)
        self.synchronize()
        # Each copy on the stream of the tower that reads it next (its device, and
        # ordered before its next step: the towers' streams do not wait for the
        # legacy default stream).
        set_model()
        with self.towers[0].scope():
            self.ema.set_state(ema)
        for t in self.towers:
            if t.optimizer is not None:
                with t.scope():
                    t.optimizer.set_state(slots)
        set_counters()
        self._start_input(self.step, position)

    @contextlib.contextmanager
    def _scoring(self, ema: bool):
        """A replica of the first tower's weights (or the EMA's) and buffers, on its device, with its forms."""
        dev, first = self.towers[0].device, self.towers[0].replica
        self.synchronize()
        with dev.scope(), self.forms.active():
            yield Replica.holding(self.model, dev.xp, self.ema.shadow if ema else first.params, first.buffers,
                                  self.cfg.input_scale)

    def evaluate(self, ema: bool, x, y, progress=None) -> dict:
        with self._scoring(ema) as r:
            return r.score(x, y, progress=progress)

    def predict(self, ema: bool, x, batch: int):
        with self._scoring(ema) as r:
            return r.predict(x, batch)

    def train_accuracy(self) -> float | None:
        # Each tower's count was set in its thread before its loss was: a caller that holds the step's losses
        # reads whole counts (a device scalar each, fetched here: a sync point on a GPU).
        reps = self.replicas
        if any(r.train_correct is None for r in reps):
            return None
        return sum(int(r.train_correct) for r in reps) / max(sum(r.train_seen for r in reps), 1)

    def loss_scaling(self) -> dict:
        scaler = getattr(self.engine.keeper, "scaler", None)
        if scaler is None:
            return {}
        self.synchronize()  # the last step's decision made (tower threads finish their update)
        return {"loss_scale": scaler.scale, "skipped_steps": scaler.skipped}

    # -- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release tower threads, BLAS limits, NCCL communicators (idempotent)."""
        try:
            self.synchronize()
        finally:
            try:
                if self.engine is not None:
                    self.engine.close()
            finally:
                if self._blas is not None:
                    self._blas.restore_original_limits()
                if self.reducer is not None:
                    self.reducer.close()
                if self._tf32 is not None:
                    matmul.restore_compute_type(self._tf32)
                # nvmath's cuBLAS handles of these towers' streams (cuda_graphs), now that their work is done
                matmul.release_streams([t.stream.ptr for t in self.towers if t.stream is not None])
                self._blas = self._tf32 = self.reducer = None
