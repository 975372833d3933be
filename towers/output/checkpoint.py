"""Checkpoints: what they hold, how they are written, found and restored.

A checkpoint ``ckpt-<step, 8 digits>.npz`` in the run's logdir holds, under
plain names that do not depend on the number of towers:

* ``params/<name>``, ``ema/<name>`` and the optimizer's state (``momentum/<name>``
  for SGD with momentum, ``adam_m/<name>`` and ``adam_v/<name>`` for Adam),
  float32, stored once (every replica holds the same values);
* ``step`` and the input pipeline's position ``data/epoch``, ``data/index``.  The
  shuffle of epoch ``e`` is ``default_rng([seed, e])``, so the seed (in the
  config) and the position are the pipeline's whole RNG state;
* ``config``: the run's settings as a JSON string, ``data/shape`` and
  ``data/num_classes`` (to refuse another dataset), ``n_towers`` and
  ``global_batch`` (to note a change), ``sync/n_averages`` (the EMA's count in
  weights mode), and ``format``.

The learning rate and the EMA decay are functions of ``step``, and everything
else is scratch, so this is all a bit-identical resume needs.

Every file is written atomically (``towers.output.files``): a temporary file in
an owned folder beside the target is fsynced, renamed over the target, and the
directory is fsynced.  A
crash (even SIGKILL) at any moment leaves the old file or the complete new one,
never a torn one.  The text file ``checkpoint`` names the latest, as
TensorFlow's does, and is written the same way.  npz members get a fixed
timestamp, so equal arrays give byte-identical files.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import asdict, dataclass

import numpy

from towers.devices.placement import to_host
from towers.errors import TrainingError, UserError
from towers.output.files import atomic_save_npz, atomic_write_text, remove_stale, writing

FORMAT = 1
INDEX = "checkpoint"  # the TensorFlow-style text file naming the latest checkpoint
_CKPT = re.compile(r"^ckpt-(\d{8,})\.npz$")


def flat_to_named(model, flat) -> dict[str, numpy.ndarray]:
    """Split a flat buffer into named host arrays using the model's layout."""
    host = to_host(flat, copy=True)
    return {name: host[off : off + size].reshape(shape) for name, shape, off, size in model.layout()}


def named_to_flat(model, named: dict) -> numpy.ndarray:
    """Inverse of ``flat_to_named``: a host float32 flat buffer."""
    flat = numpy.empty(model.size, dtype=numpy.float32)
    for name, shape, off, size in model.layout():
        flat[off : off + size] = numpy.asarray(named[name], dtype=numpy.float32).reshape(-1)
    return flat


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


def load_checkpoint(path: str) -> dict:
    """All arrays of a checkpoint, read in full (so zip CRCs are verified)."""
    try:
        with numpy.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # truncated, corrupt, not a zip, vanished: all "unreadable"
        raise CheckpointError(f"{e.__class__.__name__}: {e}") from None
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


def non_finite(arrays: dict) -> str | None:
    """The first weight or optimizer-state array of a state dict holding NaN or inf, or None."""
    for key, a in arrays.items():
        if key.split("/", 1)[0] in ("params", "ema") + _SLOTS and not numpy.isfinite(a).all():
            return key
    return None


def read_model(arrays: dict, prefix: str) -> dict[str, numpy.ndarray]:
    """The named arrays under ``prefix/`` (e.g. ``params``), without the prefix."""
    return {k[len(prefix) + 1 :]: v for k, v in arrays.items() if k.startswith(prefix + "/")}


def model_weights(model, arrays: dict, prefix: str, path: str, fix: str) -> dict[str, numpy.ndarray]:
    """The checkpoint's ``prefix`` weights, checked by ``check_names``; a mismatch names the
    settings the checkpoint was trained with."""
    try:
        return check_names(model, read_model(arrays, prefix), f"{path} does not fit this model")
    except UserError as e:
        ck = arrays["config"]
        raise UserError(f"{e} (the checkpoint was trained with `model` {ck.get('model')} "
                        f"`hidden` {ck.get('hidden')}); {fix}") from None


def advance(position: tuple[int, int], examples: int, n: int) -> tuple[int, int]:
    """The pipeline position ``examples`` further on (every epoch holds ``n``)."""
    return divmod(position[0] * n + position[1] + examples, n)


# -- the state dict: what a checkpoint holds -------------------------------------------

_META = ("format", "step", "data/epoch", "data/index", "data/shape", "data/num_classes",
         "n_towers", "global_batch", "sync/n_averages", "config", "data/classes")
_SLOTS = ("momentum", "adam_m", "adam_v")  # optimizer state buffers any optimizer may have


def check_names(model, named: dict, where: str) -> dict:
    """``named`` if it has exactly the model's names with their shapes, finite real values; else a UserError naming one."""
    if not isinstance(named, dict):
        raise UserError(f"{where}: give a dict of name -> array, got {type(named).__name__}")
    want = {name: shape for name, shape, _, _ in model.layout()}
    for name in want:
        if name not in named:
            raise UserError(f"{where}: {name!r} is missing (the model has {', '.join(want)})")
    for name, a in named.items():
        if name not in want:
            raise UserError(f"{where}: {name!r} is not a weight of this model (it has {', '.join(want)})")
        if tuple(numpy.shape(a)) != want[name]:
            raise UserError(f"{where}: {name!r} has shape {tuple(numpy.shape(a))}, the model's is {want[name]}")
        a = numpy.asarray(a)
        if not (numpy.issubdtype(a.dtype, numpy.floating) or numpy.issubdtype(a.dtype, numpy.integer)):
            raise UserError(f"{where}: {name!r} is {a.dtype}; give real numbers (float32)")
        if not numpy.isfinite(a).all():
            raise UserError(f"{where}: {name!r} holds NaN or inf")
    return named


def state_dict(trainer) -> dict:
    """The trainer's state as {name: host array}: weights, EMA, optimizer state, step, input position."""
    model = trainer.model
    named = {"params": flat_to_named(model, trainer.replicas[0].params),
             "ema": flat_to_named(model, trainer.ema.shadow)}
    for slot, buf in trainer.optimizers[0].state.items():
        named[slot] = flat_to_named(model, buf)
    arrays = {f"{kind}/{name}": a for kind, d in named.items() for name, a in d.items()}
    epoch, index = trainer.data_position()
    ds = trainer.dataset
    arrays.update({
        "format": numpy.int64(FORMAT), "step": numpy.int64(trainer.step),
        "data/epoch": numpy.int64(epoch), "data/index": numpy.int64(index),
        "data/shape": numpy.array(ds.x.shape, dtype=numpy.int64),
        "data/num_classes": numpy.int64(ds.num_classes),
        "n_towers": numpy.int64(trainer.n_towers), "global_batch": numpy.int64(trainer.global_batch),
        "sync/n_averages": numpy.int64(trainer.n_averages),
        "config": numpy.array(config_json(trainer.cfg)),
    })
    if getattr(ds, "class_names", None):  # an image folder's classes, by label (shown by towers.eval)
        arrays["data/classes"] = numpy.array(json.dumps(list(ds.class_names)))
    return arrays


def load_state_dict(trainer, state: dict, where: str) -> None:
    """Load ``state`` (``state_dict`` output or a checkpoint's arrays) into ``trainer``.

    Strict: an unknown key, a missing one, or a weight of the wrong name or
    shape is a UserError naming it, and nothing is changed.  Optimizer state
    of another optimizer (or none, after a change of ``momentum``) is allowed:
    the buffers this optimizer lacks start at zero.
    """
    model, ds = trainer.model, trainer.dataset
    prefixes = {k.split("/", 1)[0] for k in state if "/" in k and k not in _META}
    for key in state:
        if key not in _META and key.split("/", 1)[0] not in ("params", "ema") + _SLOTS:
            raise UserError(f"{where}: {key!r} is not part of a towers state dict")
    for key in _META[:5]:
        if key not in state:
            raise UserError(f"{where}: {key!r} is missing")
    shape, classes = tuple(int(v) for v in state["data/shape"]), int(state.get("data/num_classes", -1))
    if shape[1:] != tuple(ds.example_shape) or classes != ds.num_classes:
        raise UserError(f"{where}: trained on examples of shape {shape[1:]} with {classes} classes, "
                        f"but the data has {ds.example_shape} with {ds.num_classes} classes")
    flats = {kind: named_to_flat(model, check_names(model, read_model(state, kind), f"{where} ({kind})"))
             for kind in ("params", "ema") + _SLOTS if kind in prefixes}
    for kind in ("params", "ema"):
        if kind not in flats:
            raise UserError(f"{where}: no {kind}/ weights")
    trainer.synchronize()
    for i, (dev, r, opt) in enumerate(zip(trainer.devices, trainer.replicas, trainer.optimizers)):
        with dev.scope():
            r.set_params(flats["params"])
            for slot, buf in opt.state.items():
                buf[...] = dev.xp.asarray(flats[slot]) if slot in flats else 0
            if i == 0:
                trainer.ema.shadow[...] = dev.xp.asarray(flats["ema"])
    trainer.step = int(state["step"])
    trainer.n_averages = int(state.get("sync/n_averages", 0))
    # Checkpoints are taken right after an average (weights mode) or hold every
    # replica's identical weights (grads mode).
    trainer.last_average = trainer.step


# -- writing during training --------------------------------------------------------


class Checkpointer:
    """Writes ``ckpt-*.npz`` files and the index, keeps the newest ``keep``.

    When is the ``towers.extensions.Checkpoints`` extension's business; it also
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
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass
        return path


def diverged(step: int, what: str, last_path: str | None, cause: str | None = None) -> TrainingError:
    """The error of a run whose loss or weights went non-finite at ``step``.

    ``cause``: what made it, when known (non-finite input); else the usual
    culprit, a learning rate too high.
    """
    keep = f"the last good checkpoint is {last_path}" if last_path else "no checkpoint was written"
    if cause:
        fix = ("(keep its shape to `resume` from that checkpoint) or start over" if last_path else
               "and start over")
        return TrainingError(f"step {step}: {what}: {cause}; training stopped ({keep}). "
                             f"Replace the NaN/inf values in `data` {fix}")
    then = "then `resume` (it continues from that checkpoint) or start over" if last_path else "and start over"
    return TrainingError(f"step {step}: {what}; training stopped ({keep}). Lower `lr`, {then}")


def config_json(cfg) -> str:
    """The run's settings as JSON, with data paths made absolute (eval may run elsewhere)."""
    d = asdict(cfg)
    for key in ("data", "test_data"):
        if d.get(key):
            d[key] = os.path.abspath(d[key])
    return json.dumps(d, sort_keys=True)


# -- resuming -----------------------------------------------------------------------

# Settings whose change makes the continuation differ from an uninterrupted run.
_TRAJECTORY = ("optimizer", "lr", "lr_decay", "staircase", "momentum", "beta1", "beta2", "epsilon", "l2", "ema_decay", "seed", "sync", "average_every")


@dataclass
class Resume:
    path: str
    arrays: dict

    @property
    def step(self) -> int:
        return int(self.arrays["step"])

    @property
    def position(self) -> tuple[int, int]:
        return int(self.arrays["data/epoch"]), int(self.arrays["data/index"])


def find_resume(cfg, logdir: str, dataset, n_towers: int, say) -> Resume | None:
    """What ``--resume`` continues from, after checking the data fits; None: start fresh.

    ``say(line, note=False)`` reports; notes (warnings) go to stderr.
    """
    if os.path.isdir(logdir):
        remove_stale(logdir)  # what writers killed mid-write left behind
    found = latest_checkpoint(logdir, warn=lambda line: say(line, note=True), finite=True)
    if found is None:
        say(f"`resume`: no checkpoint in {logdir}; starting fresh", note=True)
        return None
    path, arrays = found
    ck = arrays["config"]
    shape, classes = tuple(int(v) for v in arrays["data/shape"]), int(arrays.get("data/num_classes", -1))
    if shape != tuple(dataset.x.shape) or classes != dataset.num_classes:
        raise UserError(
            f"{path} was trained on data of shape {shape} with {classes} classes ({ck.get('data')}), "
            f"but `data` gives {tuple(dataset.x.shape)} with {dataset.num_classes} classes: "
            "resume with the same `data`, or use another `logdir`"
        )
    r = Resume(path, arrays)
    say(f"resuming from {path}: step {r.step}, input at epoch {r.position[0]} index {r.position[1]}")
    old_towers, old_batch = int(arrays["n_towers"]), int(arrays["global_batch"])
    new_batch = cfg.batch_size * n_towers
    if (old_towers, old_batch) != (n_towers, new_batch):
        same = ("the same global batch, so it matches an uninterrupted run up to float rounding"
                if old_batch == new_batch else
                f"the global batch changes from {old_batch} to {new_batch}, so it is not bit-identical "
                "to an uninterrupted run")
        say(f"note: the checkpoint was written by {old_towers} tower(s) x {ck.get('batch_size')}, "
            f"this run has {n_towers} x {cfg.batch_size}: {same}", note=True)
    changed = [f"`{k}` {ck[k]} -> {getattr(cfg, k)}"
               for k in _TRAJECTORY if k in ck and ck[k] != getattr(cfg, k)]
    if changed:
        say(f"note: settings changed since the checkpoint ({', '.join(changed)}): "
            "the continuation differs from an uninterrupted run", note=True)
    return r
