"""The ``Trainer``: the public API of one host's run, composed of its parts.

``Trainer(cfg)`` checks the settings (``towers.config``), resolves the
placement (``towers.devices.placement``), loads the data
(``towers.data.loading``), builds the model (``towers.nn.models``), one
``Tower`` per device (``towers.step.tower``), the reducer
(``towers.parallel.reducers``), the optimizers and the EMA (``towers.optim``),
and the ``StepEngine`` that runs a step over them (``towers.step.engine``).
It then answers the questions a user asks of a run: steps (``train_step``),
weights (``get_weights``/``set_weights``), state (``state_dict``/
``load_state_dict``), evaluation (``evaluate``), and the loop (``fit``, in
``towers.loop``).

State: each part saves its own keys (``towers.state`` lists them); the
trainer's state dict is their union plus the checkpoint format's metadata.

Sync points: ``get_weights``, ``state_dict``, ``evaluate`` and
``check_replicas`` wait for the towers (``synchronize``); steps do not.

Several hosts are not a ``Trainer``: ``Config(hosts=2)`` goes to
``towers.ClusterTrainer`` (``towers.cluster``), which runs one ``Trainer``
per host and has the same public API.
"""
from __future__ import annotations

import numpy

from towers.config import Config
from towers.data.batches import BatchSource, InputPosition
from towers.data.dataset import Dataset
from towers.data.device_data import DeviceData, fits_on
from towers.data.loading import load_dataset
from towers.devices.cpu_threads import cpu_count, input_workers, set_blas_threads
from towers.devices.placement import Placement, resolve
from towers.errors import UserError, notice
from towers.nn import kernels
from towers.nn.models import build_model
from towers.nn.replica import Replica
from towers.optim.ema import EMA
from towers.optim.optimizers import SLOTS, make_optimizer
from towers.optim.schedule import make_schedule
from towers.output import checkpoint
from towers.parallel.reducers import Reducer, make_reducer
from towers.profiling import PhaseTimer
from towers.step.engine import StepEngine, check_indices
from towers.step.tower import ModelState, build_towers


class Trainer:
    """One host's towers, their step engine, weights, state, evaluation and loop.

    ``Trainer(cfg, model=None, dataset=None, reducer=None, placement=None)``:
    ``model`` is a ``towers.Sequential`` or a list of layers (default:
    ``cfg.model``); ``dataset`` a ``towers.Dataset`` (default: loaded from
    ``cfg.data``); ``reducer`` a ``towers.parallel.reducers.Reducer``, or a
    function ``(placement, streams) -> Reducer`` (default: ``make_reducer``;
    tests pass one over the NCCL stand-in, the cluster its cross-host mean);
    ``placement`` a resolved ``Placement`` (default: from ``cfg``).

    Settings are checked, then the placement, then the data, all before any
    device memory is allocated; a bad one is a ``UserError`` naming it.
    Notices (soft placement) go to the ``towers`` logger.  Use it as a context
    manager, or ``close()``.
    """

    def __init__(self, cfg: Config | None = None, *, model=None, dataset: Dataset | None = None,
                 reducer=None, placement: Placement | None = None, first_tower: int = 0):
        self._closed = True  # until device memory exists
        self._first_tower = first_tower  # this host's first tower among every host's (a cluster's hosts)
        self._owned_data = self._blas = self._tf32 = self.engine = None
        self.reducer: Reducer | None = None
        self.cfg = cfg = Config.resolved(cfg if cfg is not None else Config(), model)
        if cfg.hosts > 1:
            raise UserError(f"`hosts` {cfg.hosts} runs on Ray: use towers.ClusterTrainer(cfg), which has this "
                            "API (towers.Trainer is one host's towers)")
        # -- placement: decided (and validated) before any device memory or NCCL.
        self.placement = placement or resolve(cfg.n_gpu, cfg.devices, cfg.soft_placement)
        if self.placement.notice:
            notice(self.placement.notice)
        # -- data (host): validated like a file, whatever its origin.
        if dataset is None:
            cpu_towers = sum(not d.is_gpu for d in self.placement.towers)
            dataset = load_dataset(cfg.data, cfg.x_key, cfg.y_key, cfg.test_data, decode=cfg.decode,
                                   on_error=cfg.on_error, workers=input_workers(cfg.input_workers, cpu_towers),
                                   augment=cfg.augment, normalize=cfg.normalize, image_size=cfg.image_size,
                                   seed=cfg.seed)
            self._owned_data = dataset  # its TFRecord workers end with this trainer
        elif not isinstance(dataset, Dataset):
            raise UserError(f"dataset must be a towers.Dataset (Dataset.from_arrays(x, y)), "
                            f"got {type(dataset).__name__}")
        self.dataset = dataset
        self.source = BatchSource(dataset, self.global_batch, cfg.seed)  # checks the batch fits
        self.position = InputPosition(len(dataset.x), self.global_batch)
        self.model = build_model(model if model is not None else cfg.model, dataset.example_shape,
                                 dataset.num_classes, cfg.hidden)
        # -- towers on their devices: from here on, device memory.
        self._closed = False
        try:
            self._build(reducer)
        except MemoryError:  # NumPy's and CuPy's out-of-memory errors both derive from it
            self.close()
            mib = self.model.size * 4 / 2**20
            raise UserError(f"not enough memory for {self.n_towers} replicas of a model of {self.model.size:,} "
                            f"parameters ({mib:,.0f} MiB each, plus gradients, optimizer state and "
                            "activations): use a smaller model (`hidden` for the mlp), a smaller `batch_size`, "
                            "or fewer towers") from None
        except BaseException:
            self.close()
            raise

    def _build(self, reducer) -> None:
        cfg, devices = self.cfg, self.placement.towers
        self.timer = PhaseTimer(cfg.profile, len(devices))
        self.towers = build_towers(self.placement, self.model, self.dataset, cfg, self.timer, self._first_tower)
        streams = [t.stream for t in self.towers]
        self.timer.syncs = [s.synchronize if s is not None else None for s in streams]
        # GPU towers: a training set that fits stays on the devices (fit() then
        # gathers each batch there); kernels are compiled or loaded now, not in
        # the first step; `tf32` switches float32 matmuls to TF32 tensor cores.
        self.device_data = None
        if any(d.is_gpu for d in devices):
            if fits_on(devices, self.dataset):
                self.device_data = DeviceData(devices, streams, self.dataset, cfg.batch_size)
            for index in sorted({d.index for d in devices if d.is_gpu}):
                with devices[0].xp.cuda.Device(index):
                    kernels.warm_up()
            if cfg.tf32:
                self._tf32 = kernels.set_tf32(True)
        with devices[0].scope():
            self.ema = EMA(self.towers[0].replica.params, cfg.ema_decay)
        # In grads mode the EMA is fused into the first tower's update; in
        # weights mode it follows the averaged weights (towers.parallel.sync).
        weights_mode = cfg.sync == "weights"
        for t in self.towers:
            with t.device.scope():
                fused = self.ema if t.index == 0 and not weights_mode else None
                t.optimizer = make_optimizer(cfg, t.replica.params, fused)
        # Devices were validated by placement.resolve before any communicator.
        if reducer is None:
            reducer = make_reducer(self.placement, streams)
        elif not isinstance(reducer, Reducer):
            reducer = reducer(self.placement, streams)
        self.reducer = reducer
        # CPU towers: concurrent threads with 1 BLAS thread each (or serial with
        # all cores in BLAS); see towers.devices.cpu_threads for why.  Threads
        # need a reducer that splits (not NCCL, not across hosts).
        n = len(devices)
        threads = False
        if not any(d.is_gpu for d in devices):
            threads = n > 1 and cfg.cpu_towers == "threads" and reducer.splittable
            self.blas_threads = cfg.blas_threads or (max(1, cpu_count() // n) if threads else cpu_count())
            self._blas = set_blas_threads(self.blas_threads)
        self.schedule = make_schedule(cfg, len(self.dataset.x), self.examples_per_step)
        self.engine = StepEngine(self.towers, reducer, self.ema, self.schedule, l2=cfg.l2, weights_mode=weights_mode,
                                 average_every=cfg.average_every, timer=self.timer, threads=threads,
                                 device_data=self.device_data, sync_bn=cfg.sync_bn)
        self.model_state = ModelState(self.towers, self.model)

    # -- sizes, schedule, counters -------------------------------------------------------

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

    @property
    def step(self) -> int:
        """Updates done so far."""
        return self.engine.step

    @property
    def all_reduces(self) -> int:
        """Collectives issued by this trainer's reducer, for the communication report."""
        return self.engine.all_reduces

    @property
    def replicas(self) -> list[Replica]:
        return [t.replica for t in self.towers]

    @property
    def optimizers(self) -> list:
        return [t.optimizer for t in self.towers]

    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.lr_at(self.step)

    def lr_at(self, step: int) -> float:
        """The learning rate of the step after ``step`` steps (``towers.optim.schedule``)."""
        return self.schedule(step)

    # -- steps -----------------------------------------------------------------------------

    def _open(self) -> None:
        if self._closed:
            raise UserError("this Trainer is closed: make a new one")

    def train_step(self, x, y, want_loss: bool = False):
        """One synchronous step on the host global batch ``x``, ``y`` (``towers x batch_size`` examples).

        Returns the towers' losses as device scalars when ``want_loss`` (else
        None).  With concurrent CPU towers the call returns while the other
        tower threads finish their share of the update; ``synchronize`` (and
        the next step) waits for it.
        """
        self._open()
        x, y = self._check_examples(x, y, "train_step", self.global_batch)
        return self.engine.run(x, y, want_loss)

    def train_step_at(self, indices, want_loss: bool = False):
        """One step on the training-set rows ``indices`` (one global batch, host ints).

        With the data set on the devices (``device_data``) each tower gathers its
        slice there; otherwise the rows are taken on the host and ``train_step``
        runs on them.  Either way the same float32 batch reaches each tower.
        """
        self._open()
        if self.device_data is None:
            return self.train_step(self.dataset.x[indices], self.dataset.y[indices], want_loss)
        indices = check_indices(indices, self.global_batch, len(self.dataset.x))
        return self.engine.run(None, None, want_loss, indices)

    def gradients(self, x, y, want_loss: bool = False):
        """Stages 1-3 without the update (for a parameter server): every tower's ``grads`` ends as the mean."""
        self._open()
        x, y = self._check_examples(x, y, "gradients", self.global_batch)
        return self.engine.gradients(x, y, want_loss)

    def apply_gradients(self, grads) -> None:
        """Stage 4 with given mean gradients (one host flat array): every replica's update."""
        self._open()
        self.engine.apply_gradients(grads)

    def _check_examples(self, x, y, where: str, n: int | None):
        """(x, y) as arrays if they are examples and labels of this data set (``n`` of them), else a UserError (cheap)."""
        # Lists (of examples, of labels) were taken before these checks: keep taking them.
        x = x if hasattr(x, "dtype") else numpy.asarray(x)
        y = y if hasattr(y, "dtype") else numpy.asarray(y)
        ds = self.dataset
        if n is not None and (len(x) != n or len(y) != n):
            raise UserError(f"{where} takes one global batch of {n} examples and {n} labels "
                            f"({self.n_towers} towers x `batch_size` {self.cfg.batch_size}), got {len(x)} and {len(y)}")
        if n is None and (len(x) != len(y) or not len(x)):
            raise UserError(f"{where}: give as many labels as examples, at least one; got {len(x)} examples "
                            f"and {len(y)} labels")
        # A step's batch has the data set's dtype; evaluation takes uint8 pixels or floats.
        dtype_ok = x.dtype == ds.x.dtype if n is not None else (
            x.dtype == numpy.uint8 or numpy.issubdtype(x.dtype, numpy.floating))
        if tuple(x.shape[1:]) != ds.example_shape or not dtype_ok:
            raise UserError(f"{where}: examples are {x.dtype} {tuple(x.shape[1:])}, the data set's are "
                            f"{ds.x.dtype} {ds.example_shape}")
        if not numpy.issubdtype(y.dtype, numpy.integer) or y.ndim != 1 or (
                len(y) and (int(y.min()) < 0 or int(y.max()) >= ds.num_classes)):
            raise UserError(f"{where}: labels must be integers 0..{ds.num_classes - 1}, "
                            f"got {y.dtype} {tuple(y.shape)}" + (f" from {y.min()} to {y.max()}" if y.size else ""))
        return x, y

    def finish(self) -> None:
        """End of training: in weights mode, a last average if steps were taken since."""
        self.engine.finish()

    def check_replicas(self) -> bool:
        """Compare replicas now if they are meant to agree; return whether it ran (a host sync)."""
        return self.engine.check_replicas()

    def synchronize(self) -> None:
        """Host sync point: tower threads and GPU streams finish what was issued."""
        if self.engine is not None:
            self.engine.synchronize()

    # -- weights and state as name -> array dicts ------------------------------------------

    def get_weights(self, ema: bool = False) -> dict[str, numpy.ndarray]:
        """{name: float32 host copy}: the first replica's weights (or the EMA's), then the model's buffers."""
        self._open()
        self.synchronize()
        return self.model_state.named(self.ema.shadow if ema else None)

    def get_gradients(self) -> dict[str, numpy.ndarray]:
        """{name: float32 host copy} of the first tower's gradient buffer (after a grads-mode step: the mean)."""
        self._open()
        self.synchronize()
        return self.model_state.weights.split(self.towers[0].replica.grads)

    def set_weights(self, weights: dict, ema: bool = False) -> None:
        """Set every replica's weights and buffers (``ema=True``: the EMA's weights) from {name: array}.

        Every weight of the model must be there with its shape, and no other
        name, as finite real numbers; so must every buffer (with ``ema=True``
        buffers are optional, and set on every replica when given).  Otherwise
        a ``UserError`` names the first bad one and nothing changes.
        """
        self._open()
        flat, buffers = self.model_state.read_named(weights, "set_weights", buffers_optional=ema)
        self.synchronize()
        if ema:
            self.ema.set_state(flat)
            self.model_state.set(None, buffers)  # the buffers, when given, are every replica's
            return
        self.model_state.set(flat, buffers)
        self.engine.agreed()  # the next comparison is against these weights

    def state_dict(self) -> dict:
        """Everything a checkpoint holds, as {name: host array} (a host sync); ``towers.state`` lists the keys."""
        self._open()
        self.synchronize()
        layout = self.model_state.weights
        state = {**self.model_state.state_dict(), **self.ema.state_dict(layout),
                 **self.towers[0].optimizer.state_dict(layout), **self.position.state_dict(self.step),
                 **self.engine.state_dict()}
        state.update(checkpoint.metadata(self.cfg, self.dataset, self.n_towers, self.global_batch))
        return state

    def load_state_dict(self, state: dict, where: str = "load_state_dict") -> None:
        """Restore ``state_dict()`` output (or a checkpoint's arrays).

        Strict: an unknown key, a missing one, or a weight of the wrong name or
        shape is a ``UserError`` naming it, and nothing is changed.  Optimizer
        state of another optimizer (or none, after a change of ``momentum``) is
        allowed: the slots this optimizer lacks start at zero.
        """
        self._open()
        if not isinstance(state, dict):
            raise UserError(f"{where}: give a dict of name -> array, got {type(state).__name__}")
        known = ("params", "buffers", "ema", "data", "sync") + SLOTS
        for key in state:
            if key not in checkpoint.META + ("step",) and key.split("/", 1)[0] not in known:
                raise UserError(f"{where}: {key!r} is not part of a towers state dict")
        checkpoint.check_metadata(state, self.dataset, where)
        layout = self.model_state.weights
        # Every part checks its keys first; then all are applied, so a bad key changes nothing.
        set_model = self.model_state.prepare(state, where)
        ema = self.ema.read_state(state, layout, where)
        slots = self.towers[0].optimizer.read_state(state, layout, where)
        position = self.position.read_state(state, where)
        set_counters = self.engine.prepare(state, where)
        self.synchronize()
        set_model()
        self.ema.set_state(ema)
        for t in self.towers:
            with t.device.scope():
                t.optimizer.set_state(slots)
        set_counters()
        self.position = InputPosition(len(self.dataset.x), self.global_batch, self.step, position)
        self.source = BatchSource(self.dataset, self.global_batch, self.cfg.seed, *position)

    # -- evaluation ------------------------------------------------------------------------

    def evaluate(self, ema: bool = True, x=None, y=None) -> dict:
        """{"loss", "accuracy"} on the test data (or ``x``, ``y``), EMA or raw weights (a host sync).

        The loss is the mean cross-entropy without the L2 term.  ``x``, ``y`` are
        checked as ``train_step`` checks a batch (any count; float or uint8
        examples of the data set's shape, integer labels in range).
        """
        self._open()
        if x is None:
            x, y = self.dataset.x_test, self.dataset.y_test
            if x is None:
                raise UserError("no test data: give x_test/y_test in `data`, or `test_data`")
        else:
            x, y = self._check_examples(x, y, "evaluate", None)
        dev = self.towers[0].device
        self.synchronize()
        with dev.scope():
            r = Replica(self.model, dev.xp)
            r.set_params(self.ema.shadow if ema else self.towers[0].replica.params)
            r.set_buffers(self.towers[0].replica.buffers)
            loss, acc = r.evaluate(x, y)
        return {"loss": loss, "accuracy": acc}

    def test_accuracy(self) -> dict:
        """{"test_accuracy", "test_accuracy_ema"} ({} without test data)."""
        if self.dataset.x_test is None:
            return {}
        return {"test_accuracy": self.evaluate(ema=False)["accuracy"],
                "test_accuracy_ema": self.evaluate(ema=True)["accuracy"]}

    # -- the loop ----------------------------------------------------------------------------

    def fit(self, extensions=()) -> dict:
        """Train to ``cfg.steps`` (a total) as the command line does; return the final metrics.

        Writes into ``cfg.logdir`` (default: a new ``runs/<timestamp>`` folder):
        checkpoints, summaries, ``metrics.jsonl`` and ``final.npz``; resumes
        from its latest checkpoint with ``cfg.resume``.  ``extensions``
        (``towers.extensions.Extension`` objects) are called after the
        built-in ones.  The loop itself is ``towers.loop.fit``.
        """
        from towers.loop import fit

        self._open()
        return fit(self, extensions)

    def towers_text(self) -> str:
        """Where the towers run, for the summary line."""
        return ", ".join(map(str, self.towers))

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Release tower threads, BLAS limits, NCCL communicators and data workers (idempotent)."""
        if self._owned_data is not None:
            self._owned_data.close()
        if self._closed:
            return
        self._closed = True
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
                    kernels.restore_compute_type(self._tf32)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

