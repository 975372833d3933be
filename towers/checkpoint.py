"""Checkpoints: what they hold, how they are written, found and restored.

A checkpoint ``ckpt-<step, 8 digits>.npz`` in the run's logdir holds, under
plain names that do not depend on the number of towers:

* ``params/<name>``, ``ema/<name>`` and (with ``--momentum``) ``momentum/<name>``,
  float32, stored once (every replica holds the same values);
* ``step`` and the input pipeline's position ``data/epoch``, ``data/index``.  The
  shuffle of epoch ``e`` is ``default_rng([seed, e])``, so the seed (in the
  config) and the position are the pipeline's whole RNG state;
* ``config``: the run's settings as a JSON string, ``data/shape`` and
  ``data/num_classes`` (to refuse another dataset), ``n_towers`` and
  ``global_batch`` (to note a change), and ``format``.

The learning rate and the EMA decay are functions of ``step``, and everything
else is scratch, so this is all a bit-identical resume needs.

Every file is written atomically: a temporary file in the same directory is
flushed and fsynced, renamed over the target, and the directory is fsynced.  A
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
import tempfile
import zipfile
from dataclasses import asdict, dataclass

import numpy

from towers import TrainingError, UserError
from towers.placement import to_host

FORMAT = 1
INDEX = "checkpoint"  # the TensorFlow-style text file naming the latest checkpoint
_CKPT = re.compile(r"^ckpt-(\d{8,})\.npz$")
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: no wall clock in the bytes


def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (a no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save_npz(path: str, arrays: dict) -> None:
    """Write ``arrays`` to ``path`` as an uncompressed, deterministic npz, atomically."""
    _atomic_write(path, lambda f: _write_npz(f, arrays))


def atomic_write_text(path: str, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def _write_npz(f, arrays: dict) -> None:
    # numpy.savez stamps each member with the current time; a fixed stamp makes
    # the file a function of the arrays alone (byte-identical resume test).
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=_ZIP_EPOCH)
            with zf.open(info, "w", force_zip64=True) as member:
                numpy.lib.format.write_array(member, numpy.asanyarray(value), allow_pickle=False)


def _atomic_write(path: str, write) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide it from other readers
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


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


def latest_checkpoint(logdir: str, warn=None) -> tuple[str, dict] | None:
    """The newest loadable checkpoint in ``logdir`` as (path, arrays), or None if there is none.

    Unreadable newer ones are reported through ``warn`` and skipped.  When
    checkpoints exist but none loads, that is an error, not a silent fresh start.
    """
    candidates = list_checkpoints(logdir)
    bad = []
    for _, path in candidates:
        try:
            return path, load_checkpoint(path)
        except CheckpointError as e:
            bad.append(path)
            if warn:
                warn(f"checkpoint {path} is unreadable ({e}); trying the one before it")
    if bad:
        raise UserError(
            f"none of the {len(bad)} checkpoints in {logdir} can be read (newest: {bad[0]}); "
            "move them away to start fresh, or point --logdir elsewhere"
        )
    return None


def read_model(arrays: dict, prefix: str) -> dict[str, numpy.ndarray]:
    """The named arrays under ``prefix/`` (e.g. ``params``), without the prefix."""
    return {k[len(prefix) + 1 :]: v for k, v in arrays.items() if k.startswith(prefix + "/")}


def model_weights(model, arrays: dict, prefix: str, path: str, fix: str) -> dict[str, numpy.ndarray]:
    """The checkpoint's ``prefix`` weights, checked against ``model``'s names and shapes."""
    named = read_model(arrays, prefix)
    want = {name: shape for name, shape, _, _ in model.layout()}
    have = {name: tuple(a.shape) for name, a in named.items()}
    if want != have:
        n = (sorted(set(want) ^ set(have)) or [n for n in want if want[n] != have[n]])[0]
        ck = arrays["config"]
        raise UserError(
            f"{path} does not fit this model: {n} is {have.get(n, 'absent')} there but "
            f"{want.get(n, 'absent')} here (the checkpoint was trained with --model {ck.get('model')} "
            f"--hidden {ck.get('hidden')}); {fix}"
        )
    return named


def advance(position: tuple[int, int], examples: int, n: int) -> tuple[int, int]:
    """The pipeline position ``examples`` further on (every epoch holds ``n``)."""
    return divmod(position[0] * n + position[1] + examples, n)


# -- writing during training --------------------------------------------------------


class Checkpointer:
    """Writes ``ckpt-*.npz`` every ``every`` steps (0: only at the end), keeps the newest ``keep``."""

    def __init__(self, logdir: str, cfg, dataset, n_towers: int, start_step: int = 0,
                 start_position: tuple[int, int] = (0, 0)):
        self.logdir, self.every, self.keep = logdir, cfg.checkpoint_every, cfg.keep_checkpoints
        self.n_towers, self.global_batch = n_towers, cfg.batch_size * n_towers
        self.start_step, self.start_position = start_step, tuple(start_position)
        self.dataset = dataset
        self.config_json = config_json(cfg)
        self.last_path: str | None = None  # the newest checkpoint on disk, once known

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def position(self, step: int) -> tuple[int, int]:
        """Where the input pipeline stands after ``step``: every step takes one global batch."""
        return advance(self.start_position, (step - self.start_step) * self.global_batch, len(self.dataset.x))

    def save(self, trainer) -> str:
        """Write the trainer's state (a host sync on GPU), then the index, then prune."""
        step, model = trainer.step, trainer.model
        named = {"params": flat_to_named(model, trainer.replicas[0].params),
                 "ema": flat_to_named(model, trainer.ema.shadow)}
        velocity = trainer.optimizers[0].velocity
        if velocity is not None:
            named["momentum"] = flat_to_named(model, velocity)
        for kind, arrays in named.items():
            for name, a in arrays.items():
                if not numpy.isfinite(a).all():
                    raise diverged(step, f"{kind}/{name} holds non-finite values", self.last_path)
        epoch, index = self.position(step)
        arrays = {f"{kind}/{name}": a for kind, d in named.items() for name, a in d.items()}
        arrays.update({
            "format": numpy.int64(FORMAT), "step": numpy.int64(step),
            "data/epoch": numpy.int64(epoch), "data/index": numpy.int64(index),
            "data/shape": numpy.array(self.dataset.x.shape, dtype=numpy.int64),
            "data/num_classes": numpy.int64(self.dataset.num_classes),
            "n_towers": numpy.int64(self.n_towers), "global_batch": numpy.int64(self.global_batch),
            "sync/n_averages": numpy.int64(trainer.n_averages),
            "config": numpy.array(self.config_json),
        })
        path = os.path.join(self.logdir, checkpoint_name(step))
        atomic_save_npz(path, arrays)
        self.last_path = path
        kept = list_checkpoints(self.logdir)
        # Index first, then delete: the index never names a file that is gone.
        names = [os.path.basename(p) for _, p in reversed(kept[: self.keep])]
        atomic_write_text(os.path.join(self.logdir, INDEX),
                          f'model_checkpoint_path: "{names[-1]}"\n'
                          + "".join(f'all_model_checkpoint_paths: "{n}"\n' for n in names))
        for _, old in kept[self.keep :]:
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass
        return path


def diverged(step: int, what: str, last_path: str | None) -> TrainingError:
    keep = f"the last good checkpoint is {last_path}" if last_path else "no checkpoint was written"
    return TrainingError(
        f"step {step}: {what}; training stopped ({keep}). "
        "Lower --lr, then --resume (it continues from that checkpoint) or start over"
    )


def config_json(cfg) -> str:
    """The run's settings as JSON, with data paths made absolute (eval may run elsewhere)."""
    d = asdict(cfg)
    for key in ("data", "test_data"):
        if d.get(key):
            d[key] = os.path.abspath(d[key])
    return json.dumps(d, sort_keys=True)


def remove_stale_temporaries(logdir: str) -> None:
    """Delete temporary files a killed writer left behind (they were never renamed into place)."""
    for path in glob.glob(os.path.join(glob.escape(logdir), ".*.tmp")):
        try:
            os.unlink(path)
        except OSError:
            pass


# -- resuming -----------------------------------------------------------------------

# Settings whose change makes the continuation differ from an uninterrupted run.
_TRAJECTORY = ("lr", "lr_decay", "staircase", "momentum", "l2", "ema_decay", "seed", "sync", "average_every")


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
    remove_stale_temporaries(logdir)
    found = latest_checkpoint(logdir, warn=lambda line: say(line, note=True))
    if found is None:
        say(f"--resume: no checkpoint in {logdir}; starting fresh", note=True)
        return None
    path, arrays = found
    ck = arrays["config"]
    shape, classes = tuple(int(v) for v in arrays["data/shape"]), int(arrays.get("data/num_classes", -1))
    if shape != tuple(dataset.x.shape) or classes != dataset.num_classes:
        raise UserError(
            f"{path} was trained on data of shape {shape} with {classes} classes ({ck.get('data')}), "
            f"but --data gives {tuple(dataset.x.shape)} with {dataset.num_classes} classes: "
            "resume with the same --data, or use another --logdir"
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
    changed = [f"--{k.replace('_', '-')} {ck[k]} -> {getattr(cfg, k)}"
               for k in _TRAJECTORY if k in ck and ck[k] != getattr(cfg, k)]
    if changed:
        say(f"note: settings changed since the checkpoint ({', '.join(changed)}): "
            "the continuation differs from an uninterrupted run", note=True)
    return r


def restore(trainer, resume: Resume) -> None:
    """Load a checkpoint into every replica, the EMA and the momentum buffers."""
    model, arrays = trainer.model, resume.arrays
    flat = named_to_flat(model, model_weights(model, arrays, "params", resume.path,
                                              "resume with the checkpoint's settings, or use another --logdir"))
    for dev, r in zip(trainer.devices, trainer.replicas):
        with dev.scope():
            r.set_params(flat)
    with trainer.devices[0].scope():
        trainer.ema.shadow[...] = trainer.devices[0].xp.asarray(named_to_flat(model, read_model(arrays, "ema")))
    momentum = read_model(arrays, "momentum")
    for dev, opt in zip(trainer.devices, trainer.optimizers):
        if opt.velocity is not None and momentum:  # no buffers saved: start from zero (noted above)
            with dev.scope():
                opt.velocity[...] = dev.xp.asarray(named_to_flat(model, momentum))
    trainer.step = resume.step
    trainer.n_averages = int(arrays.get("sync/n_averages", 0))
    if trainer.weights_mode:  # checkpoints are taken right after an average
        trainer.last_average = trainer.step
