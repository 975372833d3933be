"""The ``Trainer``: the public API of a run, written once over an executor.

``Trainer(cfg)`` checks the settings (``towers.config``), resolves the
placement (``towers.devices.placement``; one host), loads the data
(``towers.data.loading``) and describes the model (``towers.nn.models``), then
hands the towers to an executor (``towers.run.executor``, the protocol):

* one host (``hosts`` 1): ``towers.run.local.LocalExecutor``, this process's
  towers, step engine, reducer and input;
* several hosts: ``towers.cluster.driver.ClusterExecutor``, host actors on Ray
  (Ray is imported only then), each a one-host ``Trainer`` with its share of
  every global batch.

It then answers the questions a user asks of a run, the same way on both:
steps (``train_step``, ``run_steps``), weights (``get_weights``/
``set_weights``), state (``state_dict``/``load_state_dict``), evaluation
(``evaluate``), the learning rate (``lr``/``lr_at``, one schedule:
``towers.optim.schedule.make_schedule``) and the loop (``fit``, in
``towers.run.loop``).  What a user passes in is checked here, once.  Every
question goes to the executor through a named method of the ``Executor``
protocol; the executor's own parts (a ``LocalExecutor``'s ``towers``,
``engine``, ``ema``, ``replicas``; a ``ClusterExecutor``'s ``host_pids()``)
are ``trainer.executor``'s attributes, not the trainer's.

Sync points: ``get_weights``, ``state_dict``, ``evaluate``, ``predict`` and
``check_replicas`` wait for the towers (``synchronize``); steps do not.
"""
from __future__ import annotations

import copy
import time

import numpy

from towers.arrays import check_host
from towers.run import resume
from towers.config import MODEL_OBJECT, Config, resume_settings
from towers.data.dataset import Dataset, check_examples, check_test_split, hold_out
from towers.data.kinds import is_synthetic
from towers.data.loading import load_dataset
from towers.data.pipeline import describe
from towers.devices.cpu_threads import input_workers
from towers.devices.placement import Placement, resolve
from towers.errors import TrainingError, UserError, notice
from towers.run.executor import Executor
from towers.run.local import LocalExecutor
from towers.nn.models import build_model, model_recipe
from towers.nn.normalization import check_batch_statistics
from towers.optim.optimizers import SLOTS
from towers.output import checkpoint
from towers.settings import gpu_only_set, integer


def check_inputs(x, y, where: str, example_shape: tuple, dtype, num_classes: int, n: int | None = None,
                 batch: str | None = None):
    """(x, y) as arrays if they are examples and labels of a model's data, else a ``UserError`` starting with
    ``where`` (cheap: shapes, dtypes, label range; a scan for NaN/inf in float examples).

    The one check of what the API is handed (``Trainer._check_examples``;
    ``towers.inference.Predictor``): host arrays (or lists), examples of
    ``example_shape`` and ``dtype`` (None: not known, not checked), integer
    labels 0..``num_classes`` - 1.  ``n``: a step's global batch, exactly
    ``n`` of each (``batch`` says what makes it).  Else the examples are test
    data, checked as the loader checks a test split (uint8 pixels, or finite
    floats taken as float32, of the training examples' dtype: uint8 is scaled
    by 1/255 and floats not), at least one with labels; ``y`` None: examples
    alone (``predict``), any number.
    """
    check_host(x, f"{where}: x")
    if y is not None:
        check_host(y, f"{where}: y")
    # Lists (of examples, of labels) were taken before these checks: keep taking them.
    x = x if hasattr(x, "dtype") else numpy.asarray(x)
    y = y if y is None or hasattr(y, "dtype") else numpy.asarray(y)
    if y is None and x.ndim < 1:
        raise UserError(f"{where}: x must be an array of examples, got {x.dtype} {x.shape}")
    if y is not None and (x.ndim < 1 or y.ndim < 1):
        raise UserError(f"{where}: x and y must be arrays of examples and labels, got {x.dtype} {x.shape} and "
                        f"{y.dtype} {y.shape}")
    if n is not None and (len(x) != n or len(y) != n):
        raise UserError(f"{where} takes one global batch of {n} examples and {n} labels ({batch}), "
                        f"got {len(x)} and {len(y)}")
    if n is None and y is not None and (len(x) != len(y) or not len(x)):
        raise UserError(f"{where}: give as many labels as examples, at least one; got {len(x)} examples "
                        f"and {len(y)} labels")
    if n is None:
        # Evaluation data is test data: the loader's checks of a test split (uint8 pixels, or finite floats
        # taken as float32; of the training examples' dtype, since uint8 is scaled by 1/255 and floats not).
        x = check_examples(x, where, "x")
        if len(x):
            check_test_split(x, y, f"{where}: ", "x", dtype)
    # The data set's dtype, for a step's batch and (after the loader's conversion) for evaluation.
    if tuple(x.shape[1:]) != tuple(example_shape) or (dtype is not None and x.dtype != dtype):
        if tuple(x.shape) == tuple(example_shape):
            raise UserError(f"{where}: x is one example of shape {tuple(x.shape)}: give a batch of shape "
                            f"(N, {', '.join(map(str, example_shape))}) (x[None] for one example)")
        theirs = f"{numpy.dtype(dtype)} " if dtype is not None else ""
        raise UserError(f"{where}: examples are {x.dtype} {tuple(x.shape[1:])}, the data set's are "
                        f"{theirs}{tuple(example_shape)}")
    if y is not None and (not numpy.issubdtype(y.dtype, numpy.integer) or y.ndim != 1 or (
            len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes))):
        raise UserError(f"{where}: labels must be integers 0..{num_classes - 1}, "
                        f"got {y.dtype} {tuple(y.shape)}" + (f" from {y.min()} to {y.max()}" if y.size else ""))
    return x, y


class Trainer:
    """A run's towers (one host's or several hosts'), weights, state, evaluation and loop.

    ``Trainer(cfg, model=None, dataset=None, reducer=None, placement=None)``:
    ``model`` is a ``towers.Sequential`` or a list of layers (default:
    ``cfg.model``); ``dataset`` a ``towers.Dataset`` (default: loaded from
    ``cfg.data``; on a cluster it is put in Ray's object store once and read by
    every host); ``reducer`` a ``towers.parallel.reducers.Reducer``, or a
    function ``(placement, streams) -> Reducer`` (default: ``make_reducer``;
    tests pass one over the NCCL stand-in); ``placement`` a resolved
    ``Placement`` (default: from ``cfg``).  Those two are one host's: with
    ``hosts`` > 1 each host makes its own.  ``share``: a host's part of a
    cluster's run (``towers.run.local.Share``; the host actors pass it);
    ``nccl``: a module (or its import name) standing in for ``cupy.cuda.nccl``
    in the host actors (tests pass ``nccl_standin``).

    Settings are checked, then the placement, then the data, all before any
    device memory is allocated; a bad one is a ``UserError`` naming it.
    Notices (soft placement) go to the ``towers`` logger.  Use it as a context
    manager, or ``close()``.

    With ``resume`` the run in ``logdir`` is continued from its newest usable
    checkpoint (``towers.run.resume.resume_point``), read first: every
    setting ``cfg`` does not give is the checkpoint's (``towers.config.resume_settings``),
    and once built the trainer holds the checkpoint's state (``resumed``: its
    path, step and notes, each note also a notice), so ``get_weights``,
    ``evaluate`` and ``predict`` see its weights and EMA before ``fit``.
    ``logdir``: where its last ``fit`` wrote (None before one).
    """

    def __init__(self, cfg: Config | None = None, *, model=None, dataset: Dataset | None = None,
                 reducer=None, placement: Placement | None = None, share=None, nccl=None):
        started = time.perf_counter()
        self._closed, self._owned_data, self.executor = True, None, None  # until device memory exists
        self.resumed, self.logdir, self.seen_checkpoint = None, None, -1
        cfg = cfg if cfg is not None else Config()
        found = None
        if isinstance(cfg, Config) and cfg.resume is True and isinstance(cfg.logdir, str) and cfg.logdir:
            found = resume.resume_point(cfg.logdir)
            if found is not None:
                cfg = resume_settings(cfg, found[1]["config"])
                if model is None and cfg.model == MODEL_OBJECT:
                    raise UserError(f"{found[0]} was trained with a model object handed to the Trainer: give it "
                                    "again, Trainer(cfg, model=...), to resume")
            # The newest checkpoint here now: one written after this, before `fit`, is another run's.
            self.seen_checkpoint = max((step for step, _ in checkpoint.list_checkpoints(cfg.logdir)), default=-1)
        given = cfg
        self.cfg = cfg = Config.resolved(given, model)
        self.recipe = None  # the model's recipe, when the run takes it (``_take_recipe``)
        cluster = cfg.hosts > 1
        if cluster and (reducer is not None or placement is not None or share is not None):
            raise UserError(f"`hosts` {cfg.hosts}: each host makes its own placement and reducer; "
                            "give `reducer` and `placement` to a one-host Trainer only")
        # -- placement: decided (and validated) before any device memory or NCCL.
        self.placement = None
        if not cluster:
            self.placement = placement or resolve(cfg.n_gpu, cfg.devices, cfg.soft_placement)
            if self.placement.notice:
                notice(self.placement.notice)
            unused = gpu_only_set(cfg)
            if unused and not self.placement.gpus:
                one = len(unused) == 1
                notice(f"{', '.join(unused)} {'is' if one else 'are'} for GPU towers only: these towers run on the CPU "
                       f"and compute as without {'it' if one else 'them'}")
        # -- data (host): validated like a file, whatever its origin (a cluster's driver: before Ray starts).
        shipped = dataset
        if dataset is None:
            cpu_towers = 0 if cluster else self.placement.cpu_towers
            # The decoded-image cache is for one host: a cluster's data set travels to its hosts.
            cache = cfg.cache_images_mib if cfg.cache_images and not cluster else None
            def load(cfg):
                spec = describe(cfg.data, cfg.x_key, cfg.y_key, cfg.test_data, decode=cfg.decode,
                                on_error=cfg.on_error, augment=cfg.augment, normalize=cfg.normalize,
                                image_size=cfg.image_size, seed=cfg.seed, input_scale=cfg.input_scale)
                return load_dataset(spec, workers=input_workers(cfg.input_workers, cpu_towers), cache_mib=cache,
                                    progress=not cfg.quiet, seed=cfg.seed)

            dataset = self._owned_data = load(cfg)  # its TFRecord workers end with this trainer
            if model is None and not cluster:
                dataset = self._owned_data = self._take_recipe(given, dataset, load)
                cfg = self.cfg
        elif not isinstance(dataset, Dataset):
            raise UserError(f"dataset must be a towers.Dataset (Dataset.from_arrays(x, y)), "
                            f"got {type(dataset).__name__}")
        if cfg.validation_split:  # the same examples held out here and on every host of a cluster
            try:
                dataset = hold_out(dataset, cfg.validation_split, cfg.seed)
            except BaseException:
                self.close()
                raise
        self.dataset = dataset
        self.data_path = cfg.data if shipped is None else None  # where the data came from (None: handed over)
        try:
            self.model = build_model(model if model is not None else cfg.model, dataset.example_shape,
                                     dataset.num_classes, cfg.hidden, cfg.zero_init_residual)
            # Sync-BN pools one host's towers (a cluster's hosts check with theirs).
            if not (cluster and cfg.sync_bn):
                check_batch_statistics(self.model, cfg.batch_size,
                                       len(self.placement.towers) if cfg.sync_bn else None, cfg.accumulate)
        except BaseException:
            self.close()  # the data's input workers end with a refused model too
            raise
        # -- the executor: from here on, device memory (or actors).
        self._closed = False
        try:
            if cluster:
                from towers.cluster.driver import ClusterExecutor  # Ray: only for several hosts

                self.executor = ClusterExecutor(type(self), cfg, dataset, self.model, model, shipped, nccl)
            else:
                self.executor = self._local(reducer, share)
        except BaseException:
            self.close()
            raise
        self.cfg = self.executor.cfg  # with the steps `epochs` gives (``towers.config.steps_of_epochs``)
        if found is not None:
            try:
                self.resumed = resume.resume(self, found)
            except BaseException:
                self.close()
                raise
            for note in self.resumed.notes:
                notice(note)
        self.build_seconds = time.perf_counter() - started  # the run's building, which `fit`'s done line counts

    def _take_recipe(self, given: Config, dataset: Dataset, load) -> Dataset:
        """The data set, after the model's recipe (``towers.nn.models.model_recipe``) is taken where it applies.

        It applies with ``recipe`` auto, a built-in model that has one, one host, and training data read from
        ``data`` (``dataset``, loaded by ``load(cfg)`` with the settings before the recipe) whose examples
        are the recipe's shape.  ``self.cfg`` is then ``given`` resolved with the recipe on this host's
        towers.  The recipe's augmentation needs stored pixels (uint8, not synthetic): other data keeps
        the user's; where the augmentation changes, the data is read again with it (the first read is
        closed).  A data set handed to the Trainer takes the model's plain defaults.
        """
        recipe = model_recipe(self.cfg.model, dataset.example_shape) if self.cfg.recipe == "auto" else None
        if recipe is None:
            return dataset
        if given.augment is None and (is_synthetic(self.cfg.data) or dataset.x.dtype != numpy.uint8):
            given = copy.copy(given)  # keeps which settings the user gave (``Config.given``), as a replace would not
            given.augment = "none"  # nothing to augment: the recipe's stays out
        self.recipe, before = recipe, self.cfg
        self.cfg = Config.resolved(given, None, recipe, len(self.placement.towers))
        if self.cfg.augment == before.augment:
            return dataset
        dataset.close()
        return load(self.cfg)

    def _local(self, reducer, share) -> Executor:
        try:
            return LocalExecutor(self.cfg, self.dataset, self.model, self.placement, reducer, share)
        except MemoryError:  # NumPy's and CuPy's out-of-memory errors both derive from it
            n, mib = len(self.placement.towers), self.model.size * 4 / 2**20
            raise UserError(f"not enough memory for {n} replicas of a model of {self.model.size:,} "
                            f"parameters ({mib:,.0f} MiB each, plus gradients, optimizer state and "
                            "activations): use a smaller model (`hidden` for the mlp), a smaller `batch_size`, "
                            "or fewer towers") from None

    # -- sizes, schedule, counters -------------------------------------------------------

    @property
    def n_towers(self) -> int:
        """Towers behind one update (every host's; one host's with async)."""
        return self.executor.n_towers

    @property
    def global_batch(self) -> int:
        """Examples of one step over every tower (the executor's ``examples_per_step``: one formula)."""
        return self.executor.examples_per_step

    @property
    def examples_per_step(self) -> int:
        """Examples behind one update, which the schedule counts."""
        return self.executor.examples_per_step

    @property
    def step(self) -> int:
        """Updates done so far."""
        return self.executor.step

    @property
    def all_reduces(self) -> int:
        """Collectives issued (host 0's on a cluster), for the communication report."""
        return self.executor.all_reduces

    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.lr_at(self.step)

    def lr_at(self, step: int) -> float:
        """The learning rate of the step after ``step`` steps (``towers.optim.schedule``)."""
        return self.executor.schedule(step)

    def towers_text(self) -> str:
        """Where the towers run, for the summary line."""
        return self.executor.towers_text()

    def profile_report(self) -> str:
        """The phase timer's report (``profile``; host 0's on a cluster)."""
        return self.executor.report(self.global_batch)

    @property
    def source(self):
        """The run's global batches (``towers.data.batches.BatchSource``: ``next_batch()``, ``next_indices()``).

        On one host, the cursor the run's own steps draw from (a batch drawn
        here is one the run skips); on a cluster, the run's global batches
        from the first, drawn in this process (each host draws its own).
        """
        return self.executor.source

    @property
    def cpu_kernels(self) -> str | None:
        """What ran the CPU towers' fused kernels, ``numba`` or ``numpy`` (a checkpoint records it); None on a
        cluster, whose hosts each decide."""
        return self.executor.cpu_kernels

    # -- steps -----------------------------------------------------------------------------

    def _open(self) -> None:
        if self._closed:
            raise UserError("this Trainer is closed: make a new one")

    def train_step(self, x, y, want_loss: bool = False):
        """One synchronous step on the global batch ``x``, ``y`` (``towers x batch_size x accumulate`` examples).

        Returns the towers' losses (device scalars on one host) when
        ``want_loss`` (else None).  On a cluster each host takes its towers'
        slice (host order, then tower order: as the run's own batches).  With
        concurrent CPU towers the call returns while the other tower threads
        finish their share of the update; ``synchronize`` (and the next step)
        waits for it.
        """
        self._open()
        x, y = self._check_examples(x, y, "train_step", self.global_batch)
        return self.executor.train_step(x, y, want_loss)

    def train_step_at(self, indices, want_loss: bool = False):
        """One step on the training-set rows ``indices`` (one global batch of row numbers; one host).

        With the training set on the GPUs each tower gathers its slice there,
        otherwise the rows are taken on the host: the same batch either way
        (``LocalExecutor.train_step_at``).  The losses when ``want_loss``.
        """
        self._open()
        return self.executor.train_step_at(indices, want_loss)

    def run_steps(self, n: int, want_loss: bool = False):
        """``n`` steps on the run's own batches (async: ``n`` updates of the server); the last losses when asked.

        ``n`` is an integer >= 0 (a NumPy integer too); anything else is a ``UserError``, no step taken.
        """
        self._open()
        return self.executor.run_steps(integer(n, 0, "run_steps: n"), want_loss)[0]

    def _check_examples(self, x, y, where: str, n: int | None):
        """(x, y) as arrays if they are examples and labels of this data set (``n`` of them), else a UserError (cheap).

        ``check_inputs`` with the data set's example shape, dtype and classes;
        ``y`` None: examples alone (``predict``).
        """
        ds = self.dataset
        batch = None
        if n is not None:
            batch = (f"{self.n_towers} towers x `batch_size` {self.cfg.batch_size}"
                     + (f" x `accumulate` {self.cfg.accumulate}" if self.cfg.accumulate > 1 else ""))
        return check_inputs(x, y, where, ds.example_shape, ds.x.dtype, ds.num_classes, n, batch)

    def finish(self) -> None:
        """End of training: in weights mode, a last average if steps were taken since."""
        self._open()
        self.executor.finish()

    def check_replicas(self) -> bool:
        """Compare replicas now if they are meant to agree; return whether it ran (a host sync)."""
        self._open()
        return self.executor.check_replicas()

    def synchronize(self) -> None:
        """Host sync point: tower threads and GPU streams finish what was issued (nothing once closed)."""
        if self.executor is not None and not self._closed:
            self.executor.synchronize()

    # -- weights and state as name -> array dicts ------------------------------------------

    def get_weights(self, ema: bool = False) -> dict[str, numpy.ndarray]:
        """{name: float32 host copy}: the first replica's weights (or the EMA's), then the model's buffers."""
        self._open()
        return self.executor.get_weights(ema)

    def get_gradients(self) -> dict[str, numpy.ndarray]:
        """{name: float32 host copy} of the last update's mean gradient (host 0's, or the one a server applied)."""
        self._open()
        return self.executor.get_gradients()

    def set_weights(self, weights: dict, ema: bool = False) -> None:
        """Set every replica's weights and buffers (``ema=True``: the EMA's weights) from {name: array}.

        Every weight of the model must be there with its shape, and no other
        name, as finite real numbers; so must every buffer (with ``ema=True``
        buffers are optional, and set on every replica when given).  Otherwise
        a ``UserError`` names the first bad one and nothing changes.
        """
        self._open()
        self.executor.set_weights(weights, ema)

    def state_dict(self) -> dict:
        """Everything a checkpoint holds, as {name: host array} (a host sync); ``towers.state`` lists the keys."""
        self._open()
        return self.executor.state_dict()

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
        known = ("params", "buffers", "ema", "data", "sync", "loss_scale") + SLOTS
        for key in state:
            if key not in checkpoint.META + ("step",) and key.split("/", 1)[0] not in known:
                raise UserError(f"{where}: {key!r} is not part of a towers state dict")
        checkpoint.check_metadata(state, self.dataset, where)
        self.executor.load_state_dict(state, where)

    # -- evaluation ------------------------------------------------------------------------

    def evaluate(self, ema: bool = True, x=None, y=None, progress=None) -> dict:
        """{"loss", "accuracy"} on the test data (or ``x``, ``y``), EMA or raw weights (a host sync), and
        "top5_accuracy" for a model of more than 10 classes (``Replica.score``).

        The loss is the mean cross-entropy without the L2 term.  ``x``, ``y`` are
        checked as ``train_step`` checks a batch and the loader checks test data
        (any count; examples of the data set's shape and dtype, uint8 or finite
        floats, integer labels in range); give both or neither.  Weights that
        hold NaN or inf (a diverged run) are a ``TrainingError`` naming one,
        not a loss of nan beside a meaningless accuracy: looked for only when
        the loss is not finite.  ``progress(k)``: called as ``k`` more examples
        are done (a progress bar's ``update``; on a cluster once, at the end).
        """
        self._open()
        if (x is None) != (y is None):
            raise UserError("evaluate: give both x and y (examples and their labels), or neither for the test data")
        if x is None:
            x, y = self.dataset.x_test, self.dataset.y_test
            if x is None:
                raise UserError("no test data: give x_test/y_test in `data`, or `test_data`")
        else:
            x, y = self._check_examples(x, y, "evaluate", None)
        result = self.executor.evaluate(ema, x, y, progress)
        if not numpy.isfinite(result["loss"]):
            self._diverged("evaluate", ema)
        return result

    def predict(self, x=None, ema: bool = True, batch_size: int = 250) -> numpy.ndarray:
        """The logits of the examples ``x`` (default: the test data) as a host float32 array (len(x), classes).

        On the first tower's device (a GPU where there is one), with the EMA
        weights (``ema=False``: the raw ones), in evaluation mode (moving
        statistics, no dropout), in chunks of ``batch_size`` examples
        (``Replica.predict``: one copy to the host at the end, a sync point).
        ``x`` is any number of examples (0 too), checked as ``evaluate``
        checks them (the data set's example shape and dtype, uint8 or finite
        floats).  ``towers.softmax`` turns the logits into probabilities;
        their argmax is the predicted class.  Weights that hold NaN or inf
        are a ``TrainingError`` naming one, as in ``evaluate``.
        """
        self._open()
        batch = integer(batch_size, 1, "predict: batch_size")
        if x is None:
            x = self.dataset.x_test
            if x is None:
                raise UserError("predict: no test data to predict: give x, or x_test/y_test in `data`, or `test_data`")
        else:
            x, _ = self._check_examples(x, None, "predict", None)
        logits = self.executor.predict(ema, x, batch)
        if not numpy.isfinite(logits).all():
            self._diverged("predict", ema)
        return logits

    def _diverged(self, where: str, ema: bool) -> None:
        """A ``TrainingError`` naming a weight that holds NaN or inf, if one does (looked for only after a
        non-finite result: a diverged run's, not a meaningless figure beside it)."""
        bad = checkpoint.non_finite(self.executor.get_weights(ema))
        if bad is not None:
            raise TrainingError(f"{where}: the {'EMA' if ema else 'raw'} weights hold NaN or inf ({bad!r}): "
                                "training diverged; lower `lr` and train again, or load an earlier checkpoint "
                                "(load_state_dict)")

    def test_accuracy(self, progress=None) -> dict:
        """``evaluate``'s figures of the raw and the EMA weights on the test data (or the held-out
        ``validation_split``), prefixed ``test_`` and, for the EMA, suffixed ``_ema``: "test_loss",
        "test_accuracy", "test_loss_ema", "test_accuracy_ema", and "test_top5_accuracy(_ema)" with more than 10
        classes ({} without test data); ``progress`` as ``evaluate``'s, over both passes (twice the test
        examples)."""
        if self.dataset.x_test is None:
            return {}
        return {f"test_{k}{suffix}": v for ema, suffix in ((False, ""), (True, "_ema"))
                for k, v in self.evaluate(ema=ema, progress=progress).items()}

    def train_accuracy(self) -> float | None:
        """The training accuracy of the last step whose loss was asked for (``want_loss``), from that step's own
        forward pass (training mode: dropout on, each tower's batch statistics), as Keras reports ``accuracy``
        beside the loss (on a cluster, the mean of its hosts'); None where it was not counted (``cuda_graphs``)."""
        self._open()
        return self.executor.train_accuracy()

    def loss_scaling(self) -> dict:
        """``{"loss_scale": S, "skipped_steps": n}`` with ``precision`` fp16 (n: steps skipped for an inf or NaN
        gradient, the whole run's); {} otherwise (a host sync with fp16)."""
        self._open()
        return self.executor.loss_scaling()

    # -- the loop ----------------------------------------------------------------------------

    def fit(self, extensions=()) -> dict:
        """Train to ``cfg.steps`` (a total) as the command line does; return the final metrics.

        Writes into ``cfg.logdir`` (default: a new ``runs/<timestamp>`` folder):
        checkpoints, summaries, ``metrics.jsonl`` and ``final.npz``; resumes
        from its latest checkpoint with ``cfg.resume``.  ``extensions``
        (``towers.Extension`` objects) are called after the
        built-in ones.  The loop itself is ``towers.run.loop.fit``.
        """
        from towers.run.loop import fit

        self._open()
        return fit(self, extensions)

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Release tower threads, BLAS limits, NCCL communicators, actors and data workers (idempotent)."""
        if self._owned_data is not None:
            self._owned_data.close()
        if self._closed:
            return
        self._closed = True
        if self.executor is not None:
            self.executor.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
