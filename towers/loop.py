"""The training loop: steps to ``cfg.steps`` with the extensions after each, and the scaling figure.

``fit(trainer, extensions)`` is what ``Trainer.fit`` and the command line run:

1. the extensions are checked, then the logdir is opened and locked and the
   run resumed or refused (``towers.extensions.Run.open``);
2. each step's batch comes from the background batch thread
   (``towers.data.batches.Prefetcher``), or, with the training set on the
   GPUs, as row indices drawn here (cheap) and gathered there;
3. after each step the extensions due are called (``Run.after_step``); at the
   end the replicas are compared and ``Run.finish`` writes ``final.npz`` and
   the summary line.

The loop talks to the trainer through its public API only (``step``,
``train_step``/``train_step_at``, ``finish``, ``check_replicas``), so the
step engine knows nothing of logdirs, and extensions nothing of towers.

``scaling(trainer, rate)``: the scaling efficiency against a fresh one-tower
trainer on the first tower's device, timed after the run when
``measure_scaling`` is set.
"""
from __future__ import annotations

import dataclasses
import math
import time

from towers.data.batches import Prefetcher
from towers.devices.placement import Placement
from towers.errors import UserError
from towers.extensions import Extension, Run
from towers.profiling import scaling_efficiency


def fit(trainer, extensions=()) -> dict:
    """Train ``trainer`` to ``cfg.steps`` (a total); return the final metrics (see the module docstring)."""
    extensions = check_extensions(extensions)
    cfg = trainer.cfg
    run = Run.open(trainer, cfg.logdir, extensions)
    prefetch = None if trainer.device_data else Prefetcher(trainer.source, max(cfg.steps - trainer.step, 0))
    try:
        run.start()
        while trainer.step < cfg.steps:
            want = run.wants_loss(trainer.step + 1)
            x = None
            if prefetch is None:
                losses = trainer.train_step_at(trainer.source.next_indices(), want_loss=want)
            else:
                with trainer.timer("input wait"):
                    x, y = prefetch.get()
                losses = trainer.train_step(x, y, want_loss=want)
            if trainer.step == cfg.steps:
                trainer.finish()  # weights mode: a last average before the final checkpoint
            run.after_step(losses, x)
        trainer.check_replicas()  # always at the end: the saved weights are every replica's
        return run.finish(lambda rate: scaling(trainer, rate))
    finally:
        if prefetch is not None:
            prefetch.close()
        run.close()


def check_extensions(extensions) -> list:
    """``extensions`` as a list of ``Extension`` objects, or a ``UserError`` before anything is written."""
    try:
        extensions = list(extensions)
    except TypeError:
        raise UserError(f"fit(extensions=...) takes a list of towers.extensions.Extension objects, "
                        f"got {type(extensions).__name__}") from None
    for e in extensions:
        if not isinstance(e, Extension):
            raise UserError(f"fit(extensions=...): {e!r} is a {type(e).__name__}, not a towers.extensions.Extension: "
                            "subclass Extension and override due(step, last_step) and __call__(run)")
    return extensions


def scaling(trainer, rate: float) -> tuple[float, float]:
    """(efficiency, 1-tower rate), the 1-tower rate measured only if ``measure_scaling`` is set."""
    if not trainer.cfg.measure_scaling:
        return math.nan, math.nan
    if trainer.n_towers == 1:
        return 1.0, rate
    rate_1 = one_tower_rate(trainer)
    return scaling_efficiency(rate, trainer.n_towers, rate_1), rate_1


def one_tower_rate(trainer, steps: int = 20, warmup: int = 2) -> float:
    """Examples/s of ONE tower on the first tower's device, same model and batch size.

    A short run of a fresh 1-tower trainer (its own BLAS setting, as a 1-tower
    run would have), timed after ``warmup`` steps, on batches drawn beforehand
    so input is not part of it.
    """
    cfg = dataclasses.replace(trainer.cfg, n_gpu=1, devices=None, profile=False, log_placement=False)
    one = Placement(towers=[trainer.placement.towers[0]])
    with type(trainer)(cfg, model=trainer.model, dataset=trainer.dataset, placement=one) as t:
        batches = [t.source.next_batch() for _ in range(min(warmup + steps, 64))]
        for x, y in batches[:warmup]:
            t.train_step(x, y)
        t.synchronize()
        t0 = time.perf_counter()
        for k in range(steps):
            t.train_step(*batches[warmup + k % (len(batches) - warmup)])
        t.synchronize()
        return steps * cfg.batch_size / (time.perf_counter() - t0)
