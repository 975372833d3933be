"""The resume policy: which checkpoint a run continues from, whether it may, and what the continuation notes.

A run with ``resume`` continues from the newest checkpoint in its logdir that
loads and holds finite values (``resume_point``, read when the ``Trainer`` is
built); ``check_resume`` checks it against the run: each setting declares what
its change does (``towers.settings``: refused, noted or silent), data of another
shape or other class names is refused, other data of the same shape is noted.
A fresh run refuses a logdir that holds checkpoints (``refuse_overwrite``).  The
files themselves (format, reading, writing) are ``towers.output.checkpoint``'s.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import numpy

from towers.config import Config, checkpoint_settings
from towers.data.fingerprint import changes as fingerprint_changes
from towers.errors import UserError, notice
from towers.files import remove_stale
from towers.ops.forms import rounds_otherwise
from towers.output.checkpoint import check_classes, comparable, latest_checkpoint, list_checkpoints
from towers.parallel.sync import MODES
from towers.settings import NOTE, REFUSE, SILENT, note_reasons, resume_changes, show, used_settings
from towers.state import Layout, under


def model_weights(model, arrays: dict, prefix: str, path: str, fix: str) -> dict[str, numpy.ndarray]:
    """The checkpoint's ``prefix`` weights, checked against the model's layout; a mismatch names the
    settings the checkpoint was trained with."""
    try:
        return Layout(model.layout()).check(under(arrays, prefix), f"{path} does not fit this model")
    except UserError as e:
        # Only the settings that shape this model: `hidden` is the mlp's, a user's model reads none of them.
        shaped = " ".join(f"`{k}` {show(v)}" for k, v in used_settings(arrays["config"], Config, REFUSE))
        raise UserError(f"{e} (the checkpoint was trained with {shaped}); {fix}") from None


@dataclass
class Resume:
    """The checkpoint a run continues from, its line for the user and its notes about the continuation."""

    path: str
    arrays: dict
    notes: list = field(default_factory=list)  # said after ``line``: how the continuation differs

    @property
    def step(self) -> int:
        return int(self.arrays["step"])

    @property
    def position(self) -> tuple[int, int]:
        return int(self.arrays["data/epoch"]), int(self.arrays["data/index"])

    @property
    def line(self) -> str:
        """What the run says it resumes from (the caller says it, with its other lines)."""
        return (f"resuming from {self.path}: step {self.step}, "
                f"input at epoch {self.position[0]} index {self.position[1]}")


def resume_point(logdir: str) -> tuple[str, dict] | None:
    """The checkpoint ``resume`` continues from, as (path, arrays); None: there is none, the run starts fresh.

    The newest checkpoint in ``logdir`` that loads and holds finite values
    (``latest_checkpoint``); those skipped on the way, and a fresh start, are
    notices (``towers.errors.notice``).  Folders of writers killed mid-write
    are removed first.  Read when the ``Trainer`` is built: its settings are
    the run's (``towers.config.resume_settings``) before anything else is made.
    """
    if os.path.isdir(logdir):
        remove_stale(logdir)  # what writers killed mid-write left behind
    found = latest_checkpoint(logdir, warn=notice, finite=True)
    if found is None:
        notice(f"`resume`: no checkpoint in {logdir}; starting fresh")
    return found


def resume(trainer, found: tuple[str, dict]) -> Resume:
    """Check the checkpoint ``found`` (``resume_point``'s) against ``trainer``'s run, load it, return it.

    The checks and notes are ``check_resume``'s; the checkpoint must fit the
    model, and its step must not be past ``steps`` (a ``UserError``).
    Nothing is printed: the returned ``Resume`` carries its ``line`` and its
    ``notes``, for the caller to say in that order.
    """
    cfg = trainer.cfg
    placement = getattr(trainer, "placement", None)  # None: a cluster's hosts place their own towers
    cpu_only = placement is not None and not placement.gpus
    found = check_resume(cfg, *found, trainer.dataset, trainer.n_towers, getattr(trainer, "data_path", None),
                         cpu_only)
    model_weights(trainer.model, found.arrays, "params", found.path,
                  "resume with the checkpoint's settings, or use another `logdir`")
    if found.step > cfg.steps:
        raise UserError(past_steps(found, cfg, len(trainer.dataset.x), trainer.examples_per_step))
    trainer.load_state_dict(found.arrays, where=found.path)
    # A checkpoint without the key was written before numba's kernels existed: NumPy's.
    old, new = str(found.arrays.get("cpu_kernels", "numpy")), trainer.cpu_kernels
    # Only batch norm and a convolution with more filters than channels round otherwise through the
    # compiled forms (``towers.ops.forms.rounds_otherwise``): elsewhere the bits are the same.
    if new is not None and old != new and rounds_otherwise(trainer.model):
        found.notes.append(f"note: the CPU kernels changed since the checkpoint ({old} -> {new}, see "
                           "`cpu_kernels`): batch norm's and some convolutions' sums round differently, so "
                           "the continuation differs from an uninterrupted run by float rounding")
    return found


def past_steps(found: Resume, cfg, n_examples: int, examples_per_step: int) -> str:
    """The refusal of a resume whose checkpoint is past the run's length, in the setting that gave it."""
    if cfg.epochs is not None:
        more = found.step * examples_per_step // n_examples + 1  # the fewest epochs whose steps pass it
        return (f"{found.path} is at step {found.step}, past `epochs` {cfg.epochs} ({cfg.steps} steps of "
                f"{examples_per_step} examples; the total, not more epochs): set `epochs` {more} or more to train "
                "on, or evaluate it with towers.eval")
    return (f"{found.path} is at step {found.step}, past `steps` {cfg.steps} (the total, not more steps): set "
            f"`steps` above {found.step} to train on, or evaluate it with towers.eval")


def refuse_overwrite(logdir: str) -> None:
    """A fresh run never overwrites a logdir that holds checkpoints (a ``UserError``)."""
    existing = list_checkpoints(logdir) if os.path.isdir(logdir) else []
    if existing:
        raise UserError(f"{logdir} already holds checkpoints (newest {existing[0][1]}): "
                        "set `resume` to continue that run, or choose another `logdir`")


def refuse_newer(logdir: str, seen: int) -> None:
    """A resumed trainer's ``fit`` refuses a checkpoint newer than ``seen`` (the newest step in ``logdir`` when it
    was built and loaded its checkpoint): another run wrote it since, and continuing would overwrite it."""
    newest = list_checkpoints(logdir) if os.path.isdir(logdir) else []
    if newest and newest[0][0] > seen:
        raise UserError(f"{newest[0][1]} was written after this Trainer was built with `resume` (another run on "
                        f"`logdir` {logdir}): build a new Trainer with `resume` to continue from it")


def check_resume(cfg, path: str, arrays: dict, dataset, n_towers: int, data_path: str | None = None,
                 cpu_only: bool = False) -> Resume:
    """The ``Resume`` of the checkpoint at ``path`` (its ``arrays``), after checking the data fits.

    Each setting declares what its change does (``towers.settings``): one that
    shapes the model is refused, naming it; one that changes the trajectory
    gets a note; the tower count and global batch get their own note; the rest
    pass silently.  Data of another shape or other class names is refused;
    other data of the same shape (its fingerprint, ``towers.data.fingerprint``,
    differs: labels, examples or their dtype) gets a note naming ``data_path``
    (None: the data set handed to the ``Trainer``).  A checkpoint written
    before fingerprints were recorded gets no such note.  A checkpoint of a
    run in weights mode written at a step between averages (the end of a
    run, after its last average) gets a note too.  ``cpu_only``: the run's
    towers are all CPUs, whose results the ``gpu_only`` settings leave as
    they are: a change of one is silent.
    """
    ck = arrays["config"]
    # What each changed setting does is declared with it (`towers.settings`): refused, noted or silent.
    old_settings = checkpoint_settings(ck)
    changes = resume_changes(old_settings, comparable(cfg))
    if cpu_only:
        gpu = {f.name for f in fields(cfg) if f.metadata["gpu_only"]}
        changes[NOTE] = [c for c in changes[NOTE] if c[0] not in gpu]
    if changes[REFUSE]:
        name, old, new = changes[REFUSE][0]
        raise UserError(f"{path} was trained with `{name}` {show(old)}, this run has `{name}` {show(new)}: another "
                        f"model shape cannot continue it; resume with `{name}` {show(old)}, or use another `logdir`")
    shape, classes = tuple(int(v) for v in arrays["data/shape"]), int(arrays.get("data/num_classes", -1))
    if shape != tuple(dataset.x.shape) or classes != dataset.num_classes:
        groups = {f.name: f.metadata["group"] for f in fields(cfg)}
        data_settings = [f"`{k}` {show(a)} -> {show(b)}" for rule in (NOTE, SILENT) for k, a, b in changes[rule]
                         if groups[k] in ("data", "images")]
        if not data_settings and shape[1:] == tuple(dataset.x.shape[1:]) and classes == dataset.num_classes:
            # The same settings, the same examples' shape: the files they name hold another count.
            n, now = shape[0], len(dataset.x)
            what = ("fewer: a file or shard it read is gone or shorter" if now < n else
                    "more: files were added or grew")
            raise UserError(f"{path} was trained on {n:,} examples of `data` {ck.get('data')}, which now gives "
                            f"{now:,} ({what}): a resume continues the input where it stopped in the same examples; "
                            "restore the data as it was, or use another `logdir`")
        raise UserError(
            f"{path} was trained on data of shape {shape} with {classes} classes ({ck.get('data')}), "
            f"but `data` gives {tuple(dataset.x.shape)} with {dataset.num_classes} classes"
            + (f" ({', '.join(data_settings)})" if data_settings else "")
            + ": resume with the same data settings, or use another `logdir`"
        )
    check_classes(arrays, dataset, path, "resume with the class folders it was trained on (the same names), or "
                  "use another `logdir`")
    r = Resume(path, arrays)
    old_towers, old_batch = int(arrays["n_towers"]), int(arrays["global_batch"])
    new_batch = cfg.batch_size * cfg.accumulate * n_towers
    old_k = ck.get("accumulate", 1)  # written before `accumulate` existed: 1
    if (old_towers, old_batch, old_k) != (n_towers, new_batch, cfg.accumulate):
        same = ("the same global batch, so it matches an uninterrupted run up to float rounding"
                if old_batch == new_batch else
                f"the global batch changes from {old_batch} to {new_batch}, so it is not bit-identical "
                "to an uninterrupted run")
        was, now = ((f" x {old_k} micro-batches", f" x {cfg.accumulate} micro-batches")
                    if (old_k, cfg.accumulate) != (1, 1) else ("", ""))
        r.notes.append(f"note: the checkpoint was written by {old_towers} tower(s) x {ck.get('batch_size')}{was}, "
                       f"this run has {n_towers} x {cfg.batch_size}{now}: {same}")
    if changes[NOTE]:
        changed = ", ".join(f"`{k}` {show(old)} -> {show(new)}" for k, old, new in changes[NOTE])
        why = "".join(f"; {reason}" for reason in note_reasons(old_settings, cfg, [k for k, _, _ in changes[NOTE]]))
        r.notes.append(f"note: settings changed since the checkpoint ({changed}{why}): "
                       "the continuation differs from an uninterrupted run")
    period = MODES[ck.get("sync", "grads")].period(SimpleNamespace(**old_settings))
    if r.step % period and r.step < cfg.steps:
        r.notes.append(f"note: {path} was written at the end of its run, after an extra average of the weights "
                       f"(step {r.step} is not a multiple of `average_every` {period}): the continuation differs "
                       "from an uninterrupted run")
    if "data/fingerprint" in arrays:
        differs = fingerprint_changes(json.loads(str(arrays["data/fingerprint"][()])), dataset.fingerprint)
        if differs:
            which = f"`data` {data_path}" if data_path else "the `dataset` given"
            r.notes.append(f"note: the training data changed since the checkpoint ({which}: {', '.join(differs)}): "
                           "the continuation differs from an uninterrupted run")
    return r
