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

from towers import UserError
from towers.allreduce import TowerAllReduce
from towers.checkpoint import atomic_save_npz, flat_to_named
from towers.data import BatchSource, Prefetcher, Stager, load_dataset
from towers.model import Replica, build_model
from towers.optimizer import EMA, SGD, learning_rate
from towers.cpu_towers import TowerThreads, chunks, cpu_count, set_blas_threads
from towers.placement import resolve
from towers.profile import PhaseTimer, one_tower_rate, scaling_efficiency
from towers.summaries import Reporter

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
    # output
    log_every: int = 100
    logdir: str | None = None  # default runs/<timestamp>
    quiet: bool = False
    # performance
    cpu_towers: str = "threads"  # CPU towers concurrently ("threads") or one after another ("serial")
    blas_threads: int = 0  # 0: auto (one per concurrent CPU tower, else every core)
    profile: bool = False


HELP = {
    "n_gpu": "number of towers (default 1, or one per --devices entry)",
    "devices": "'cpu', or GPU ids such as 0,2",
    "soft_placement": "bend impossible placements (no GPU: CPU; too few GPUs: share) instead of failing",
    "log_placement": "print which device runs each tower, the EMA, input parsing and the reducer",
    "data": "training data (.npz with x, y and optionally x_test, y_test)",
    "test_data": "separate test data (.npz); default: x_test/y_test of --data",
    "x_key": "npz key of the examples", "y_key": "npz key of the labels",
    "model": "mlp, or package.module:function returning a towers.model.Sequential",
    "hidden": "hidden units of the mlp",
    "batch_size": "examples per tower per step",
    "steps": "training steps", "lr": "initial learning rate",
    "lr_decay": "learning-rate decay per epoch (TF exponential_decay)",
    "staircase": "decay the learning rate once per whole epoch",
    "momentum": "SGD momentum (0: plain SGD)", "l2": "L2 regularization scale on weights",
    "ema_decay": "EMA decay (TF ExponentialMovingAverage)", "seed": "seed of weights and shuffling",
    "log_every": "steps between log lines", "logdir": "output directory (default runs/<timestamp>)",
    "quiet": "no progress bar and no per-step log lines",
    "cpu_towers": "CPU towers run 'threads' (concurrently, the default: fastest measured) or 'serial'",
    "blas_threads": "BLAS threads for the process (0: auto, 1 per concurrent CPU tower, else all cores)",
    "profile": "print a per-phase, per-tower time breakdown at the end (syncs GPU streams per phase)",
}


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
        self.optimizers = []
        for i, (dev, r) in enumerate(zip(self.devices, self.replicas)):
            with dev.scope():
                self.optimizers.append(SGD(r.params, cfg.momentum, self.ema if i == 0 else None))
        # Devices were validated by placement.resolve before this communicator.
        self.allreduce = TowerAllReduce(placement, self.streams, nccl)
        self.step = 0
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
            threaded = n > 1 and cfg.cpu_towers == "threads"
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
        if self._pool is not None:
            self._step_args = (x, y, want_loss, self.lr(), self.step)
            self._pool.run(self._cpu_tower_step)
            self.step += 1
            self.timer.step_done()
            return list(self._losses) if want_loss else None
        b, lr, t = self.cfg.batch_size, self.lr(), self.timer
        losses = []
        # 1-2. Input and compute, tower by tower (GPU work is queued, not waited on).
        for i, (dev, stream, r) in enumerate(zip(self.devices, self.streams, self.replicas)):
            with dev.scope(), _on(stream):
                with t("stage", i):
                    xs, ys = self.stagers[i].stage(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
                losses.append(r.loss_and_grads(xs, ys, self.cfg.l2, want_loss, self._tower_timers[i]))
        # 3. All-reduce: average the gradient buffers across towers.
        with t("all-reduce"):
            self.allreduce.average([r.grads for r in self.replicas])
        # 4. Update (and the EMA on the first tower), the same on every replica.
        for i, (dev, stream, r, opt) in enumerate(zip(self.devices, self.streams, self.replicas, self.optimizers)):
            with dev.scope(), _on(stream), t("update+EMA", i):
                opt.step(r.grads, lr, self.step)
        self.step += 1
        self.timer.step_done()
        return losses if want_loss else None

    def _cpu_tower_step(self, i: int) -> None:
        """Tower ``i``'s share of a step, on its own thread (concurrent CPU towers)."""
        x, y, want_loss, lr, step = self._step_args
        b, t = self.cfg.batch_size, self.timer
        with t("stage", i):
            xs, ys = self.stagers[i].stage(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b])
        self._losses[i] = self.replicas[i].loss_and_grads(xs, ys, self.cfg.l2, want_loss, self._tower_timers[i])
        with t("barrier", i):
            self._pool.barrier.wait()  # every tower's gradients are complete
        part, grads = self._parts[i]
        with t("all-reduce", i):
            self.allreduce.average(grads)
        with t("update+EMA", i):
            for g, opt in zip(grads, self.optimizers):
                opt.step(g, lr, step, part)

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


def _on(stream):
    return stream if stream is not None else _Null()


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- the run -------------------------------------------------------------------------


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

    # -- model, replicas, optimizer, EMA, all-reduce.
    trainer = Trainer(cfg, placement, dataset, nccl=nccl)
    logdir = cfg.logdir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(logdir, exist_ok=True)
    reporter = Reporter(logdir, cfg.steps, quiet=cfg.quiet)
    prefetch = Prefetcher(source, cfg.steps)

    # -- the loop.
    t_start = t_last = time.perf_counter()
    last_step = 0
    try:
        for _ in range(cfg.steps):
            with trainer.timer("input wait"):
                x, y = prefetch.get()
            log_now = (trainer.step + 1) % cfg.log_every == 0 or trainer.step + 1 == cfg.steps
            lr = trainer.lr()
            losses = trainer.train_step(x, y, want_loss=log_now)
            reporter.advance()
            if log_now:
                # Host sync point: the loss comes off the device only here.
                loss = sum(float(v) for v in losses) / len(losses)
                now = time.perf_counter()
                steps = trainer.step - last_step
                reporter.log_step(trainer.step, loss, lr, steps * trainer.global_batch / (now - t_last),
                                  (now - t_last) / steps)
                t_last, last_step = now, trainer.step
        trainer.synchronize()
        elapsed = time.perf_counter() - t_start
    finally:
        prefetch.close()
        reporter.bar.close()

    # -- teardown: evaluate, write the final weights.
    result = {"step": trainer.step, "examples_per_sec": trainer.step * trainer.global_batch / elapsed}
    if cfg.profile:
        reporter.say(trainer.timer.report(trainer.global_batch))
    # Scaling efficiency needs the 1-tower speed: measured here by a short
    # 1-tower run (towers.profile.one_tower_rate), only when there are N > 1.
    rate_1 = one_tower_rate(cfg, placement, dataset) if placement.n_towers > 1 else result["examples_per_sec"]
    result["scaling_efficiency"] = scaling_efficiency(result["examples_per_sec"], placement.n_towers, rate_1)
    if dataset.x_test is not None:
        _, acc = trainer.evaluate(use_ema=False)
        _, acc_ema = trainer.evaluate(use_ema=True)
        result.update(test_accuracy=acc, test_accuracy_ema=acc_ema)
        reporter.say(f"test accuracy: {acc:.4f} (raw weights), {acc_ema:.4f} (EMA weights)")
    else:
        reporter.say("no test data (x_test/y_test in --data, or --test-data): test accuracy skipped")
    arrays = {f"params/{k}": v for k, v in flat_to_named(trainer.model, trainer.replicas[0].params).items()}
    arrays.update({f"ema/{k}": v for k, v in flat_to_named(trainer.model, trainer.ema.shadow).items()})
    arrays["step"] = numpy.int64(trainer.step)
    atomic_save_npz(os.path.join(logdir, "final.npz"), arrays)
    reporter.record(**result)
    reporter.say(
        f"done: {trainer.step} steps in {elapsed:.1f} s, {result['examples_per_sec']:.1f} examples/sec "
        f"on {placement.n_towers} tower{'s' if placement.n_towers > 1 else ''} "
        f"({', '.join(map(str, placement.towers))}); scaling efficiency {result['scaling_efficiency']:.2f} "
        f"(1 tower: {rate_1:.1f} examples/sec); wrote {os.path.join(logdir, 'final.npz')}"
    )
    reporter.close()
    trainer.close()
    return result


def main(argv=None) -> int:
    cfg = parse_config(argv)
    try:
        run(cfg)
    except UserError as e:
        print(f"towers.train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("towers.train: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
