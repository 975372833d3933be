"""Train a model with one replica (tower) per device: ``python -m towers.train``.

The script reads top to bottom: settings, placement, data, model and replicas,
optimizer/EMA/all-reduce, the loop, teardown.  One training step
(``Trainer.train_step``) is, for the global batch of ``n_towers * batch_size``:

1. input:    each tower's contiguous slice is staged on its device;
2. compute:  each tower runs forward and backward into its flat gradient buffer;
3. all-reduce: the towers' gradient buffers are averaged in place
   (``towers.allreduce.TowerAllReduce``: NCCL across GPUs, a mean on one device);
4. update:   every replica applies the same SGD step; the first also updates
   the EMA of the weights, in the same fused pass.

Replicas start from the same seeded values and apply identical updates, so they
stay bit-identical.  Losses stay on the device except at log steps.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy

from towers import TrainingError, UserError, checkpoint
from towers.allreduce import TowerAllReduce
from towers.checkpoint import atomic_save_npz, flat_to_named
from towers.data import BatchSource, Prefetcher, Stager, load_dataset
from towers.model import Replica, build_model
from towers.optimizer import EMA, SGD, learning_rate
from towers.cpu_towers import TowerThreads, chunks, cpu_count, set_blas_threads
from towers.placement import on_stream, resolve
from towers.profile import PhaseTimer, one_tower_rate, scaling_efficiency
from towers.summaries import Reporter, TensorBoard
from towers.sync import check_mode, check_replicas

DEFAULT_DATA = str(Path(__file__).resolve().parents[1] / "data" / "digits.npz")


# -- settings ------------------------------------------------------------------------


@dataclass
class Config:
    """Every setting of a run, with its default (the command-line flags mirror these)."""

    # placement
    n_gpu: int | None = None  # towers; None: 1, or one per --devices entry
    devices: str | None = None  # "cpu" or "0,2"
    soft_placement: bool = True
    log_placement: bool = False
    # data
    data: str = DEFAULT_DATA
    test_data: str | None = None
    x_key: str = "x"
    y_key: str = "y"
    # model
    model: str = "mlp"
    hidden: int = 500
    # optimization (the book's MNIST example)
    batch_size: int = 100  # per tower
    steps: int = 2000
    lr: float = 0.8
    lr_decay: float = 0.99  # per epoch
    staircase: bool = False
    momentum: float = 0.0
    l2: float = 1e-4
    ema_decay: float = 0.99
    seed: int = 0
    # keeping replicas together
    sync: str = "grads"  # or "weights"
    average_every: int = 1  # K, with --sync weights
    check_replicas: int = 0  # every K steps; 0: only at the end
    # output
    log_every: int = 100
    logdir: str | None = None  # default runs/<timestamp>
    quiet: bool = False
    # checkpoints and summaries (towers.checkpoint, towers.summaries.TensorBoard)
    checkpoint_every: int = 1000
    keep_checkpoints: int = 5
    resume: bool = False
    summary_every: int = 100
    # performance
    cpu_towers: str = "threads"  # CPU towers concurrently ("threads") or one after another ("serial")
    blas_threads: int = 0  # 0: auto (one per concurrent CPU tower, else every core)
    profile: bool = False


# --help text, one flag a line: the Config field, then its help.
HELP = dict(line.split(None, 1) for line in """
n_gpu             number of towers (default 1, or one per --devices entry)
devices           'cpu', or GPU ids such as 0,2
soft_placement    bend impossible placements (no GPU: CPU; too few GPUs: share) instead of failing
log_placement     print which device runs each tower, the EMA, input parsing and the reducer
data              training data (.npz with x, y and optionally x_test, y_test)
test_data         separate test data (.npz); default: x_test/y_test of --data
x_key             npz key of the examples
y_key             npz key of the labels
model             mlp, lenet5, or package.module:function returning a towers.model.Sequential
hidden            hidden units of the mlp
batch_size        examples per tower per step
steps             training steps
lr                initial learning rate
lr_decay          learning-rate decay per epoch (TF exponential_decay)
staircase         decay the learning rate once per whole epoch
momentum          SGD momentum (0: plain SGD)
l2                L2 regularization scale on weights
ema_decay         EMA decay (TF ExponentialMovingAverage)
seed              seed of weights and shuffling
sync              grads: average gradients every step; weights: each tower steps alone, weights averaged every K
average_every     K: steps between weight averages with --sync weights
check_replicas    compare every replica with the first every K steps (0: only at the end)
log_every         steps between log lines
logdir            output directory (default runs/<timestamp>)
quiet             no progress bar and no per-step log lines
checkpoint_every  steps between checkpoints (ckpt-<step>.npz in --logdir); one is always written at the end; 0: only then
keep_checkpoints  how many of the newest checkpoints to keep
resume            continue from the latest valid checkpoint in --logdir (--steps is the total, not more steps)
summary_every     steps between TensorBoard summaries (scalars, weight and gradient histograms; a host sync); 0: none
cpu_towers        CPU towers run 'threads' (concurrently, the default: fastest measured) or 'serial'
blas_threads      BLAS threads for the process (0: auto, 1 per concurrent CPU tower, else all cores)
profile           print a per-phase, per-tower time breakdown at the end (syncs GPU streams per phase)
""".strip().splitlines())


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + line
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog: str = "python -m towers.train") -> argparse.ArgumentParser:
    ap = _Parser(prog=prog, description="Multi-tower training with CuPy + NCCL, or NumPy on the CPU.")
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "soft_placement":
            ap.add_argument("--no-soft-placement", dest="soft_placement", action="store_false", help=HELP[f.name])
        elif f.type == "bool":
            ap.add_argument(flag, action="store_true", help=HELP[f.name])
        else:
            kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
            ap.add_argument(flag, type=kind, default=f.default, metavar=f.name.upper(), help=HELP[f.name])
    return ap


def parse_config(argv=None) -> Config:
    return Config(**vars(build_parser().parse_args(argv)))


def _check(cfg: Config) -> None:
    """Preconditions that need no data: fail before anything is allocated."""
    for name in ("batch_size", "steps", "log_every", "hidden"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.lr <= 0 or not 0 < cfg.lr_decay <= 1:
        raise UserError("--lr must be > 0 and --lr-decay in (0, 1]")
    if not 0 <= cfg.momentum < 1 or not 0 <= cfg.ema_decay < 1 or cfg.l2 < 0:
        raise UserError("--momentum and --ema-decay must be in [0, 1), --l2 >= 0")
    if cfg.check_replicas < 0:
        raise UserError(f"--check-replicas must be 0 (end only) or a number of steps, got {cfg.check_replicas}")
    check_mode(cfg.sync, cfg.average_every)
    if cfg.checkpoint_every < 0 or cfg.summary_every < 0 or cfg.keep_checkpoints < 1:
        raise UserError("--checkpoint-every and --summary-every must be >= 0, --keep-checkpoints >= 1")
    if cfg.sync == "weights" and cfg.checkpoint_every % cfg.average_every:
        raise UserError(
            f"with --sync weights, --checkpoint-every ({cfg.checkpoint_every}) must be a multiple of "
            f"--average-every ({cfg.average_every}): a checkpoint holds the weights right after an average"
        )
    if cfg.resume and not cfg.logdir:
        raise UserError("--resume needs --logdir DIR: the directory of the run to continue")
    if cfg.cpu_towers not in ("threads", "serial") or cfg.blas_threads < 0:
        raise UserError(
            f"--cpu-towers must be threads or serial (got {cfg.cpu_towers!r}), --blas-threads >= 0"
        )


# -- the trainer ---------------------------------------------------------------------


class Trainer:
    """Replicas, their streams, the all-reduce, the optimizers and the EMA.

    ``nccl`` replaces ``cupy.cuda.nccl`` (tests pass a host-memory stand-in).
    """

    def __init__(self, cfg: Config, placement, dataset, nccl=None):
        self.cfg, self.placement, self.dataset = cfg, placement, dataset
        self.devices = placement.towers
        self.model = build_model(cfg.model, dataset.example_shape, dataset.num_classes, cfg.hidden)
        init = self.model.init_params(cfg.seed)  # one draw: every replica starts identical
        self.streams, self.replicas, self.stagers = [], [], []
        for dev in self.devices:
            with dev.scope():
                # Non-blocking streams are not ordered with the legacy default
                # stream, so all of a tower's work stays inside its stream.
                stream = dev.xp.cuda.Stream(non_blocking=True) if dev.is_gpu else None
                replica = Replica(self.model, dev.xp)
                replica.set_params(init)
            self.streams.append(stream)
            self.replicas.append(replica)
            self.stagers.append(Stager(dev, stream, cfg.batch_size, dataset.example_shape, dataset.x.dtype))
        with self.devices[0].scope():
            self.ema = EMA(self.replicas[0].params, cfg.ema_decay)
        # In grads mode the EMA is fused into the first tower's update; in
        # weights mode it follows the averaged weights (see towers.sync).
        self.weights_mode = cfg.sync == "weights"
        fused_ema = None if self.weights_mode else self.ema
        self.optimizers = []
        for i, (dev, r) in enumerate(zip(self.devices, self.replicas)):
            with dev.scope():
                self.optimizers.append(SGD(r.params, cfg.momentum, fused_ema if i == 0 else None))
        # Devices were validated by placement.resolve before this communicator.
        self.allreduce = TowerAllReduce(placement, self.streams, nccl)
        self.step = 0
        self.all_reduces = 0  # collectives issued, for the communication report
        self.last_average = None  # step count right after the last weight average
        self.n_averages = 0
        self.examples_per_epoch = len(dataset.x)
        n = len(self.replicas)
        self.timer = PhaseTimer(cfg.profile, n, [s.synchronize if s is not None else None for s in self.streams])
        self._tower_timers = [self.timer.for_tower(i) for i in range(n)]
        # CPU towers: concurrent threads with 1 BLAS thread each (or serial with
        # all cores in BLAS); see towers.cpu_towers for why and the benchmark.
        all_cpu = not any(d.is_gpu for d in self.devices)
        self._pool = None
        self._blas = None
        if all_cpu:
            # (Not with an NCCL stand-in: its ranks are driven by one thread.)
            threaded = n > 1 and cfg.cpu_towers == "threads" and not self.allreduce.uses_nccl
            blas = cfg.blas_threads or (max(1, cpu_count() // n) if threaded else cpu_count())
            self._blas = set_blas_threads(blas)
            self.blas_threads = blas
            if threaded:
                self._pool = TowerThreads(n)
                parts = chunks(self.model.size, n)
                # Tower thread i averages and updates slice i of EVERY replica's
                # buffers, so the all-reduce and the update are split across cores.
                self._parts = [(part, [r.grads[part] for r in self.replicas]) for part in parts]
                self._losses = [None] * n

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * len(self.replicas)

    def lr(self) -> float:
        seen = self.step * self.global_batch
        return learning_rate(self.cfg.lr, self.cfg.lr_decay, seen, self.examples_per_epoch, self.cfg.staircase)

    def train_step(self, x, y, want_loss: bool = False):
        """One synchronous step on the global batch ``x``, ``y`` (host arrays).

        Returns the towers' losses as device scalars when ``want_loss``.  With
        concurrent CPU towers the call returns while the other tower threads
        finish their share of the update; ``synchronize`` (and the next step)
        waits for it.
        """
        if self._pool is not None:  # concurrent CPU towers: see _cpu_tower_step
            # The arguments are bound to this step's call, not stored on self:
            # without a barrier (weights mode) a late tower thread of the last
            # step could otherwise read this step's batch.
            args = (x, y, want_loss, self.lr(), self.step)
            self._pool.run(lambda i: self._cpu_tower_step(i, *args))
            if not self.weights_mode:
                self.all_reduces += 1  # one all-reduce, shared out in slices among the threads
            elif want_loss:
                self._pool.wait()  # no barrier in weights mode: wait for every tower's loss
            return self._step_done(list(self._losses) if want_loss else None)
        b, lr, t = self.cfg.batch_size, self.lr(), self.timer
        losses = []
        # 1-2. Input and compute, tower by tower (GPU work is queued, not waited on).
        for i, (dev, stream, r) in enumerate(zip(self.devices, self.streams, self.replicas)):
            with dev.scope(), on_stream(stream):
                with t("stage", i):
                    xs, ys = self.stagers[i].stage(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
                losses.append(r.loss_and_grads(xs, ys, self.cfg.l2, want_loss, self._tower_timers[i]))
        # 3. All-reduce: average the gradient buffers across towers (grads mode).
        if not self.weights_mode:
            with t("all-reduce"):
                self._average([r.grads for r in self.replicas])
        # 4. Update (and the EMA on the first tower), the same on every replica.
        for i, (dev, stream, r, opt) in enumerate(zip(self.devices, self.streams, self.replicas, self.optimizers)):
            with dev.scope(), on_stream(stream), t("update+EMA", i):
                opt.step(r.grads, lr, self.step)
        return self._step_done(losses if want_loss else None)

    def _step_done(self, losses):
        self.step += 1
        # 5. Weights mode: every K steps average the weights, then the EMA follows.
        if self.weights_mode and self.step % self.cfg.average_every == 0:
            with self.timer("all-reduce"):
                self.average_weights()
        self.timer.step_done()
        return losses

    def _cpu_tower_step(self, i: int, x, y, want_loss: bool, lr: float, step: int) -> None:
        """Tower ``i``'s share of a step, on its own thread (concurrent CPU towers)."""
        b, t = self.cfg.batch_size, self.timer
        with t("stage", i):
            xs, ys = self.stagers[i].stage(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
        self._losses[i] = self.replicas[i].loss_and_grads(xs, ys, self.cfg.l2, want_loss, self._tower_timers[i])
        if self.weights_mode:  # each tower steps alone; averages happen every K steps
            with t("update+EMA", i):
                self.optimizers[i].step(self.replicas[i].grads, lr, step)
            return
        with t("barrier", i):
            self._pool.barrier.wait()  # every tower's gradients are complete
        part, grads = self._parts[i]
        with t("all-reduce", i):
            self.allreduce.average(grads)
        with t("update+EMA", i):
            for g, opt in zip(grads, self.optimizers):
                opt.step(g, lr, step, part)

    def _average(self, buffers) -> None:
        if len(buffers) > 1:
            self.allreduce.average(buffers)
            self.all_reduces += 1

    def average_weights(self) -> None:
        """Weights mode: average parameters (and momentum), then update the EMA."""
        if self._pool is not None:
            self._pool.wait()  # the tower threads' updates are complete
        self._average([r.params for r in self.replicas])
        if self.optimizers[0].velocity is not None:
            self._average([o.velocity for o in self.optimizers])
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
        if self._pool is not None:
            self._pool.wait()
        for s in self.streams:
            if s is not None:
                s.synchronize()

    def evaluate(self, use_ema: bool) -> tuple[float, float]:
        """(loss, accuracy) on the test data with the raw or the EMA weights."""
        ds = self.dataset
        dev = self.devices[0]
        with dev.scope():
            self.synchronize()
            r = Replica(self.model, dev.xp)
            r.set_params(self.ema.shadow if use_ema else self.replicas[0].params)
            return r.evaluate(ds.x_test, ds.y_test)

    def close(self) -> None:
        try:
            self.synchronize()
        finally:
            if self._pool is not None:
                self._pool.close()
            if self._blas is not None:
                self._blas.restore_original_limits()
            self.allreduce.close()


# -- the run -------------------------------------------------------------------------


def _make_logdir(logdir: str) -> None:
    try:
        os.makedirs(logdir, exist_ok=True)
    except FileExistsError:
        raise UserError(f"--logdir {logdir} exists and is not a directory: pick another path") from None
    except OSError as e:
        raise UserError(f"cannot create --logdir {logdir}: {e.strerror}; pick a writable path") from None


def run(cfg: Config, nccl=None) -> dict:
    """Train as ``cfg`` says; return the final metrics."""
    _check(cfg)
    # -- placement: decided (and validated) before any device memory or NCCL.
    placement = resolve(cfg.n_gpu, cfg.devices, cfg.soft_placement)
    if placement.notice:
        print(placement.notice, file=sys.stderr, flush=True)
    if cfg.log_placement:
        print(placement.table(), flush=True)

    # -- data: parsed on the CPU, batches assembled on a background thread.
    dataset = load_dataset(cfg.data, cfg.x_key, cfg.y_key, cfg.test_data)
    source = BatchSource(dataset, cfg.batch_size * placement.n_towers, cfg.seed)
    logdir = cfg.logdir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    resume = _resume_point(cfg, logdir, dataset, placement.n_towers)
    if resume is not None:  # the same pipeline, at the saved position
        source = BatchSource(dataset, source.global_batch, cfg.seed, *resume.position)

    # -- model, replicas, optimizer, EMA, all-reduce.
    trainer = Trainer(cfg, placement, dataset, nccl=nccl)
    if resume is not None:
        checkpoint.restore(trainer, resume)
    start_step = trainer.step
    _make_logdir(logdir)
    ckpt = checkpoint.Checkpointer(logdir, cfg, dataset, placement.n_towers, start_step, source.position)
    ckpt.last_path = resume.path if resume is not None else None
    tb = TensorBoard(logdir, cfg.summary_every, start_step)
    reporter = Reporter(logdir, cfg.steps, start_step=start_step, quiet=cfg.quiet)
    prefetch = Prefetcher(source, max(cfg.steps - start_step, 0))

    # -- the loop.
    t_start = t_last = time.perf_counter()
    last_step = start_step
    next_check = cfg.check_replicas or cfg.steps + 1
    try:
        for _ in range(cfg.steps - start_step):
            with trainer.timer("input wait"):
                x, y = prefetch.get()
            log_now = (trainer.step + 1) % cfg.log_every == 0 or trainer.step + 1 == cfg.steps
            summary_now, ckpt_now = tb.due(trainer.step + 1), ckpt.due(trainer.step + 1, cfg.steps)
            lr = trainer.lr()
            losses = trainer.train_step(x, y, want_loss=log_now or summary_now or ckpt_now)
            if trainer.step == cfg.steps:
                trainer.finish()  # weights mode: a last average before the final checkpoint
            reporter.advance()
            if losses is not None:
                # Host sync point: the loss comes off the device only at these steps.
                loss = sum(float(v) for v in losses) / len(losses)
                if not numpy.isfinite(loss):
                    raise checkpoint.diverged(trainer.step, f"the loss is {loss}", ckpt.last_path)
            if summary_now or ckpt_now:
                # Host sync point: tower threads and GPU streams finish the step
                # before its weights are read.
                trainer.synchronize()
            if summary_now:
                tb.write_step(trainer, loss, lr)
            if ckpt_now:
                ckpt.save(trainer)
                if trainer.step != cfg.steps:  # the end is evaluated below
                    tb.scalars(trainer.step, **_test_accuracy(trainer))
            if log_now:
                now = time.perf_counter()
                steps = trainer.step - last_step
                reporter.log_step(trainer.step, loss, lr, steps * trainer.global_batch / (now - t_last),
                                  (now - t_last) / steps)
                t_last, last_step = now, trainer.step
            if trainer.step >= next_check and trainer.check_replicas():
                next_check = (trainer.step // cfg.check_replicas + 1) * cfg.check_replicas
        trainer.check_replicas()  # always at the end: the saved weights are every replica's
        trainer.synchronize()
        elapsed = time.perf_counter() - t_start
        test = _test_accuracy(trainer)
        tb.scalars(trainer.step, **test)
    finally:
        prefetch.close()
        reporter.bar.close()
        tb.close()

    # -- teardown: evaluate, write the final weights.
    result = {"step": trainer.step,
              "examples_per_sec": (trainer.step - start_step) * trainer.global_batch / max(elapsed, 1e-9)}
    if cfg.profile:
        reporter.say(trainer.timer.report(trainer.global_batch))
    # Scaling efficiency needs the 1-tower speed: measured here by a short
    # 1-tower run (towers.profile.one_tower_rate), only when there are N > 1.
    rate_1 = one_tower_rate(cfg, placement, dataset) if placement.n_towers > 1 else result["examples_per_sec"]
    result["scaling_efficiency"] = scaling_efficiency(result["examples_per_sec"], placement.n_towers, rate_1)
    if test:
        result.update(test)
        reporter.say(f"test accuracy: {test['test_accuracy']:.4f} (raw weights), "
                     f"{test['test_accuracy_ema']:.4f} (EMA weights)")
    else:
        reporter.say("no test data (x_test/y_test in --data, or --test-data): test accuracy skipped")
    arrays = {f"params/{k}": v for k, v in flat_to_named(trainer.model, trainer.replicas[0].params).items()}
    arrays.update({f"ema/{k}": v for k, v in flat_to_named(trainer.model, trainer.ema.shadow).items()})
    arrays["step"] = numpy.int64(trainer.step)
    atomic_save_npz(os.path.join(logdir, "final.npz"), arrays)
    reporter.record(**result)
    reporter.say(
        f"done: {trainer.step - start_step} steps (to step {trainer.step}) in {elapsed:.1f} s, "
        f"{result['examples_per_sec']:.1f} examples/sec "
        f"on {placement.n_towers} tower{'s' if placement.n_towers > 1 else ''} "
        f"({', '.join(map(str, placement.towers))}), {cfg.sync} sync, "
        f"{trainer.all_reduces / max(trainer.step - start_step, 1):.2f} all-reduces/step, "
        f"scaling efficiency {result['scaling_efficiency']:.2f} (1 tower: {rate_1:.1f} examples/sec); "
        f"wrote {os.path.join(logdir, 'final.npz')}"
    )
    reporter.close()
    trainer.close()
    return result


def _resume_point(cfg: Config, logdir: str, dataset, n_towers: int):
    """The checkpoint ``--resume`` continues from (None: fresh); a fresh run never overwrites one."""
    def say(line, note=False):
        print(line, file=sys.stderr if note else sys.stdout, flush=True)

    if cfg.resume:
        return checkpoint.find_resume(cfg, logdir, dataset, n_towers, say)
    existing = checkpoint.list_checkpoints(logdir) if os.path.isdir(logdir) else []
    if existing:
        raise UserError(f"{logdir} already holds checkpoints (newest {existing[0][1]}): "
                        "pass --resume to continue that run, or choose another --logdir")
    return None


def _test_accuracy(trainer: Trainer) -> dict:
    """Test accuracy with the raw and the EMA weights ({} without test data)."""
    if trainer.dataset.x_test is None:
        return {}
    return {"test_accuracy": trainer.evaluate(use_ema=False)[1], "test_accuracy_ema": trainer.evaluate(use_ema=True)[1]}


def main(argv=None) -> int:
    cfg = parse_config(argv)
    try:
        run(cfg)
    except (UserError, TrainingError) as e:  # a user mistake (2) or a run that cannot go on (1)
        print(f"towers.train: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UserError) else 1
    except KeyboardInterrupt:
        print("towers.train: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
