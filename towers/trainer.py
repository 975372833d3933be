"""The ``Trainer``: replicas on their devices, one training step, the training loop.

A training step (``Trainer.train_step``) on one global batch of
``n_towers * batch_size`` host examples runs four named stages per tower:

1. stage:      the tower's contiguous slice of the batch onto its device
               (``towers.data.staging``);
2. compute:    forward and backward into the tower's flat gradient buffer
               (``towers.nn.replica``);
3. all-reduce: the gradient buffers are averaged in place across towers
               (``towers.parallel.allreduce``: NCCL across GPUs, a mean on one
               device);
4. update:     every replica applies the same optimizer update; the first one
               also updates the EMA of the weights in the same pass
               (``towers.optim``).

Replicas start from the same seeded values and apply identical updates, so they
stay bit-identical.  GPU towers queue their stages on their GPU's stream, tower
after tower; CPU towers run them concurrently on tower threads
(``towers.devices.cpu_threads``), where tower thread i also does slice i of the
all-reduce and of every replica's update.  Both paths call the same stage
methods.  With ``sync="weights"`` stage 3 is skipped and the weights are
averaged every K steps instead (``towers.parallel.sync``).

Sync points: none inside a step on a GPU.  The loss reaches the host only when
asked for (``want_loss``), weights only through ``synchronize`` (called by
``get_weights``, checkpoints, summaries and evaluation).

``fit`` is the loop: the background batch thread feeds ``train_step`` (or, with
the training set on the GPUs, ``train_step_at`` gathers each batch there), and the
loop's side concerns (log line, non-finite stop, summaries, checkpoints, test
accuracy, replica check) are small objects called when due
(``towers.extensions``); a Python user can pass more.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy

from towers.config import Config
from towers.data.batches import BatchSource, Prefetcher
from towers.data.dataset import Dataset
from towers.data.device_data import DeviceData, fits_on
from towers.data.loading import load_dataset
from towers.data.staging import Stager
from towers.data.tfrecord.records import close_dataset
from towers.devices.cpu_threads import TowerThreads, chunks, cpu_count, input_workers, set_blas_threads
from towers.devices.placement import Placement, on_stream, resolve
from towers.errors import UserError
from towers.extensions import Run
from towers.nn import kernels
from towers.nn.models import build_model
from towers.nn.replica import Replica
from towers.optim.ema import EMA
from towers.optim.optimizers import make_optimizer
from towers.optim.schedule import learning_rate
from towers.output import checkpoint
from towers.parallel.allreduce import TowerAllReduce
from towers.parallel.sync import check_replicas
from towers.profiling import PhaseTimer, scaling_efficiency


_QUIET = dict(over="ignore", invalid="ignore", divide="ignore")


class Trainer:
    """Replicas, their streams, the all-reduce, the optimizers, the EMA and the loop.

    ``Trainer(cfg, model=None, dataset=None)``: ``model`` is a
    ``towers.Sequential`` or a list of layers (default: ``cfg.model``);
    ``dataset`` a ``towers.Dataset`` (default: loaded from ``cfg.data``).
    Settings are checked, then the placement, then the data, all before any
    device memory is allocated.  ``nccl`` replaces ``cupy.cuda.nccl`` (tests
    pass a host-memory stand-in).  Use it as a context manager, or ``close()``.

    Several hosts (``towers.cluster``): ``cross_host`` has ``average(buffers)``,
    called after every local average (gradients in grads mode, weights in
    weights mode) to make the mean over every host's towers; ``nccl_world``
    (``towers.parallel.allreduce.NcclWorld``) makes the GPU all-reduce itself
    span hosts instead.  Without them a Trainer is the one-host trainer.
    """

    def __init__(self, cfg: Config | None = None, *, model=None, dataset: Dataset | None = None,
                 nccl=None, placement: Placement | None = None, quiet_placement: bool = False,
                 cross_host=None, nccl_world=None):
        self._closed = True  # until device memory exists
        self.cross_host, self._nccl_world = cross_host, nccl_world
        self._owned_data = None
        self._pool = self._blas = self.allreduce = self._tf32 = None
        self.streams, self._nccl = [], nccl
        self.cfg = cfg = Config.resolved(cfg if cfg is not None else Config(), model)
        # -- placement: decided (and validated) before any device memory or NCCL.
        self.placement = placement or resolve(cfg.n_gpu, cfg.devices, cfg.soft_placement)
        if self.placement.notice and not quiet_placement:
            print(self.placement.notice, file=sys.stderr, flush=True)
        if cfg.log_placement and not quiet_placement:
            print(self.placement.table(), flush=True)
        # -- data (host): validated like a file, whatever its origin.
        if dataset is None:
            cpu_towers = sum(not d.is_gpu for d in self.placement.towers)
            dataset = load_dataset(cfg.data, cfg.x_key, cfg.y_key, cfg.test_data, decode=cfg.decode, on_error=cfg.on_error,
                                   workers=input_workers(cfg.input_workers, cpu_towers), augment=cfg.augment,
                                   normalize=cfg.normalize, image_size=cfg.image_size, seed=cfg.seed)
            self._owned_data = dataset  # its TFRecord workers end with this trainer
        elif not isinstance(dataset, Dataset):
            raise UserError(f"dataset must be a towers.Dataset (Dataset.from_arrays(x, y)), "
                            f"got {type(dataset).__name__}")
        self.dataset = dataset
        self.devices = self.placement.towers
        self.source = BatchSource(dataset, self.global_batch, cfg.seed)  # checks the batch fits
        self.model = build_model(model if model is not None else cfg.model, dataset.example_shape,
                                 dataset.num_classes, cfg.hidden)
        # -- replicas on their devices: from here on, device memory.
        self._closed = False
        try:
            self._build()
        except MemoryError:  # NumPy's and CuPy's out-of-memory errors both derive from it
            self.close()
            mib = self.model.size * 4 / 2**20
            raise UserError(f"not enough memory for {self.n_towers} replicas of a model of {self.model.size:,} "
                            f"parameters ({mib:,.0f} MiB each, plus gradients, optimizer state and "
                            "activations): use a smaller model (`hidden` for the mlp), a smaller `batch_size`, or fewer towers") from None
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        cfg, n = self.cfg, len(self.devices)
        init = self.model.init_params(cfg.seed)  # one draw: every replica starts identical
        self.streams, self.replicas, self.stagers = [], [], []
        by_device = {}
        for dev in self.devices:
            with dev.scope():
                # Non-blocking streams are not ordered with the legacy default
                # stream, so all of a tower's work stays inside its stream.  Towers
                # sharing a GPU share its stream: CuPy drives cuBLAS through one
                # handle per device, whose default workspace is not safe for
                # GEMMs running concurrently on two streams.
                stream = None
                if dev.is_gpu:
                    stream = by_device.get(dev.index) or dev.xp.cuda.Stream(non_blocking=True)
                    by_device[dev.index] = stream
                replica = Replica(self.model, dev.xp)
                replica.set_params(init)
            self.streams.append(stream)
            self.replicas.append(replica)
            self.stagers.append(Stager(dev, stream, cfg.batch_size, self.dataset.example_shape,
                                       self.dataset.x.dtype))
        # GPU towers: a training set that fits stays on the devices (fit() then
        # gathers each batch there); kernels are compiled or loaded now, not in
        # the first step; --tf32 switches float32 matmuls to TF32 tensor cores.
        self.device_data = None
        if any(d.is_gpu for d in self.devices):
            if fits_on(self.devices, self.dataset):
                self.device_data = DeviceData(self.devices, self.streams, self.dataset, cfg.batch_size)
            for index in sorted({d.index for d in self.devices if d.is_gpu}):
                with self.devices[0].xp.cuda.Device(index):
                    kernels.warm_up()
            if cfg.tf32:
                self._tf32 = kernels.set_tf32(True)
        with self.devices[0].scope():
            self.ema = EMA(self.replicas[0].params, cfg.ema_decay)
        # In grads mode the EMA is fused into the first tower's update; in
        # weights mode it follows the averaged weights (see towers.parallel.sync).
        self.weights_mode = cfg.sync == "weights"
        self.optimizers = []
        for i, (dev, r) in enumerate(zip(self.devices, self.replicas)):
            with dev.scope():
                fused = self.ema if i == 0 and not self.weights_mode else None
                self.optimizers.append(make_optimizer(cfg, r.params, fused))
        # Devices were validated by placement.resolve before this communicator.
        self.allreduce = TowerAllReduce(self.placement, self.streams, self._nccl, world=self._nccl_world)
        self.step = 0
        self.all_reduces = 0  # collectives issued, for the communication report
        self.last_average = None  # step count right after the last weight average
        self.n_averages = 0
        self._start = (0, self.source.position)  # (step, data position) the source started at
        self.timer = PhaseTimer(cfg.profile, n, [s.synchronize if s is not None else None for s in self.streams])
        self._tower_timers = [self.timer.for_tower(i) for i in range(n)]
        # CPU towers: concurrent threads with 1 BLAS thread each (or serial with
        # all cores in BLAS); see towers.devices.cpu_threads for why.
        if not any(d.is_gpu for d in self.devices):
            # (Not with an NCCL stand-in: its ranks are driven by one thread; not
            # across hosts: the cross-host mean takes the whole local mean.)
            threaded = (n > 1 and cfg.cpu_towers == "threads" and not self.allreduce.uses_nccl
                        and self.cross_host is None)
            self.blas_threads = cfg.blas_threads or (max(1, cpu_count() // n) if threaded else cpu_count())
            self._blas = set_blas_threads(self.blas_threads)
            if threaded:
                self._pool = TowerThreads(n)
                # Tower thread i averages and updates slice i of EVERY replica's
                # buffers, so the all-reduce and the update are split across cores.
                self._parts = [(part, [r.grads[part] for r in self.replicas])
                               for part in chunks(self.model.size, n)]
                self._losses = [None] * n

    # -- sizes and schedule ------------------------------------------------------------

    @property
    def n_towers(self) -> int:
        return len(self.placement.towers)

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.n_towers

    @property
    def examples_per_step(self) -> int:
        """Examples behind one update, which the schedule counts (every host's, on a cluster)."""
        return self.global_batch

    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.lr_at(self.step)

    def lr_at(self, step: int) -> float:
        """The learning rate of the step after ``step`` steps (counted in examples seen)."""
        seen = step * self.examples_per_step
        return learning_rate(self.cfg.lr, self.cfg.lr_decay, seen, len(self.dataset.x), self.cfg.staircase)

    # -- one step ------------------------------------------------------------------------

    def train_step(self, x, y, want_loss: bool = False):
        """One synchronous step on the host global batch ``x``, ``y``.

        Returns the towers' losses as device scalars when ``want_loss`` (else
        None).  With concurrent CPU towers the call returns while the other
        tower threads finish their share of the update; ``synchronize`` (and
        the next step) waits for it.
        """
        x, y = self._check_batch(x, y)
        lr, step = self.lr(), self.step
        if self._pool is not None:
            # The arguments are bound to this step's call, not stored on self:
            # without a barrier (weights mode) a late tower thread of the last
            # step could otherwise read this step's batch.
            self._pool.run(lambda i: self._tower_thread_step(i, x, y, want_loss, lr, step))
            if not self.weights_mode:
                self.all_reduces += 1  # one all-reduce, shared out in slices among the threads
            elif want_loss:
                self._pool.wait()  # no barrier in weights mode: wait for every tower's loss
            return self._step_done(list(self._losses) if want_loss else None)
        return self._gpu_step(x, y, None, want_loss)

    def _check_batch(self, x, y):
        """(x, y) as arrays if they are a host global batch as ``train_step`` needs it, else a UserError (cheap)."""
        if self._closed:
            raise UserError("this Trainer is closed: make a new one")
        # Lists (of examples, of labels) were taken before these checks: keep taking them.
        x = x if hasattr(x, "dtype") else numpy.asarray(x)
        y = y if hasattr(y, "dtype") else numpy.asarray(y)
        n, ds = self.global_batch, self.dataset
        if len(x) != n or len(y) != n:
            raise UserError(f"train_step takes one global batch of {n} examples and {n} labels "
                            f"({self.n_towers} towers x `batch_size` {self.cfg.batch_size}), got {len(x)} and {len(y)}")
        if tuple(x.shape[1:]) != ds.example_shape or x.dtype != ds.x.dtype:
            raise UserError(f"train_step: examples are {x.dtype} {tuple(x.shape[1:])}, the data set's are "
                            f"{ds.x.dtype} {ds.example_shape}")
        if not numpy.issubdtype(y.dtype, numpy.integer) or y.ndim != 1 or (
                len(y) and (int(y.min()) < 0 or int(y.max()) >= ds.num_classes)):
            raise UserError(f"train_step: labels must be integers 0..{ds.num_classes - 1}, "
                            f"got {y.dtype} {tuple(y.shape)}" + (f" from {y.min()} to {y.max()}" if y.size else ""))
        return x, y

    def train_step_at(self, indices, want_loss: bool = False):
        """One step on the training-set rows ``indices`` (one global batch, host ints).

        With the data set on the devices (``device_data``) each tower gathers its
        slice there; otherwise the rows are taken on the host and ``train_step``
        runs on them.  Either way the same float32 batch reaches each tower.
        """
        if self.device_data is None:
            return self.train_step(self.dataset.x[indices], self.dataset.y[indices], want_loss)
        if self._closed:
            raise UserError("this Trainer is closed: make a new one")
        indices = numpy.asarray(indices)
        n = len(self.dataset.x)
        if len(indices) != self.global_batch or not numpy.issubdtype(indices.dtype, numpy.integer) or (
                int(indices.min()) < 0 or int(indices.max()) >= n):  # the gather kernel does not check
            raise UserError(f"train_step_at takes one global batch of {self.global_batch} row numbers in "
                            f"0..{n - 1}, got {len(indices)} {indices.dtype} values")
        return self._gpu_step(None, None, indices, want_loss)

    def _gpu_step(self, x, y, indices, want_loss: bool):
        """GPU towers (or serial CPU towers): each stage queued tower by tower."""
        losses = self._gradients(x, y, want_loss, average=not self.weights_mode, indices=indices)
        lr, step = self.lr(), self.step
        for i in range(self.n_towers):
            self._update(i, i, lr, step)
        return self._step_done(losses if want_loss else None)

    def gradients(self, x, y, want_loss: bool = False):
        """Stages 1-3 without the update: every tower's ``grads`` ends as the mean gradient.

        For a parameter server (``towers.cluster``), which applies the update
        itself; returns the towers' losses as device scalars when ``want_loss``.
        """
        if len(x) != self.global_batch or len(y) != self.global_batch:
            raise UserError(f"gradients takes one global batch of {self.global_batch} examples, got {len(x)}")
        self.synchronize()
        losses = self._gradients(x, y, want_loss, average=True)
        return losses if want_loss else None

    def apply_gradients(self, grads) -> None:
        """Stage 4 with given mean gradients (one host array): every replica's update, then the step ends.

        For a parameter server (``towers.cluster.ps``), whose gradients come from elsewhere.
        """
        self.synchronize()
        lr, step = self.lr(), self.step
        for i, (dev, r) in enumerate(zip(self.devices, self.replicas)):
            with dev.scope(), on_stream(self.streams[i]):
                r.grads[...] = dev.xp.asarray(grads)
            self._update(i, i, lr, step)
        self._step_done(None)

    def _gradients(self, x, y, want_loss: bool, average: bool, indices=None):
        """Stages 1-3: every tower's gradients, averaged when ``average``."""
        if indices is not None:
            with self.timer("stage"):
                self.device_data.upload(indices)  # the step's indices: one copy per GPU
        losses = [self._stage_and_compute(i, x, y, want_loss, indices) for i in range(self.n_towers)]
        if average:
            with self.timer("all-reduce"):
                self._average([r.grads for r in self.replicas])
        return losses

    def _stage_and_compute(self, i: int, x, y, want_loss: bool, indices=None):
        """Stages 1-2 of tower ``i``: its slice onto its device, forward and backward.

        The slice comes from the host batch ``x``, ``y``, or from the device-resident
        data set as rows ``indices`` (uploaded by ``_gradients``).
        """
        b, t = self.cfg.batch_size, self.timer
        # A diverging run overflows to inf/NaN: NonFiniteStop reports it as one
        # line at the next loss check, so NumPy's RuntimeWarnings are noise.
        with self.devices[i].scope(), on_stream(self.streams[i]), numpy.errstate(**_QUIET):
            with t("stage", i):
                if indices is not None:
                    xs, ys = self.device_data.stage(i)
                else:
                    xs, ys = self.stagers[i].stage(x[i * b: (i + 1) * b], y[i * b: (i + 1) * b])
            return self.replicas[i].loss_and_grads(xs, ys, self.cfg.l2, want_loss, self._tower_timers[i])

    def _update(self, i: int, on: int, lr: float, step: int, part: slice | None = None) -> None:
        """Stage 4: replica ``i``'s update, issued by tower ``on`` (``part``: a slice of it)."""
        grads = self.replicas[i].grads if part is None else self._parts[on][1][i]
        with self.devices[i].scope(), on_stream(self.streams[i]), self.timer("update+EMA", on), \
                numpy.errstate(**_QUIET):
            self.optimizers[i].step(grads, lr, step, part)

    def _tower_thread_step(self, i: int, x, y, want_loss: bool, lr: float, step: int) -> None:
        """Tower ``i``'s share of a step on its own thread (concurrent CPU towers)."""
        self._losses[i] = self._stage_and_compute(i, x, y, want_loss)
        if self.weights_mode:  # each tower steps alone; averages happen every K steps
            self._update(i, i, lr, step)
            return
        with self.timer("barrier", i):
            self._pool.barrier.wait()  # every tower's gradients are complete
        part, grads = self._parts[i]
        with self.timer("all-reduce", i):
            self.allreduce.average(grads)
        for j in range(self.n_towers):
            self._update(j, i, lr, step, part)

    def _step_done(self, losses):
        self.step += 1
        # Weights mode: every K steps average the weights, then the EMA follows.
        if self.weights_mode and self.step % self.cfg.average_every == 0:
            with self.timer("all-reduce"):
                self.average_weights()
        self.timer.step_done()
        return losses

    def _average(self, buffers) -> None:
        if len(buffers) > 1 or self.allreduce.uses_nccl:
            self.allreduce.average(buffers)
            self.all_reduces += 1
        if self.cross_host is not None:  # then across hosts, into every tower's buffer
            self.cross_host.average(buffers)

    def average_weights(self) -> None:
        """Weights mode: average parameters (and optimizer state), then update the EMA."""
        if self._pool is not None:
            self._pool.wait()  # the tower threads' updates are complete
        self._average([r.params for r in self.replicas])
        for slot in self.optimizers[0].state:
            self._average([o.state[slot] for o in self.optimizers])
        self.n_averages += 1
        with self.devices[0].scope(), on_stream(self.streams[0]):
            self.ema.update(self.replicas[0].params, self.n_averages - 1)
        self.last_average = self.step

    def finish(self) -> None:
        """End of training: in weights mode, a last average if steps were taken since."""
        if self.weights_mode and self.last_average != self.step:
            self.average_weights()

    def check_replicas(self) -> bool:
        """Compare replicas now if they are meant to agree; return whether it ran."""
        if self.weights_mode and self.last_average != self.step:
            return False  # between averages replicas differ by design
        self.synchronize()
        atol = 0.0
        if self.weights_mode:  # an average leaves them equal up to the reducer's rounding
            atol = 1e-6 * max(1.0, float(abs(self.replicas[0].params).max()))
        check_replicas(self.replicas, self.step, atol)
        return True

    def synchronize(self) -> None:
        """Host sync point: tower threads and GPU streams finish what was issued."""
        if self._pool is not None:
            self._pool.wait()
        for s in self.streams:
            if s is not None:
                s.synchronize()

    # -- weights and state as name -> array dicts ------------------------------------------

    def get_weights(self, ema: bool = False) -> dict[str, numpy.ndarray]:
        """{name: float32 host copy}: the first replica's weights, or the EMA's."""
        if self._closed:
            raise UserError("this Trainer is closed: make a new one")
        self.synchronize()
        return checkpoint.flat_to_named(self.model, self.ema.shadow if ema else self.replicas[0].params)

    def set_weights(self, weights: dict, ema: bool = False) -> None:
        """Set every replica's weights (``ema=True``: the EMA's) from {name: array}.

        Every name of the model must be there with its shape, and no other, as
        finite real numbers: otherwise a ``UserError`` names the first bad one
        and nothing changes.
        """
        if self._closed:
            raise UserError("this Trainer is closed: make a new one")
        flat = checkpoint.named_to_flat(self.model, checkpoint.check_names(self.model, weights, "set_weights"))
        self.synchronize()
        targets = [self.ema.shadow] if ema else [r.params for r in self.replicas]
        devices = [self.devices[0]] if ema else self.devices
        for dev, buf in zip(devices, targets):
            with dev.scope():
                buf[...] = dev.xp.asarray(flat)
        if not ema:  # the next comparison is against these weights
            self.last_average = self.step

    def data_position(self) -> tuple[int, int]:
        """The input pipeline's position after ``self.step`` steps of ``fit``'s batches."""
        (step0, pos0), n = self._start, len(self.dataset.x)
        return checkpoint.advance(pos0, (self.step - step0) * self.global_batch, n)

    def state_dict(self) -> dict:
        """Everything a checkpoint holds, as {name: host array} (a host sync)."""
        self.synchronize()
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict, where: str = "load_state_dict") -> None:
        """Restore ``state_dict()`` output (or a checkpoint's arrays); strict about names."""
        checkpoint.load_state_dict(self, state, where)
        self._start = (self.step, self.data_position_from(state))
        self.source = BatchSource(self.dataset, self.global_batch, self.cfg.seed, *self._start[1])

    @staticmethod
    def data_position_from(state: dict) -> tuple[int, int]:
        return int(state["data/epoch"]), int(state["data/index"])

    # -- evaluation ------------------------------------------------------------------------

    def evaluate(self, ema: bool = True, x=None, y=None) -> dict:
        """{"loss", "accuracy"} on the test data (or ``x``, ``y``), EMA or raw weights.

        The loss is the mean cross-entropy without the L2 term.
        """
        if x is None:
            x, y = self.dataset.x_test, self.dataset.y_test
            if x is None:
                raise UserError("no test data: give x_test/y_test in `data`, or `test_data`")
        dev = self.devices[0]
        self.synchronize()
        with dev.scope():
            r = Replica(self.model, dev.xp)
            r.set_params(self.ema.shadow if ema else self.replicas[0].params)
            loss, acc = r.evaluate(x, y)
        return {"loss": loss, "accuracy": acc}

    def test_accuracy(self) -> dict:
        """{"test_accuracy", "test_accuracy_ema"} ({} without test data)."""
        if self.dataset.x_test is None:
            return {}
        return {"test_accuracy": self.evaluate(ema=False)["accuracy"],
                "test_accuracy_ema": self.evaluate(ema=True)["accuracy"]}

    def one_tower_rate(self, steps: int = 20, warmup: int = 2) -> float:
        """Examples/s of ONE tower on the first tower's device, same model and batch size.

        The denominator of the scaling efficiency: a short run of a fresh 1-tower
        trainer (its own BLAS setting, as a 1-tower run would have), timed after
        ``warmup`` steps, on batches drawn beforehand so input is not part of it.
        """
        cfg = dataclasses.replace(self.cfg, n_gpu=1, devices=None, profile=False, log_placement=False)
        one = Placement(towers=[self.devices[0]])
        with type(self)(cfg, dataset=self.dataset, placement=one, quiet_placement=True) as t:
            batches = [t.source.next_batch() for _ in range(min(warmup + steps, 64))]
            for x, y in batches[:warmup]:
                t.train_step(x, y)
            t.synchronize()
            t0 = time.perf_counter()
            for k in range(steps):
                t.train_step(*batches[warmup + k % (len(batches) - warmup)])
            t.synchronize()
            return steps * self.cfg.batch_size / (time.perf_counter() - t0)

    # -- the loop ----------------------------------------------------------------------------

    def fit(self, extensions=()) -> dict:
        """Train to ``cfg.steps`` (a total) as the command line does; return the final metrics.

        Writes into ``cfg.logdir`` (default ``runs/<timestamp>``): checkpoints,
        summaries, ``metrics.jsonl`` and ``final.npz``; resumes from its latest
        checkpoint with ``cfg.resume``.  ``extensions`` are called after the
        built-in ones (``towers.extensions.Extension``).
        """
        cfg = self.cfg
        run = Run.open(self, cfg.logdir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")), extensions)
        # Data on the devices: the indices are drawn here (cheap); else the
        # background thread assembles host batches ahead.
        prefetch = None if self.device_data else Prefetcher(self.source, max(cfg.steps - self.step, 0))
        try:
            run.start()
            self._loop(run, prefetch)
            self.check_replicas()  # always at the end: the saved weights are every replica's
            return run.finish()
        finally:
            if prefetch is not None:
                prefetch.close()
            run.close()

    def _loop(self, run: Run, prefetch: Prefetcher | None) -> None:
        """Steps up to ``cfg.steps``, the extensions after each.

        Without ``prefetch`` the data set is on the devices: the step's indices
        are drawn here (cheap) and each tower gathers its rows there.
        """
        while self.step < self.cfg.steps:
            want = run.wants_loss(self.step + 1)
            x = None
            if prefetch is None:
                losses = self.train_step_at(self.source.next_indices(), want_loss=want)
            else:
                with self.timer("input wait"):
                    x, y = prefetch.get()
                losses = self.train_step(x, y, want_loss=want)
            if self.step == self.cfg.steps:
                self.finish()  # weights mode: a last average before the final checkpoint
            run.after_step(losses, x)

    def towers_text(self) -> str:
        """Where the towers run, for the summary line."""
        return ", ".join(map(str, self.devices))

    def scaling(self, rate: float) -> tuple[float, float]:
        """(efficiency, 1-tower rate), the 1-tower rate measured only if asked for."""
        if not self.cfg.measure_scaling:
            return float("nan"), float("nan")
        if self.n_towers == 1:
            return 1.0, rate
        rate_1 = self.one_tower_rate()
        return scaling_efficiency(rate, self.n_towers, rate_1), rate_1

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Release tower threads, BLAS limits and NCCL communicators (idempotent)."""
        if self._owned_data is not None:
            close_dataset(self._owned_data)
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        finally:
            if self._pool is not None:
                self._pool.close()
            if self._blas is not None:
                self._blas.restore_original_limits()
            if self.allreduce is not None:
                self.allreduce.close()
            if self._tf32 is not None:
                kernels.restore_compute_type(self._tf32)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
