"""What a run reports: the progress bar, log lines, ``metrics.jsonl`` and TensorBoard events.

Log lines follow the original example:
``step 100, loss = 0.31 (41234.5 examples/sec, 20617.3 per tower; 0.005 sec/batch)`` (the
per-tower rate with several towers).
They go through ``tqdm.write`` so they don't break the bar.

Every write into the logdir goes through ``towers.files.writing``, so a
full or read-only disk is a ``DiskError`` naming the file, raised in the
training thread at the step that wrote it.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import sys
import time

import numpy
from tqdm import tqdm

from towers.errors import progress_bar
from towers.files import atomic_write_text, writing

METRICS = "metrics.jsonl"


def trim_metrics(logdir: str, step: int) -> None:
    """Drop ``metrics.jsonl`` records after ``step`` (and a line a crash cut short), atomically.

    A resumed run redoes the steps after its checkpoint; without this the steps
    a crashed run logged after it would appear twice.
    """
    path = os.path.join(logdir, METRICS)
    if not os.path.exists(path):
        return
    with writing(path, "read"), open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    keep = [line for line in lines if _record_step(line) is not None and _record_step(line) <= step]
    if keep != lines:
        with writing(path):
            atomic_write_text(path, "".join(keep))


def _record_step(line: str) -> int | None:
    """The step of a complete record; None for a torn or foreign line."""
    if not line.endswith("\n"):
        return None
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def per_tower(examples_per_sec: float, towers: int) -> str:
    """``, N per tower`` after a rate of several towers (the images/s per GPU that tf_cnn_benchmarks reports);
    nothing for one tower."""
    return f", {examples_per_sec / towers:.1f} per tower" if towers > 1 else ""


class Reporter:
    """Progress bar (TTY only, off with --quiet), log lines and the metrics file."""

    def __init__(self, logdir: str, total_steps: int, start_step: int = 0, quiet: bool = False):
        self.quiet = quiet
        self._noted = False  # a warning said once in quiet mode
        self.bar = progress_bar(not quiet, total=total_steps, initial=start_step, unit="step")
        self.path = os.path.join(logdir, METRICS)
        with writing(self.path):
            self._metrics = open(self.path, "a", encoding="utf-8")

    def say(self, line: str) -> None:
        """A line for the user (kept even with --quiet: it's the run's result)."""
        if self.bar.disable:
            print(line, flush=True)
        else:
            tqdm.write(line)

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def end_bar(self) -> None:
        """Close the training bar (it stays on the terminal), so that what follows (the final evaluation's
        bar, the last lines) takes the lines below it."""
        self.bar.close()

    def log_step(self, step: int, loss: float, lr: float, examples_per_sec: float, towers: int,
                 sec_per_batch: float, note: str | None = None, train_accuracy: float | None = None,
                 **scaling) -> None:
        """The log line and its record; ``note`` (a warning) is added to it, and said once even when quiet.

        ``train_accuracy``: the step's own (beside the loss); ``scaling``: fp16's ``loss_scale`` and
        ``skipped_steps`` (said when a step was skipped).
        """
        accuracy = "" if train_accuracy is None else f", accuracy = {train_accuracy:.4f}"
        line = (f"step {step}, loss = {loss:.4f}{accuracy} ({examples_per_sec:.1f} examples/sec"
                f"{per_tower(examples_per_sec, towers)}; {sec_per_batch:.4f} sec/batch)")
        if scaling.get("skipped_steps"):
            line += (f"; {scaling['skipped_steps']} steps skipped for fp16 overflow so far, loss scale "
                     f"{scaling['loss_scale']:g}")
        if note and not self.quiet:
            line += f"; {note}"
        elif note and not self._noted:
            self.say(f"warning: {note}")
        self._noted |= bool(note)
        if not self.quiet:
            self.say(line)
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        extra = {} if train_accuracy is None else {"train_accuracy": train_accuracy}
        self.record(step=step, loss=loss, **extra, lr=lr, examples_per_sec=examples_per_sec, **scaling)

    def log_evaluation(self, step: int, scores: dict, examples: str) -> None:
        """An evaluation's line (``step N, test loss = ...``; not when quiet) and its ``metrics.jsonl`` record
        (``scores``: ``Trainer.test_accuracy``'s; ``examples``: what was evaluated, for the line)."""
        if not self.quiet:
            top5 = (f", top-5 {scores['test_top5_accuracy']:.4f} / {scores['test_top5_accuracy_ema']:.4f}"
                    if "test_top5_accuracy" in scores else "")
            self.say(f"step {step}, test loss = {scores['test_loss']:.4f}, accuracy = {scores['test_accuracy']:.4f} "
                     f"(raw) / {scores['test_accuracy_ema']:.4f} (EMA){top5} on {examples}")
        self.record(step=step, **scores)

    def record(self, **fields) -> None:
        with writing(self.path):
            self._metrics.write(json.dumps(fields) + "\n")
            self._metrics.flush()

    def close(self) -> None:
        """Close the bar and the metrics file (idempotent; a failed flush raises a DiskError)."""
        self.bar.close()
        with writing(self.path):
            self._metrics.close()  # closed even when its flush fails


class TensorBoard:
    """TensorBoard event files in the logdir, written with tensorboardX's record writer.

    Every ``every`` steps: scalars ``loss``, ``learning_rate``,
    ``examples_per_sec`` and ``train_accuracy`` (with fp16 ``loss_scale`` and
    ``skipped_steps`` too), and histograms of every weight (``layer1/weights``)
    and of the averaged gradient (``layer1/weights/gradients``), named as the
    TensorFlow original names them.  Fetching weights and gradients is a host
    sync, so it happens only at these steps.  ``test_loss``, ``test_accuracy``
    (``_ema``: the EMA weights'; ``test_top5_accuracy`` with more than 10
    classes) are written where the trainer evaluates: every ``eval_every``
    steps (at checkpoint steps by default) and at the end.

    Events are written and flushed (with fsync) in the calling thread at each
    summary step, not by tensorboardX's ``SummaryWriter``: its writer thread
    dies on a full disk with a traceback, and the next events then block the
    training loop on its full queue.  Here a write error is a ``DiskError`` at
    the step that wrote it.  The summaries and the event framing (crc32c) are
    tensorboardX's.

    A resumed run starts its event file with a ``SessionLog.START`` at
    ``purge_step`` (the checkpoint's step + 1): TensorBoard then drops what a
    crashed run wrote after that checkpoint and keeps the checkpoint step's
    points.  Event file names end in a sequence number, so files opened in the
    same second sort in the order they were written.
    """

    def __init__(self, logdir: str, every: int, start_step: int = 0, purge_step: int | None = None):
        self.every, self.path = every, None
        self._writer = None
        self._written = False  # a summary past the file's first events
        if every > 0:  # 0: no summaries, no event file
            with _without_torch():
                from tensorboardX.proto.event_pb2 import Event, SessionLog
                from tensorboardX.record_writer import RecordWriter

            self._event = Event
            seq = len(glob.glob(os.path.join(glob.escape(logdir), "events.out.tfevents.*")))
            self.path = os.path.join(logdir, f"events.out.tfevents.{int(time.time()):010d}."
                                             f"{socket.gethostname()}.{seq:04d}")
            with writing(self.path):
                self._writer = RecordWriter(self.path)
            try:
                self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
                if purge_step is not None:
                    self._write(Event(wall_time=time.time(), step=purge_step,
                                      session_log=SessionLog(status=SessionLog.START)))
                self.flush()  # a disk that cannot take the file fails now, not at the first summary
            except BaseException:
                # A file that could not take its first events holds nothing a reader needs; left
                # behind, each resume on a full disk would add one more.
                self._discard()
                raise
        self._t, self._step = time.perf_counter(), start_step

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _write(self, event) -> None:
        with writing(self.path):
            self._writer.write(event.SerializeToString())

    def _summary(self, summary, step: int) -> None:
        self._write(self._event(wall_time=time.time(), step=int(step), summary=summary))
        self._written = True

    def flush(self) -> None:
        if self._writer is not None:
            with writing(self.path):
                self._writer.flush()  # flush and fsync: readers see each summary step at once

    def write_step(self, trainer, loss: float, lr: float, **figures: float) -> None:
        """The summaries of one step: scalars (``figures``: the training accuracy, fp16's loss scale and skipped
        steps, where the run has them), then the histograms (a host sync)."""
        if self._writer is None:
            return
        from tensorboardX.summary import histogram

        now, step = time.perf_counter(), trainer.step
        rate = (step - self._step) * trainer.global_batch / max(now - self._t, 1e-9)
        self._t, self._step = now, step
        self.scalars(step, flush=False, loss=loss, learning_rate=lr, examples_per_sec=rate, **figures)
        for name, a in trainer.get_weights().items():
            self._summary(histogram(name, _finite(a), bins=64), step)
        # After the all-reduce every replica's gradient buffer holds the average.
        for name, a in trainer.get_gradients().items():
            self._summary(histogram(name + "/gradients", _finite(a), bins=64), step)
        self.flush()

    def scalars(self, step: int, flush: bool = True, **values: float) -> None:
        if self._writer is None:
            return
        from tensorboardX.summary import scalar

        for k, v in values.items():
            self._summary(scalar(k, float(v)), step)
        if flush:
            self.flush()

    def _discard(self) -> None:
        """Close and remove the event file this object made (its first write failed)."""
        writer, self._writer = self._writer, None
        with contextlib.suppress(OSError):  # the flush of what did not fit fails again
            writer.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self, keep_empty: bool = True) -> None:
        """Flush and close (idempotent; the file is closed even when the flush fails).

        ``keep_empty`` False (a run that stopped on an error): a file that got
        no summary past its first events is removed instead, so each resume
        retried on a full disk, which fails before its first summary (at a
        checkpoint whose temporary file, removed, leaves room for the next
        header), does not leave one more.
        """
        if self._writer is not None and not keep_empty and not self._written:
            self._discard()
            return
        if self._writer is not None:
            writer, self._writer = self._writer, None
            with writing(self.path):
                try:
                    writer.flush()
                finally:
                    writer.close()


def _finite(a: numpy.ndarray) -> numpy.ndarray:
    """Histograms reject inf/nan; a diverging run still gets its finite part drawn."""
    a = numpy.asarray(a).reshape(-1)
    ok = numpy.isfinite(a)
    return a if ok.all() else a[ok]


@contextlib.contextmanager
def _without_torch():
    """Import tensorboardX without it importing PyTorch.

    tensorboardX's package imports ``torch`` when it is installed, only to
    recognise torch tensors; towers hands it NumPy arrays, and importing torch
    costs seconds (measured on the GPU machine).  While tensorboardX is first
    imported, ``import torch`` fails as if torch were absent.  If the process
    already uses torch, nothing changes.
    """
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # makes ``import torch`` raise ImportError
    try:
        yield
    finally:
        if blocked and sys.modules.get("torch", 1) is None:
            del sys.modules["torch"]
