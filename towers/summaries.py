"""What a run reports: the progress bar, log lines, ``metrics.jsonl`` and TensorBoard events.

Log lines follow the original example:
``step 100, loss = 0.31 (41234.5 examples/sec; 0.005 sec/batch)``.
They go through ``tqdm.write`` so they don't break the bar.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

import numpy
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


class TensorBoard:
    """TensorBoard event files in the logdir, written with the ``tensorboard`` package.

    Every ``every`` steps: scalars ``loss``, ``learning_rate``,
    ``examples_per_sec``, ``test_accuracy`` and ``test_accuracy_ema``, and
    histograms of every weight (``layer1/weights``) and of the averaged gradient
    (``layer1/weights/gradients``), named as the TensorFlow original names them.
    Fetching weights and gradients is a host sync, so it happens only at these
    steps.

    The records are tensorboard's own (its protos and its ``RecordWriter``
    framing) written to a plain file.  Not tensorboardX, which imports torch when
    one is installed (and fails on a broken install), nor tensorboard's
    ``EventFileWriter``, which imports TensorFlow when present (seconds of start-up).
    """

    def __init__(self, logdir: str, every: int, start_step: int = 0):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._pb, self._ev = summary_pb2, event_pb2
        self.every = every
        self._writer = None
        if every > 0:  # 0: no summaries, no event file
            name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
            self._writer = RecordWriter(open(os.path.join(logdir, name), "ab"))
            self._writer.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2")
                               .SerializeToString())
        if start_step and self._writer:
            # A resumed run: TensorBoard drops events a crashed run wrote after this step.
            self._writer.write(event_pb2.Event(
                wall_time=time.time(), step=start_step,
                session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)).SerializeToString())
        self._t, self._step = time.perf_counter(), start_step

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def write_step(self, trainer, loss: float, lr: float, test: dict | None = None) -> None:
        """The summaries of one step: scalars, then the histograms (a host sync)."""
        from towers.checkpoint import flat_to_named

        now, step = time.perf_counter(), trainer.step
        rate = (step - self._step) * trainer.global_batch / max(now - self._t, 1e-9)
        self._t, self._step = now, step
        self.scalars(step, loss=loss, learning_rate=lr, examples_per_sec=rate, **(test or {}))
        values = [self._pb.Summary.Value(tag=name, histo=_histogram(a))
                  for name, a in flat_to_named(trainer.model, trainer.replicas[0].params).items()]
        # After the all-reduce every replica's gradient buffer holds the average.
        values += [self._pb.Summary.Value(tag=name + "/gradients", histo=_histogram(a))
                   for name, a in flat_to_named(trainer.model, trainer.replicas[0].grads).items()]
        self._add(step, values)

    def scalars(self, step: int, **values: float) -> None:
        self._add(step, [self._pb.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])

    def _add(self, step, values) -> None:
        if self._writer:
            self._writer.write(self._ev.Event(wall_time=time.time(), step=step,
                                              summary=self._pb.Summary(value=values)).SerializeToString())
            self._writer.flush()  # summary steps are rare: readers see each one at once

    def close(self) -> None:
        if self._writer and not self._writer.closed:
            self._writer.close()


def _histogram(a: numpy.ndarray, bins: int = 30):
    from tensorboard.compat.proto.summary_pb2 import HistogramProto

    v = numpy.asarray(a, dtype=numpy.float64).reshape(-1)
    v = v[numpy.isfinite(v)] if not numpy.isfinite(v).all() else v  # histogram() rejects inf/nan
    if v.size == 0:
        return HistogramProto()
    counts, edges = numpy.histogram(v, bins=bins)
    return HistogramProto(min=float(v.min()), max=float(v.max()), num=float(v.size), sum=float(v.sum()),
                          sum_squares=float(v @ v), bucket_limit=edges[1:].tolist(), bucket=counts.tolist())
