"""What a run reports: the progress bar, log lines, ``metrics.jsonl`` and TensorBoard events.

Log lines follow the original example:
``step 100, loss = 0.31 (41234.5 examples/sec; 0.005 sec/batch)``.
They go through ``tqdm.write`` so they don't break the bar.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy
from tqdm import tqdm

from towers.output.checkpoint import flat_to_named


class Reporter:
    """Progress bar (TTY only, off with --quiet), log lines and the metrics file."""

    def __init__(self, logdir: str, total_steps: int, start_step: int = 0, quiet: bool = False):
        self.quiet = quiet
        self.bar = tqdm(
            total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
            disable=quiet or not sys.stderr.isatty(),
        )
        self._metrics = open(os.path.join(logdir, "metrics.jsonl"), "a", encoding="utf-8")

    def say(self, line: str) -> None:
        """A line for the user (kept even with --quiet: it's the run's result)."""
        if self.bar.disable:
            print(line, flush=True)
        else:
            tqdm.write(line)

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def log_step(self, step: int, loss: float, lr: float, examples_per_sec: float, sec_per_batch: float) -> None:
        if not self.quiet:
            self.say(f"step {step}, loss = {loss:.4f} ({examples_per_sec:.1f} examples/sec; {sec_per_batch:.4f} sec/batch)")
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.record(step=step, loss=loss, lr=lr, examples_per_sec=examples_per_sec)

    def record(self, **fields) -> None:
        self._metrics.write(json.dumps(fields) + "\n")
        self._metrics.flush()

    def close(self) -> None:
        self.bar.close()
        self._metrics.close()


class TensorBoard:
    """TensorBoard event files in the logdir, written with tensorboardX.

    Every ``every`` steps: scalars ``loss``, ``learning_rate`` and
    ``examples_per_sec``, and histograms of every weight (``layer1/weights``)
    and of the averaged gradient (``layer1/weights/gradients``), named as the
    TensorFlow original names them.  Fetching weights and gradients is a host
    sync, so it happens only at these steps.  ``test_accuracy`` and
    ``test_accuracy_ema`` are written where the trainer evaluates: at checkpoint
    steps and at the end (a full pass over the test set is too costly for every
    summary step).

    A resumed run opens its writer with ``purge_step``, so TensorBoard drops
    what a crashed run wrote after the checkpoint it resumes from.
    """

    def __init__(self, logdir: str, every: int, start_step: int = 0):
        self.every = every
        self._writer = None
        if every > 0:  # 0: no summaries, no event file
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir, purge_step=start_step or None)
        self._t, self._step = time.perf_counter(), start_step

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def write_step(self, trainer, loss: float, lr: float) -> None:
        """The summaries of one step: scalars, then the histograms (a host sync)."""
        if self._writer is None:
            return
        now, step = time.perf_counter(), trainer.step
        rate = (step - self._step) * trainer.global_batch / max(now - self._t, 1e-9)
        self._t, self._step = now, step
        self.scalars(step, loss=loss, learning_rate=lr, examples_per_sec=rate)
        for name, a in flat_to_named(trainer.model, trainer.replicas[0].params).items():
            self._writer.add_histogram(name, _finite(a), step, bins=64)
        # After the all-reduce every replica's gradient buffer holds the average.
        for name, a in flat_to_named(trainer.model, trainer.replicas[0].grads).items():
            self._writer.add_histogram(name + "/gradients", _finite(a), step, bins=64)
        self._writer.flush()  # summary steps are rare: readers see each one at once

    def scalars(self, step: int, **values: float) -> None:
        if self._writer is not None:
            for k, v in values.items():
                self._writer.add_scalar(k, float(v), step)
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _finite(a: numpy.ndarray) -> numpy.ndarray:
    """Histograms reject inf/nan; a diverging run still gets its finite part drawn."""
    a = numpy.asarray(a).reshape(-1)
    ok = numpy.isfinite(a)
    return a if ok.all() else a[ok]
