"""The checkpoint format: what a checkpoint holds, how it is written, found and read.

Whether a run may continue from one, and what a continuation notes, is the
resume policy (``towers.run.resume``), which reads checkpoints through this module;
this module knows the files, not the settings.

A checkpoint ``ckpt-<step, 8 digits>.npz`` in the run's logdir holds, under
plain names that do not depend on the number of towers:

* ``params/<name>``, ``buffers/<name>`` (non-trainable state such as batch-norm
  moving statistics), ``ema/<name>`` and the optimizer's state (``momentum/<name>``
  for SGD with momentum, ``adam_m/<name>`` and ``adam_v/<name>`` for Adam),
  float32, stored once (every replica holds the same values);
* ``step`` and the input pipeline's position ``data/epoch``, ``data/index``.  The
  shuffle of epoch ``e`` is ``default_rng([seed, e])``, so the seed (in the
  config) and the position are the pipeline's whole RNG state;
* ``config``: the run's settings as a JSON string, ``data/shape``,
  ``data/num_classes`` and ``data/classes`` (to refuse another dataset),
  ``data/fingerprint`` (to note other data of that shape), ``n_towers`` and
  ``global_batch`` (to note a change), ``sync/n_averages`` (the EMA's count in
  weights mode), and ``format``.

The learning rate and the EMA decay are functions of ``step``, and everything
else is scratch, so this is all a bit-identical resume needs.

Every file is written atomically through ``towers.files`` (a crash, even
SIGKILL, leaves the old file or the complete new one; equal arrays give
byte-identical files).  The text file ``checkpoint`` names the latest, as
TensorFlow's does.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import re
from dataclasses import asdict, replace

import numpy

from towers.errors import TrainingError, UserError
from towers.files import DiskError, atomic_save_npz, atomic_write_text, writing
from towers.state import Layout

FORMAT = 1
INDEX = "checkpoint"  # the TensorFlow-style text file naming the latest checkpoint
_CKPT = re.compile(r"^ckpt-(\d{8,})\.npz$")


def named_to_flat(model, named: dict) -> numpy.ndarray:
    """The model's weights from {name: array} (already checked) as one host float32 flat buffer."""
    return Layout(model.layout()).join(named)


# -- finding and reading checkpoints --------------------------------------------------


class CheckpointError(Exception):
    """A checkpoint file that cannot be read or lacks what a checkpoint holds."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.npz"


def list_checkpoints(logdir: str) -> list[tuple[int, str]]:
    """(step, path) of the checkpoint files in ``logdir``, newest first.

    The directory is the truth, not the ``checkpoint`` file: a crash between
    renaming a new checkpoint into place and rewriting the index leaves a newer,
    complete checkpoint that the index does not name yet.
    """
    found = []
    for path in glob.glob(os.path.join(glob.escape(logdir), "ckpt-*.npz")):
        m = _CKPT.match(os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path))
    return sorted(found, reverse=True)


def not_a_zip(path: str) -> str | None:
    """Why the file at ``path`` cannot be an npz (``empty``, ``not an npz file: no zip header``), or None.

    Checked before ``numpy.load``, which takes any file that is neither a zip
    nor an .npy for a pickle, and says so with advice about ``allow_pickle``
    (a text file is no pickle, and loading pickles is unsafe).
    """
    with open(path, "rb") as f:
        head = f.read(4)
    return None if head == b"PK\x03\x04" else "empty" if not head else "not an npz file: no zip header"


def load_checkpoint(path: str, final: bool = False) -> dict:
    """All arrays of a checkpoint, read in full (so zip CRCs are verified).

    With ``final``, a run's ``final.npz`` is read too, as a checkpoint of its
    step: ``load_final``.
    """
    try:
        unzipped = not_a_zip(path)
        if unzipped:
            raise CheckpointError(f"{unzipped}; give a run's ckpt-*.npz or final.npz")
        with numpy.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except CheckpointError:
        raise
    except Exception as e:  # truncated, corrupt, not a zip, vanished: all "unreadable"
        raise CheckpointError(f"{e.__class__.__name__}: {e}") from None
    if is_final(arrays):
        if final:
            return load_final(path, arrays)
        raise CheckpointError(f"a run's final.npz: its weights only, not a checkpoint (the checkpoint of its step "
                              f"is {final_checkpoint(path, int(arrays['step']))})")
    missing = [k for k in ("format", "step", "config", "data/epoch", "data/index", "data/shape") if k not in arrays]
    if missing:
        raise CheckpointError(f"not a towers checkpoint (no {', '.join(missing)})")
    if int(arrays["format"]) != FORMAT:
        raise CheckpointError(f"checkpoint format {int(arrays['format'])}, this version reads {FORMAT}")
    try:
        arrays["config"] = json.loads(str(arrays["config"][()]))
    except ValueError as e:
        raise CheckpointError(f"its config is not JSON ({e})") from None
    return arrays


def is_final(arrays: dict) -> bool:
    """Whether an npz's arrays are a run's ``final.npz``: ``params/*``, ``ema/*`` and ``step``, nothing of a
    checkpoint's format (``towers.run.extensions.Run.finish`` writes it)."""
    return "step" in arrays and "format" not in arrays and any(k.startswith("params/") for k in arrays)


def final_checkpoint(path: str, step: int) -> str:
    """Where the checkpoint of a ``final.npz``'s step is: beside it.  A run writes one at its last step, with
    the settings and the data's description that ``final.npz`` (weights only) lacks."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), checkpoint_name(step))


def load_final(path: str, final: dict) -> dict:
    """The arrays of ``final.npz`` (``final``, read from ``path``) as a checkpoint of its step: its weights and
    EMA, with the settings and data description of its run's checkpoint of that step (``final_checkpoint``).

    ``final.npz`` holds the model's buffers (moving statistics) under both ``params/`` and ``ema/``, as
    ``get_weights`` returns them; a checkpoint keeps them under ``buffers/``, so they move there.  A
    ``CheckpointError`` when that checkpoint is missing or unreadable.
    """
    beside = final_checkpoint(path, int(final["step"]))
    if not os.path.exists(beside):
        raise CheckpointError(f"a run's final.npz holds weights only, and the checkpoint of its step, which has "
                              f"the run's settings, is not beside it ({beside}): give one of the run's ckpt-*.npz")
    try:
        arrays = load_checkpoint(beside)
    except CheckpointError as e:
        raise CheckpointError(f"its run's settings are in {beside}, which cannot be read ({e})") from None
    buffers = {k[len("buffers/"):] for k in arrays if k.startswith("buffers/")}
    arrays = {k: v for k, v in arrays.items() if not k.startswith(("params/", "ema/", "buffers/"))}
    for key, a in final.items():
        prefix, _, name = key.partition("/")
        if prefix in ("params", "ema"):
            arrays[f"buffers/{name}" if name in buffers else key] = a
    arrays["step"] = final["step"]
    return arrays


def latest_checkpoint(logdir: str, warn=None, finite: bool = False) -> tuple[str, dict] | None:
    """The newest loadable checkpoint in ``logdir`` as (path, arrays), or None if there is none.

    Unreadable newer ones (with ``finite``: also those holding non-finite
    weights, which a run must not continue from) are reported through ``warn``
    and skipped.  When checkpoints exist but none loads, that is an error, not
    a silent fresh start.
    """
    candidates = list_checkpoints(logdir)
    bad, unusable = [], False
    for _, path in candidates:
        try:
            arrays = load_checkpoint(path)
        except CheckpointError as e:
            problem = f"is unreadable ({e})"
        else:
            key = non_finite(arrays) if finite else None
            if key is None:
                return path, arrays
            problem, unusable = f"holds non-finite values ({key})", True
        bad.append(path)
        if warn:
            warn(f"checkpoint {path} {problem}; trying the one before it")
    if bad:
        raise UserError(
            f"none of the {len(bad)} checkpoints in {logdir} can be {'used' if unusable else 'read'} "
            f"(newest: {bad[0]}); move them away to start fresh, or point `logdir` elsewhere"
        )
    return None


def newest_readable(logdir: str, warn, action: str, show) -> tuple[str, dict] | None:
    """``latest_checkpoint`` for reading a run (``towers.eval``, ``towers.load``): the newest checkpoint in
    ``logdir`` that loads, or None when there is none.

    The files skipped on the way are reported through ``warn`` only when one
    loads; when none does, the ``UserError`` says there is nothing to
    ``action`` and ends with ``show(newest)``, the way to see why the newest
    fails (``latest_checkpoint``'s own message advises a training run to
    start fresh).
    """
    skipped = []
    try:
        found = latest_checkpoint(logdir, warn=skipped.append)
    except UserError:
        names = list_checkpoints(logdir)  # a training run's rotation may have removed them since
        newest, why = (f" (newest: {names[0][1]})", f"; {show(names[0][1])}") if names else ("", "")
        raise UserError(f"none of the {len(skipped)} checkpoints in {logdir} can be read{newest}: "
                        f"nothing to {action}{why}") from None
    for line in skipped:
        warn(line)
    return found


def read_checkpoint(path: str) -> dict:
    """The arrays of the checkpoint, or run's ``final.npz``, at ``path`` (``load_checkpoint``); a
    ``UserError`` naming it when it cannot be read."""
    try:
        return load_checkpoint(path, final=True)
    except CheckpointError as e:
        raise UserError(f"{path} is not a readable checkpoint ({e})") from None


def non_finite(arrays: dict) -> str | None:
    """The first floating array of a state dict (weights, EMA, optimizer state, buffers) holding NaN or inf."""
    for key, a in arrays.items():
        a = numpy.asarray(a)
        if numpy.issubdtype(a.dtype, numpy.floating) and not numpy.isfinite(a).all():
            return key
    return None


# -- the metadata a checkpoint adds to the trainer's state dict ---------------------------

META = ("format", "data/shape", "data/num_classes", "n_towers", "global_batch", "config", "data/classes",
        "cpu_kernels", "data/fingerprint")


def metadata(cfg, dataset, n_towers: int, global_batch: int, cpu_kernels: str = "numpy") -> dict:
    """The checkpoint format's own keys: what a resume checks the data and the run against.

    ``cpu_kernels``: which form of the ops ran on the CPU towers, ``numba``
    or ``numpy`` (``towers.ops.forms``), which the ``cpu_kernels`` setting
    alone does not say (``auto`` is either).  ``data/fingerprint``: the
    training set's (``towers.data.fingerprint``), as JSON.
    """
    return {
        "format": numpy.int64(FORMAT), "cpu_kernels": numpy.array(cpu_kernels),
        "data/shape": numpy.array(dataset.x.shape, dtype=numpy.int64),
        "data/fingerprint": numpy.array(json.dumps(dataset.fingerprint, sort_keys=True)),
        "data/num_classes": numpy.int64(dataset.num_classes),
        "n_towers": numpy.int64(n_towers), "global_batch": numpy.int64(global_batch),
        "config": numpy.array(config_json(cfg)),
    } | ({"data/classes": numpy.array(json.dumps(list(dataset.class_names)))}
         if getattr(dataset, "class_names", None) else {})  # an image folder's classes, by label (towers.eval)


def check_metadata(state: dict, dataset, where: str) -> None:
    """A state dict's data shape, class count and class names against ``dataset``'s (a ``UserError`` otherwise)."""
    if "data/shape" not in state:
        raise UserError(f"{where}: 'data/shape' is missing")
    shape, classes = tuple(int(v) for v in numpy.ravel(state["data/shape"])), int(state.get("data/num_classes", -1))
    if shape[1:] != tuple(dataset.example_shape) or classes != dataset.num_classes:
        raise UserError(f"{where}: trained on examples of shape {shape[1:]} with {classes} classes, "
                        f"but the data has {dataset.example_shape} with {dataset.num_classes} classes")
    check_classes(state, dataset, where, "give the data with the classes it was trained on")


def recorded_classes(state: dict) -> list[str] | None:
    """The class names a checkpoint records (``data/classes``: an image folder's, label k at k), or None."""
    if "data/classes" not in state:
        return None
    return [str(name) for name in json.loads(str(numpy.asarray(state["data/classes"])[()]))]


def _names(names: list[str], limit: int = 20) -> str:
    return json.dumps(names[:limit])[:-1] + (f", ... ({len(names)} classes)]" if len(names) > limit else "]")


def check_classes(state: dict, dataset, where: str, fix: str) -> None:
    """A ``UserError`` (ending with ``fix``) when ``dataset``'s class names differ from those ``state`` records.

    Label k is the k-th class name (an image folder's classes in sorted order), so a renamed, added or
    removed class folder, or the same names in another order, makes every label after it mean another
    class while the shape and the class count stay the same.  A state without names (numbered labels)
    is not checked; numbered data beside recorded names passes only when the names are those numbers
    (``0`` .. ``C-1`` in that order), as a test folder's numbered classes match numbered labels.
    """
    old = recorded_classes(state)
    if old is None:
        return
    new = list(dataset.class_names) if getattr(dataset, "class_names", None) else None
    numbered = [str(k) for k in range(len(old))]
    if new == old or (new is None and old == numbered):
        return
    if new is None:
        raise UserError(f"{where} was trained on the class folders {_names(old)}, but the data has numbered labels "
                        f"without class names: label k would not mean the k-th of them; {fix}")
    k = next((k for k, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    at = (f"label {k} meant {old[k]!r} and would mean {new[k]!r}" if k < min(len(old), len(new)) else
          f"the names differ from label {k} on")
    raise UserError(f"{where} was trained on the classes {_names(old)}, but the data's are {_names(new)} "
                    f"({at}); {fix}")


# -- writing during training --------------------------------------------------------


class Checkpointer:
    """Writes ``ckpt-*.npz`` files and the index, keeps the newest ``keep``.

    When is the ``towers.run.extensions.Checkpoints`` extension's business; it also
    refuses non-finite state before ``write``, so every checkpoint on disk, and
    ``last_path``, holds finite weights.
    """

    def __init__(self, logdir: str, keep: int):
        self.logdir, self.keep = logdir, keep
        self.last_path: str | None = None  # the newest checkpoint on disk, once known

    def write(self, step: int, arrays: dict) -> str:
        """Write a state dict already checked to be finite as the checkpoint of ``step``.

        A write that fails (full disk, read-only) is a ``DiskError`` naming the
        file; the atomic writer leaves the previous checkpoints as they were.
        """
        path = os.path.join(self.logdir, checkpoint_name(step))
        try:
            with writing(path):
                atomic_save_npz(path, arrays)
        except DiskError as e:
            # A full disk that holds `keep` checkpoints: the oldest of them would
            # be pruned after this write anyway, so it goes first and the write
            # is tried once more (with keep 1, a nearly full disk could
            # otherwise never take a second checkpoint).
            old = list_checkpoints(self.logdir)[self.keep - 1:]
            if e.error.errno != errno.ENOSPC or not old:
                raise
            for _, p in old:
                _unlink(p)
            if self.last_path in [p for _, p in old]:
                self.last_path = None
            with writing(path):
                atomic_save_npz(path, arrays)
        self.last_path = path
        kept = list_checkpoints(self.logdir)
        # Index first, then delete: the index never names a file that is gone.
        names = [os.path.basename(p) for _, p in reversed(kept[: self.keep])]
        index = os.path.join(self.logdir, INDEX)
        with writing(index):
            atomic_write_text(index, f'model_checkpoint_path: "{names[-1]}"\n'
                              + "".join(f'all_model_checkpoint_paths: "{n}"\n' for n in names))
        for _, old in kept[self.keep :]:
            _unlink(old)
        return path


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def diverged(step: int, what: str, last_path: str | None, cause: str | None = None,
             remedy: str | None = None) -> TrainingError:
    """The error of a run whose loss or weights went non-finite at ``step``.

    ``cause``: what made it, when known (non-finite input, input too large),
    and ``remedy``, what to do about the data (default: replace the NaN/inf
    values); else the usual culprit, a learning rate too high.
    """
    keep = f"the last good checkpoint is {last_path}" if last_path else "no checkpoint was written"
    if cause:
        fix = ("(keep its shape to `resume` from that checkpoint) or start over" if last_path else
               "and start over")
        return TrainingError(f"step {step}: {what}: {cause}; training stopped ({keep}). "
                             f"{remedy or 'Replace the NaN/inf values in `data`'} {fix}")
    then = "then `resume` (it continues from that checkpoint) or start over" if last_path else "and start over"
    return TrainingError(f"step {step}: {what}; training stopped ({keep}). Lower `lr`, {then}")


DATA_PATHS = ("data", "test_data")  # stored absolute


def config_json(cfg) -> str:
    """The run's settings as JSON, with data paths made absolute (eval may run elsewhere)."""
    return json.dumps(asdict(comparable(cfg)), sort_keys=True)


def comparable(cfg):
    """``cfg`` with its data paths absolute, as a checkpoint stores them (to compare with a checkpoint's)."""
    from towers.data.kinds import is_synthetic

    paths = {k: os.path.abspath(getattr(cfg, k)) for k in DATA_PATHS if isinstance(getattr(cfg, k), str)
             and getattr(cfg, k) and not is_synthetic(getattr(cfg, k))}
    return replace(cfg, **paths) if paths else cfg
