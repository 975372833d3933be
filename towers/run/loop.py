"""The training loop, one for every executor: segments of steps to ``cfg.steps``, the extensions between them.

``fit(trainer, extensions)`` is what ``Trainer.fit`` and the command line run,
on one host or several (``towers.run.executor``):

1. the extensions are checked, then the logdir is opened and locked and the
   run resumed or refused (``towers.run.extensions.Run.open``);
2. a segment runs up to the next step where an extension is due (a log
   line, checkpoint, summary, replica check or the user's; ``Run.next_stop``)
   with ``run_steps``: locally step by step, each batch from the background
   batch thread (``towers.data.batches.Prefetcher``) or, with the training set
   on the GPUs, as row indices gathered there; on a cluster by every host in
   its own loop;
3. after each segment the extensions due are called (``Run.after_segment``);
   at the end the replicas are compared and ``Run.finish`` writes
   ``final.npz`` and the summary line.

The loop talks to the trainer through its public API and to the executor
through ``towers.run.executor.Executor`` only, so the step engine knows nothing
of logdirs, and extensions nothing of towers or hosts.

``scaling(trainer, rate)``: the scaling efficiency against a fresh one-tower
trainer on the first tower's device, timed after the run when
``measure_scaling`` is set (one host).
"""
from __future__ import annotations

import dataclasses
import math
import time

from towers.devices.placement import Placement
from towers.errors import UserError
from towers.run.extensions import Extension, Run
from towers.run.profiling import scaling_efficiency


def fit(trainer, extensions=()) -> dict:
    """Train ``trainer`` to ``cfg.steps`` (a total); return the final metrics (see the module docstring)."""
    extensions = check_extensions(extensions)
    cfg, executor = trainer.cfg, trainer.executor
    run = Run.open(trainer, cfg.logdir, extensions)
    try:
        run.start()
        with executor.prefetching(cfg.steps):
            while trainer.step < cfg.steps:
                stop = run.next_stop()
                losses, batch = executor.run_steps(stop - trainer.step, want_loss=run.wants_loss(stop))
                run.after_segment(losses, batch)
        trainer.check_replicas()  # always at the end: the saved weights are every replica's
        result = run.finish(lambda rate: scaling(trainer, rate))
    finally:
        run.close()
    result.update(executor.results())
    return result


def check_extensions(extensions) -> list:
    """``extensions`` as a list of ``Extension`` objects, or a ``UserError`` before anything is written."""
    try:
        extensions = list(extensions)
    except TypeError:
        raise UserError(f"fit(extensions=...) takes a list of towers.Extension objects, "
                        f"got {type(extensions).__name__}") from None
    for e in extensions:
        if not isinstance(e, Extension):
            raise UserError(f"fit(extensions=...): {e!r} is a {type(e).__name__}, not a towers.Extension: "
                            "subclass Extension and override due(step, last_step) and __call__(run)")
    return extensions


def scaling(trainer, rate: float) -> tuple[float, float]:
    """(efficiency, 1-tower rate), the 1-tower rate measured only if ``measure_scaling`` is set."""
    if not trainer.cfg.measure_scaling or trainer.cfg.hosts > 1:
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
    # Resolved again: the run's step count stands, not `epochs` of a one-tower batch (both set are refused).
    # Not a resume of the run's logdir: it takes no checkpoint and writes nothing.
    cfg = dataclasses.replace(trainer.cfg, n_gpu=1, devices=None, profile=False, log_placement=False, epochs=None,
                              resume=False, logdir=None)
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
        return steps * t.global_batch / (time.perf_counter() - t0)
