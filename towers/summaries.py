"""What a run reports: the progress bar, log lines, and ``metrics.jsonl``.

Log lines follow the original example:
``step 100, loss = 0.31 (41234.5 examples/sec; 0.005 sec/batch)``.
They go through ``tqdm.write`` so they don't break the bar.
"""
from __future__ import annotations

import json
import os
import sys

from tqdm import tqdm


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
