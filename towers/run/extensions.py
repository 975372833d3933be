"""The training loop's side concerns, as small objects called when due.

``Trainer.fit`` runs steps in segments, each up to the next step where some
extension is ``due`` (``Run.next_stop``); there every extension whose ``due(step)``
is true is called with the ``Run`` (the logdir, the reporter, the TensorBoard
writer, the checkpointer, and the step's loss).  The built-in ones, in the
order they run:

* ``NonFiniteStop``: stops with a ``TrainingError`` when the loss fetched at
  this step is not finite (the last good checkpoint stays the latest); when
  the input holds NaN/inf, the message says so;
* ``Summaries``: TensorBoard scalars and histograms every ``summary_every``;
* ``Checkpoints``: ``ckpt-<step>.npz`` every ``checkpoint_every`` and at the end;
* ``Evaluation``: the test (or held-out) data's loss and accuracy every
  ``eval_every`` steps or epoch (default: at each checkpoint), the end's in
  ``Run.finish``;
* ``LogLine``: the ``step N, loss = ..., accuracy = ...`` line and ``metrics.jsonl`` record;
* ``ReplicaCheck``: every ``check_replicas`` steps, replicas compared.

A user's extension subclasses ``Extension`` (``due`` and ``__call__``; ``needs_loss``
when it reads ``run.loss``) and is passed to ``fit(extensions=[...])``.  ``due``
is asked of steps ahead to find the end of the next segment, so it must not
change the extension.  ``run.trainer`` is a ``towers.Trainer`` (one host or
several): extensions use its public API only.

Sync points: the loss (and the step's training accuracy, counted in its
forward) reaches the host only at steps where some extension ``needs_loss``;
weights only where ``Summaries``, ``Checkpoints`` or ``Evaluation`` run (they
call ``trainer.synchronize()`` first).  Log lines and summaries come every
``log_every``/``summary_every`` steps, by default about 20 over the run
(``default_interval``).

The logdir belongs to one live run: ``Run.open`` locks it before writing
anything there (``towers.output.logdir.lock_logdir``) and ``Run.close``
releases it.  A failed write (full disk, read-only) stops the run with a
``DiskError`` naming the file, the step and the last complete checkpoint;
writers still open are then closed without a second error.
"""
from __future__ import annotations

import contextlib
import math
import os
import time

import numpy

from towers.run import resume
from towers.errors import UserError, progress_bar, render
from towers.files import DiskError, atomic_save_npz, atomic_write_text, writing
from towers.optim.optimizers import OPTIMIZERS
from towers.optim.schedule import piecewise_values
from towers.output import checkpoint
from towers.output.logdir import lock_logdir
from towers.output.summaries import Reporter, TensorBoard, per_tower, trim_metrics


class Extension:
    """A side concern of the loop.  Override ``due`` and ``__call__``."""

    needs_loss = False  # whether __call__ reads run.loss (the loop then fetches it)
    ends_segment = True  # whether a step where it is due ends a segment of steps (NonFiniteStop: no)

    def due(self, step: int, last_step: int) -> bool:
        return False

    def __call__(self, run: "Run") -> None:
        pass


class Every(Extension):
    """Due every ``every`` steps (0: never), and at the last step when ``at_end``."""

    def __init__(self, every: int, at_end: bool = False):
        self.every, self.at_end = every, at_end

    def due(self, step, last_step):
        return (self.every > 0 and step % self.every == 0) or (self.at_end and step == last_step)


class NonFiniteStop(Extension):
    """Stop when the fetched loss is not finite; the last good checkpoint stays the latest.

    Due at every step, it acts only where the loss was fetched: the end of a segment.
    """

    ends_segment = False

    def due(self, step, last_step):
        return True

    def __call__(self, run):
        if run.loss is not None and not math.isfinite(run.loss):
            raise run.diverged(f"the loss is {run.loss}")


class Summaries(Every):
    """TensorBoard scalars (the loss, the step's training accuracy, fp16's loss scale and skipped steps) and
    weight/gradient histograms (a host sync)."""

    needs_loss = True

    def __call__(self, run):
        run.trainer.synchronize()
        run.tensorboard.write_step(run.trainer, run.loss, run.lr, **run.step_figures())


class Checkpoints(Every):
    """A checkpoint (a host sync)."""

    needs_loss = True  # a diverged run must not write its weights

    def __call__(self, run):
        run.checkpoint()


class Evaluation(Extension):
    """The test data's (or the held-out ``validation_split``'s) loss and accuracy, raw and EMA weights, top-5
    with more than 10 classes (``Trainer.test_accuracy``; two passes over it, a host sync): a log line, a
    ``metrics.jsonl`` record and TensorBoard scalars.

    Due every ``every`` steps (0: never), or with ``every`` ``"epoch"`` at the
    step where each epoch of ``n_examples`` ends (the first step whose
    examples reach k x ``n_examples``, as ``epochs`` counts them); never at the
    last step, where ``Run.finish`` evaluates.  Without test data it does
    nothing.  Evaluation reads the weights only: the run's results are the same
    with it or without it.
    """

    def __init__(self, every, n_examples: int, examples_per_step: int):
        self.every, self.n, self.per_step = every, n_examples, examples_per_step

    def due(self, step, last_step):
        if step == last_step or not self.every:
            return False
        if self.every == "epoch":  # epoch k ends at step ceil(k n / e): the k with (step - 1) e < k n <= step e
            k = step * self.per_step // self.n
            return k >= 1 and k * self.n > (step - 1) * self.per_step
        return step % self.every == 0

    def __call__(self, run):
        scores = run.trainer.test_accuracy()
        if scores:
            run.reporter.log_evaluation(run.trainer.step, scores, run.test_examples)
            run.tensorboard.scalars(run.trainer.step, **scores)


class LogLine(Every):
    """The original's log line, and a ``metrics.jsonl`` record: the loss, the step's training accuracy, and
    with fp16 the loss scale and the steps skipped for overflow (``Run.step_figures``).

    A run that has not learned (its loss, ``STUCK_STEPS`` steps or more into
    this run, still within ``STUCK`` of chance level, ln(classes): guessing) is
    said on the line: a run at chance accuracy otherwise looks like any other.
    A converged or resumed run, whose loss has stopped moving far below chance,
    is not warned about.
    """

    needs_loss = True
    STUCK, STUCK_STEPS = 0.02, 300

    def __init__(self, every: int):
        super().__init__(every, at_end=True)
        self._t, self._step = time.perf_counter(), None
        self._first = None  # this run's first logged loss

    def __call__(self, run):
        now, step = time.perf_counter(), run.trainer.step
        steps = step - (self._step if self._step is not None else run.start_step)
        note = None
        chance = math.log(max(run.trainer.dataset.num_classes, 2))
        self._first = run.loss if self._first is None else self._first
        # A run has not learned when its (data) loss is still at chance level AND
        # at its first logged loss (label smoothing keeps a learned loss above 0);
        # a converged or resumed run is far below chance.
        if step - run.start_step >= self.STUCK_STEPS and run.loss >= (1 - self.STUCK) * max(chance, self._first):
            note = (f"the loss is still at chance level ({run.loss:.4f}, ln {run.trainer.dataset.num_classes} "
                    f"classes = {chance:.4f}) after {step - run.start_step} steps: the run has not learned; "
                    "lower `lr`, or try `optimizer` adam")
        run.reporter.log_step(step, run.loss, run.lr, steps * run.trainer.global_batch / (now - self._t),
                              run.trainer.executor.running_towers,
                              (now - self._t) / steps, render(note) if note else None, **run.step_figures())
        self._t, self._step = now, step


class ReplicaCheck(Every):
    """Compare every replica with the first (bitwise in grads mode)."""

    def __init__(self, every: int):
        super().__init__(every)
        self._pending = False  # weights mode: checks wait for the next average

    def due(self, step, last_step):
        return self._pending or super().due(step, last_step)

    def __call__(self, run):
        self._pending = not run.trainer.check_replicas()


class Run:
    """One ``fit``: the logdir's writers, the extensions, and the current step's loss."""

    def __init__(self, trainer, logdir: str, extensions):
        self.trainer, self.logdir = trainer, logdir
        cfg = trainer.cfg
        self.last_step, self.start_step = cfg.steps, trainer.step  # start_step: set again after a resume
        self.start_exchanges = trainer.executor.communication()[0]
        self.extensions = list(extensions)
        self.loss: float | None = None
        self.batch = None  # the host examples of the current step
        self.lr = trainer.lr()
        self._step = trainer.step  # where the progress bar is
        self.reporter = self.tensorboard = None
        self._lock: int | None = None
        self.checkpointer = checkpoint.Checkpointer(logdir, cfg.keep_checkpoints)
        # Log lines and summaries: as set, else a curve of about 20 points however short the run.
        self.log_every = cfg.log_every if cfg.log_every is not None else default_interval(cfg.steps)
        self.summary_every = cfg.summary_every if cfg.summary_every is not None else self.log_every
        # fp16: the steps skipped before this run (a resumed trainer loaded its checkpoint's count when built).
        self.skipped_at_start = trainer.loss_scaling().get("skipped_steps", 0)
        n_test = 0 if trainer.dataset.x_test is None else len(trainer.dataset.x_test)
        self.test_examples = (f"{n_test} held-out training examples (validation_split {cfg.validation_split:g})"
                              if cfg.validation_split else f"{n_test} test examples")

    @classmethod
    def open(cls, trainer, logdir: str | None, extensions=()) -> "Run":
        """Create and lock the logdir, continue the run (or refuse to overwrite one), open the writers.

        The lock comes before anything else is written in the logdir: a second
        run on it fails here without touching the first one's files.  ``logdir``
        None: the trainer's own from its last ``fit`` (``trainer.logdir``), else
        a new folder ``runs/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when runs
        start in the same second).  A resumed trainer loaded its checkpoint
        when it was built (``trainer.resumed``); a checkpoint written in the
        logdir since then is another run's, and refused.  A fresh run refuses a
        logdir holding checkpoints, but for the trainer's own.
        """
        cfg = trainer.cfg
        own = trainer.logdir
        if logdir is None:
            logdir = own if own is not None else new_logdir()
        if logdir != own or not os.path.isdir(logdir):
            _make_logdir(logdir)
        run = cls(trainer, logdir, ())
        run._opened = time.perf_counter()  # the run's time counts from here (and the trainer's building)
        run._lock = lock_logdir(logdir)
        try:
            resumed = trainer.resumed
            continues = cfg.resume or (own is not None and os.path.realpath(logdir) == os.path.realpath(own))
            if cfg.resume:
                resume.refuse_newer(logdir, trainer.seen_checkpoint)
            elif not continues:
                resume.refuse_overwrite(logdir)
            trainer.logdir = logdir
            mine = [p for step, p in checkpoint.list_checkpoints(logdir) if step <= trainer.step] if continues else []
            run.checkpointer.last_path = mine[0] if mine else None
            if getattr(trainer.dataset, "class_names", None):  # an image folder's classes: line k is label k
                classes = os.path.join(logdir, "classes.txt")
                with writing(classes):
                    atomic_write_text(classes, "".join(f"{name}\n" for name in trainer.dataset.class_names))
            # The figures of this run (steps, examples/sec, all-reduces/step) count from here.
            run.start_step, run.start_exchanges = trainer.step, trainer.executor.communication()[0]
            run._step = trainer.step
            if continues or trainer.step:
                trim_metrics(logdir, trainer.step)  # the steps after the checkpoint are redone
            run.reporter = Reporter(logdir, cfg.steps, start_step=trainer.step, quiet=cfg.quiet)
            if resumed is not None:  # said even when quiet (its notes were notices when the trainer was built)
                run.reporter.say(render(resumed.line))
            # The purge keeps the checkpoint step's own points: they are not redone.
            purge = trainer.step + 1 if continues or trainer.step else None
            run.tensorboard = TensorBoard(logdir, run.summary_every, trainer.step, purge_step=purge)
        except BaseException:
            run.close()
            raise
        run.extensions = [NonFiniteStop(), Summaries(run.summary_every), Checkpoints(cfg.checkpoint_every, at_end=True),
                          Evaluation(cfg.checkpoint_every if cfg.eval_every is None else cfg.eval_every,
                                     len(trainer.dataset.x), trainer.examples_per_step),
                          LogLine(run.log_every), ReplicaCheck(cfg.check_replicas), *extensions]
        return run

    @contextlib.contextmanager
    def _stops_on_disk_errors(self):
        """A failed write says where training stopped and which checkpoint is kept."""
        try:
            yield
        except DiskError as e:
            if e.step is not None:
                raise
            raise e.at(self.trainer.step, self.checkpointer.last_path) from None

    def start(self) -> None:
        self.reporter.say(render(settings_line(self.trainer.cfg, self.trainer.model.size, self.trainer.recipe)))
        self._t0 = time.perf_counter()

    def wants_loss(self, step: int) -> bool:
        return any(e.needs_loss and e.due(step, self.last_step) for e in self.extensions)

    def next_stop(self) -> int:
        """The end of the next segment: the next step where an extension is due (the last step at the latest)."""
        extensions = [e for e in self.extensions if e.ends_segment]
        for k in range(self.trainer.step + 1, self.last_step):
            if any(e.due(k, self.last_step) for e in extensions):
                return k
        return self.last_step

    def after_segment(self, losses, batch=None) -> None:
        """Call the extensions due at the segment's last step, with its loss when it was fetched.

        ``batch``: that step's host examples, looked at only if the loss is not finite.
        """
        step = self.trainer.step
        self.reporter.advance(step - self._step)
        self._step = step
        # Host sync point: the loss comes off the device only at these steps.
        self.loss = None if losses is None else sum(float(v) for v in losses) / len(losses)
        self.lr = self.trainer.lr_at(step - 1)
        self.batch = batch
        with self._stops_on_disk_errors():
            for ext in self.extensions:
                if ext.due(step, self.last_step):
                    ext(self)

    def step_figures(self) -> dict:
        """What a log line and a summary report beside the loss: the training accuracy of this step (from its
        forward pass; absent where not counted), fp16's loss scale and skipped steps (the whole run's)."""
        figures = {}
        accuracy = self.trainer.train_accuracy()
        if accuracy is not None:
            figures["train_accuracy"] = accuracy
        figures.update(self.trainer.loss_scaling())
        return figures

    def checkpoint(self) -> None:
        """Write the checkpoint of this step (a host sync); non-finite state is never written: the last good
        checkpoint stays the latest."""
        state = self.trainer.state_dict()
        key = checkpoint.non_finite(state)
        if key is not None:
            raise self.diverged(f"{key} holds non-finite values")
        self.checkpointer.write(self.trainer.step, state)
        self.trainer.seen_checkpoint = self.trainer.step  # its own: a later fit() continues from it

    def diverged(self, what: str):
        """The error for a non-finite loss or weights at this step, with its cause when it is the input.

        Only on this failure path the current batch, then the whole training
        data, is scanned for NaN/inf: non-finite input poisons the weights at
        the step it is met, which may be before the step the loss is looked at.
        The same pass takes the data's range: float examples beyond
        ``LARGE_INPUT`` are named as the cause (lowering the learning rate
        does not make an input of 3e38 fit float32 arithmetic).
        """
        step, cause, remedy = self.trainer.step, None, None
        if self.batch is not None and len(_scan_examples(self.batch)[0]):
            cause = f"the input batch at step {step} holds NaN/inf"
        else:
            bad, low, high = _scan_examples(self.trainer.dataset.x)
            if len(bad):
                cause = (f"`data` holds NaN/inf (example {bad[0]}"
                         + (f" and {len(bad) - 1} more" if len(bad) > 1 else "") + "), met before this step")
            elif max(abs(low), abs(high)) > LARGE_INPUT:
                cause = f"`data` ranges from {low:g} to {high:g}"
                remedy = (f"Inputs beyond {LARGE_INPUT:g} in magnitude make activations and gradients overflow "
                          "float32: scale `data` to a small range (0..1, or mean 0 and std 1)")
        return checkpoint.diverged(step, what, self.checkpointer.last_path, cause, remedy)

    def finish(self, scaling=None) -> dict:
        """Evaluate, write ``final.npz`` and the summary line; return the metrics.

        ``scaling(rate)`` gives (efficiency, 1-tower rate), NaN when not measured.
        """
        with self._stops_on_disk_errors():
            return self._finish(scaling or (lambda rate: (math.nan, math.nan)))

    def _finish(self, scaling) -> dict:
        """The end of a run: the final evaluation (with its progress bar on a terminal), ``final.npz``, the
        summary lines.

        The ``done:`` line's time is the whole run's: the trainer's building
        (``Trainer.build_seconds``: settings, a resume's checkpoint read, placement, data, model, replicas),
        training (from the settings line to the last step: the steps and what is
        due between them, log lines, summaries, checkpoints and their test
        accuracy), this final evaluation, the 1-tower scaling run when asked
        for, and writing (opening the logdir, ``final.npz``, and its step's
        checkpoint when no step of this fit wrote it).  Examples/sec stays a training figure: the steps'
        examples over the training time.  Sync point: the towers finish before
        the training clock stops.
        """
        t, cfg = self.trainer, self.trainer.cfg
        t.synchronize()
        trained = time.perf_counter()
        elapsed = trained - self._t0
        rate = (t.step - self.start_step) * t.global_batch / max(elapsed, 1e-9)
        self.reporter.end_bar()
        n_test = 0 if t.dataset.x_test is None else len(t.dataset.x_test)
        # Raw and EMA weights, each a pass over the test set: on a terminal a bar counts both passes' examples.
        with progress_bar(not cfg.quiet, total=2 * n_test, unit="example", desc="test evaluation",
                          leave=False) as bar:
            test = t.test_accuracy(progress=bar.update)
        evaluated = time.perf_counter()
        evaluation = evaluated - trained
        self.tensorboard.scalars(t.step, **test)
        result = {"step": t.step, "examples_per_sec": rate}
        if cfg.profile:
            self.reporter.say(t.profile_report())
        measured = time.perf_counter()
        efficiency, rate_1 = scaling(rate)
        scaling_s = time.perf_counter() - measured
        if not math.isnan(efficiency):
            result["scaling_efficiency"] = efficiency
        if test:
            result.update(test)
            top5 = (f"; top-5 {test['test_top5_accuracy']:.4f} (raw), {test['test_top5_accuracy_ema']:.4f} (EMA)"
                    if "test_top5_accuracy" in test else "")
            self.reporter.say(f"test accuracy: {test['test_accuracy']:.4f} (raw weights), "
                              f"{test['test_accuracy_ema']:.4f} (EMA weights){top5} on {self.test_examples}, "
                              f"evaluated in {evaluation:.1f} s")
        else:
            self.reporter.say(render("no test data (x_test/y_test in `data`, or `test_data`): test accuracy skipped"))
        weights = {f"params/{k}": v for k, v in t.get_weights().items()}
        weights.update({f"ema/{k}": v for k, v in t.get_weights(ema=True).items()})
        weights["step"] = numpy.int64(t.step)
        final = os.path.join(self.logdir, "final.npz")
        if not os.path.exists(checkpoint.final_checkpoint(final, t.step)):
            self.checkpoint()  # final.npz has the checkpoint of its step beside it (no step ran in this fit)
        with writing(final):
            atomic_save_npz(final, weights)
        build = t.build_seconds
        total = build + time.perf_counter() - self._opened
        timed_one = t.n_towers > 1 and not math.isnan(efficiency)  # a 1-tower run was timed
        written = total - build - elapsed - evaluation - (scaling_s if timed_one else 0.0)
        result.update(run_seconds=total, build_seconds=build, train_seconds=elapsed, eval_seconds=evaluation,
                      write_seconds=written)
        if timed_one:
            result["scaling_seconds"] = scaling_s
        scaling_text = ("" if math.isnan(efficiency) else
                   f", scaling efficiency {efficiency:.2f} (1 tower: {rate_1:.1f} examples/sec)")
        scaling_state = t.loss_scaling()
        skipped_text = ""
        if scaling_state:  # fp16: the steps of this run skipped for an inf or NaN gradient
            skipped = scaling_state["skipped_steps"] - self.skipped_at_start
            result.update(loss_scale=scaling_state["loss_scale"], skipped_steps=skipped)
            skipped_text = (f"; {skipped} of {t.step - self.start_step} steps skipped for fp16 overflow "
                            f"(loss scale now {scaling_state['loss_scale']:g})")
        self.reporter.record(**result)
        exchanges, per_step = t.executor.communication()
        towers = t.executor.running_towers
        parts = [f"building {build:.1f} s", f"training {elapsed:.1f} s", f"test evaluation {evaluation:.1f} s"]
        if "scaling_seconds" in result:
            parts.append(f"1-tower scaling run {scaling_s:.1f} s")
        parts.append(f"writing {written:.1f} s")
        self.reporter.say(
            f"done: {t.step - self.start_step} steps (to step {t.step}) in {total:.1f} s ({', '.join(parts)}); "
            f"training {rate:.1f} examples/sec{per_tower(rate, towers)} on {towers} tower{'s' if towers > 1 else ''} "
            f"({t.towers_text()}), {cfg.sync} sync, "
            f"{(exchanges - self.start_exchanges) / max(t.step - self.start_step, 1):.2f} {per_step}"
            f"{scaling_text}{skipped_text}; wrote {final}")
        self.reporter.close()  # a failed last flush is an error here, on the way out it is not
        self.tensorboard.close()
        return result

    def close(self) -> None:
        """Close the writers still open and release the logdir (idempotent).

        Writers are still open here only when the run stopped before ``finish``
        (an error, an interrupt): their last flush may fail too (the same full
        disk), which is dropped, so the error reported stays the first one;
        and an event file that got no summary is removed.
        """
        if self.reporter is not None:
            with contextlib.suppress(DiskError):
                self.reporter.close()
        if self.tensorboard is not None:
            with contextlib.suppress(DiskError):
                self.tensorboard.close(keep_empty=False)
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None


def settings_line(cfg, n_params: int | None = None, recipe=None) -> str:
    """The settings in effect, first line of a run: the model (and its trainable parameters), the model's
    ``recipe`` when the run took it, the optimizer's hyperparameters (those its file ``reads``), the
    learning-rate schedule and the recipe's options when they are on (warm-up, label smoothing, sync-BN,
    augmentation, a precision, gradient format or buckets other than the default); the default job's line is
    the one it always was."""
    model = f"model {cfg.model}" + (f" ({n_params:,} trainable parameters)" if n_params is not None else "")
    if recipe is not None:
        model += f", recipe {recipe.name}"
    parts = [model, f"optimizer {cfg.optimizer}", f"lr {cfg.lr:g}"]
    if cfg.lr_schedule in (None, "exponential"):
        parts.append(f"lr_decay {cfg.lr_decay:g}" + (f" per {cfg.decay_steps} steps" if cfg.decay_steps else "")
                     + (" staircase" if cfg.staircase else ""))
    elif cfg.lr_schedule == "piecewise":
        bounds, values = piecewise_values(cfg)
        at = "at epochs " if cfg.lr_epochs else ""
        parts.append(f"lr_schedule piecewise {at}{','.join(f'{b:g}' for b in bounds)} -> "
                     f"{','.join(f'{v:g}' for v in values)}")
    else:
        parts.append(f"lr_schedule {cfg.lr_schedule}")
    if cfg.warmup_steps:
        parts.append(f"warmup_steps {cfg.warmup_steps}")
    if cfg.warmup_epochs:
        parts.append(f"warmup_epochs {cfg.warmup_epochs:g}")
    # The optimizer's hyperparameters, as its file lists them: numbers with their value, flags by name when on.
    hyper = [name if value is True else f"{name} {value:g}" for name in OPTIMIZERS[cfg.optimizer].reads
             if (value := getattr(cfg, name)) is not False]
    parts.append(" ".join(hyper))
    parts += [f"batch {cfg.batch_size}/tower" + (f" x accumulate {cfg.accumulate}" if cfg.accumulate > 1 else ""),
              f"l2 {cfg.l2:g}"]
    if cfg.label_smoothing:
        parts.append(f"label_smoothing {cfg.label_smoothing:g}")
    if cfg.sync_bn:
        parts.append("sync_bn")
    if cfg.augment not in (None, "none"):
        parts.append(f"augment {cfg.augment}")
    steps = f"steps {cfg.steps}" if cfg.epochs is None else f"epochs {cfg.epochs} = steps {cfg.steps}"
    parts += [f"ema_decay {cfg.ema_decay:g}", steps, f"sync {cfg.sync}"]
    # How a step computes and averages, when not the float32 default.
    if cfg.precision != "fp32":
        parts.append(f"precision {cfg.precision}"
                     + (f" (loss_scale_growth {cfg.loss_scale_growth})" if cfg.precision == "fp16" else ""))
    if cfg.allreduce_dtype != "fp32":
        parts.append(f"allreduce_dtype {cfg.allreduce_dtype}")
    if cfg.allreduce_bucket_mib:
        parts.append(f"allreduce_bucket_mib {cfg.allreduce_bucket_mib:g}")
    return "settings: " + ", ".join(parts)


# Float examples larger than this in magnitude are named as the cause of a divergence: a weight of about
# 0.1 times them, summed over a layer's inputs, grows past what one update at a usual learning rate keeps
# finite for long (pixels as floats 0..255 are below it: a lower `lr` is the advice there).
LARGE_INPUT = 1e4


def _scan_examples(x, chunk: int = 4096) -> tuple[numpy.ndarray, float, float]:
    """(indices of the examples of ``x`` holding NaN/inf, the smallest and largest finite value), read in
    chunks (any array-like with slices); uint8 pixels, scaled to 0..1, give (none, 0, 1).

    Only on the failure path: it reads the whole data set once (TFRecord data
    from disk), in bounded memory.
    """
    if not numpy.issubdtype(x.dtype, numpy.floating):
        return numpy.zeros(0, numpy.int64), 0.0, 1.0
    bad, low, high = [], math.inf, -math.inf
    for start in range(0, len(x), chunk):
        c = numpy.asarray(x[start:start + chunk]).reshape(min(chunk, len(x) - start), -1)
        finite = numpy.isfinite(c)
        bad.append(start + numpy.flatnonzero(~finite.all(axis=1)))
        if finite.any():
            low, high = min(low, float(c[finite].min())), max(high, float(c[finite].max()))
    bad = numpy.concatenate(bad) if bad else numpy.zeros(0, numpy.int64)
    return bad, (low if high >= low else 0.0), (high if high >= low else 0.0)


def default_interval(steps: int, points: int = 20, most: int = 100) -> int:
    """Steps between log lines (and summaries) when not set: about ``points`` of them over the run's ``steps``,
    at least 1 step and at most ``most`` (a 2,000-step run logs every 100, a 300-step run every 15)."""
    return max(1, min(most, steps // points))


def new_logdir(parent: str = "runs") -> str:
    """A new folder ``parent/<YYYYmmdd-HHMMSS>``, with ``-2``, ``-3``, ... when that name is taken.

    Made with an exclusive ``mkdir``, so runs started in the same second (a
    Python loop of quick ``fit()``s, two processes) never share one.
    """
    _make_logdir(parent)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1, 10_000):
        path = os.path.join(parent, stamp if k == 1 else f"{stamp}-{k}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise DiskError(path, e, "create") from None
    raise UserError(f"{parent} holds 10,000 runs started at {stamp}: set `logdir`")


def _make_logdir(logdir: str) -> None:
    try:
        os.makedirs(logdir, exist_ok=True)
    except FileExistsError:
        raise UserError(f"`logdir` {logdir} exists and is not a directory: pick another path") from None
    except NotADirectoryError:
        raise UserError(f"`logdir` {logdir} is inside a file, not a directory: pick another path") from None
    except OSError as e:  # read-only, full, no permission: as any other failed write
        raise DiskError(logdir, e, "create") from None
