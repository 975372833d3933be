"""Weights for other frameworks: a towers checkpoint or ``final.npz`` to a safetensors file.

    python -m towers.export CHECKPOINT -o OUT.safetensors [--ema] [--layout towers|torch|keras]

(``towers-export`` when installed.)  The raw weights by default, the EMA's with ``--ema``.

Layouts (docs/export.md's table has the names of the built-in models):

* ``towers`` (the default): every weight under its towers name and shape, as the checkpoint holds it
  (``layer1/weights`` (in, out), a Conv2D's ``weights`` (kh, kw, in, out)).
* ``torch`` and ``keras``: each weight as its layer declares it for that framework (``Layer.exports``:
  its name there and how its array is turned; ``Layer.export_order``: the order of the features a layer
  hands on, which PyTorch's ``nn.Flatten`` of NCHW maps changes), under ``SCOPE.name`` (PyTorch, ``/``
  -> ``.`` inside blocks) or ``SCOPE/name`` (Keras).  The built-in layers declare PyTorch's
  ``nn.Linear``, ``nn.Conv2d``, ``nn.BatchNorm2d`` and Keras' ``Dense``, ``Conv2D``,
  ``BatchNormalization``; a layer of one's own declares its own, and this module needs no change.
  This needs the model's layers, which a checkpoint's settings give (``final.npz`` holds only
  weights: its run's checkpoint of the same step, beside it, is read for them).

Every layout holds the model's buffers (BatchNorm's moving statistics) beside its weights: with ``--ema``
the EMA's weights and the buffers, which is what towers evaluates with.

Algorithm: read the npz whole (``numpy.load``, no pickles), take ``params/*`` or ``ema/*`` and
``buffers/*``, convert, serialize with ``safetensors.numpy.save`` (bytes) and write those into a
temporary file that becomes ``OUT`` only when complete (``towers.files.atomic_write``; not
``save_file``, whose own temporary file and rename would bypass it and whose I/O errors are not
``OSError``).  The file's metadata records the layout, which weights, the step and, when known, the
model, its input shape, its class count and (an image folder's) the class names, a JSON list, label k
at k.  (safetensors writes the metadata's keys in no fixed order: two exports of one checkpoint hold
the same tensors and header, not always the same bytes.)

Limits: a weight its layer does not declare for the layout asked is refused with a line saying to use
``--layout towers``; so is a weight or buffer holding NaN or inf, as ``--resume`` and ``towers.eval``
refuse it.  Every weight is loaded in memory at once.  Bad input (a missing file, not a
checkpoint, an output that exists, a folder that is missing or may not be written: read-only, no
permission) is one line, exit 2, and no file; a failed write (a full disk, an I/O error) one line,
exit 1, and no file.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from towers.cli import Parser, run_main
from towers.errors import UserError
from towers.files import check_new_output, write_new_output
from towers.output.checkpoint import final_checkpoint, non_finite, not_a_zip, recorded_classes
from towers.state import Layout

LAYOUTS = ("towers", "torch", "keras")


def read_weights(path: str, ema: bool) -> tuple[dict, dict]:
    """(name -> float32 array, what is known of the run: ``step`` and, for a checkpoint, ``config`` and the data's
    ``shape``, ``classes`` (their count) and ``class_names`` (an image folder's, else None)) of a checkpoint or
    final.npz; anything else is a UserError."""
    what = "give a checkpoint (ckpt-*.npz) or the final.npz of a towers run"
    if os.path.isdir(path):
        raise UserError(f"{path} is a directory: {what}")
    if not os.path.exists(path):
        raise UserError(f"{path} does not exist: {what}")
    try:
        unzipped = not_a_zip(path)
        if unzipped:
            raise UserError(f"{path} is not a readable npz file ({unzipped}): {what}")
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except UserError:
        raise
    except Exception as e:  # cut short, a damaged member, pickles, unreadable: all "not what we read"
        raise UserError(f"{path} is not a readable npz file ({type(e).__name__}: {e}): {what}") from None
    prefix = "ema/" if ema else "params/"
    named = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    if named:  # a checkpoint keeps buffers (moving statistics) apart; final.npz has them under both prefixes
        named.update({k[len("buffers/"):]: v for k, v in arrays.items()
                      if k.startswith("buffers/") and k[len("buffers/"):] not in named})
    if not named or "step" not in arrays:
        keys = ", ".join(sorted(arrays)[:6]) or "none"
        raise UserError(f"{path} is not a towers checkpoint or final.npz (no {prefix}* weights and step; keys: "
                        f"{keys}): {what}")
    bad = non_finite(named)  # the check --resume skips such a checkpoint by; towers.eval refuses one too
    if bad is not None:
        raise UserError(f"{path}: the {'EMA' if ema else 'raw'} weight {bad!r} holds NaN or inf (the run diverged "
                        "before it was written): export an earlier checkpoint")
    run = {"step": int(arrays["step"])}
    if "config" in arrays:
        try:
            run["config"] = json.loads(str(arrays["config"][()]))
        except ValueError as e:
            raise UserError(f"{path}: its config is not JSON ({e}); {what}") from None
        run["shape"] = tuple(int(v) for v in arrays["data/shape"][1:])
        run["classes"] = int(arrays["data/num_classes"])
        run["class_names"] = recorded_classes(arrays)
    return {k: np.asarray(v, np.float32) for k, v in named.items()}, run


def _run_of_final(path: str, run: dict) -> dict:
    """A final.npz's settings, from its run's checkpoint of the same step beside it."""
    beside = final_checkpoint(path, run["step"])
    if not os.path.exists(beside):
        raise UserError(f"{path} holds weights only, and the checkpoint of its step ({beside}) is not beside it: "
                        "--layout torch and keras need the model's layers; export that checkpoint, or use --layout "
                        "towers")
    found = read_weights(beside, False)[1]
    if "config" not in found:
        raise UserError(f"{beside} is not a checkpoint (no config): export a checkpoint, or use --layout towers")
    return found


def build(run: dict, path: str, layout: str):
    """The model a run trained, built from its checkpoint's settings (``towers.nn.models.build_model``)."""
    from towers.nn.models import build_model

    ck = run["config"]
    try:
        return build_model(ck.get("model", "mlp"), run["shape"], run["classes"], ck.get("hidden", 500))
    except UserError as e:
        raise UserError(f"{path}: cannot build its model for --layout {layout} ({e}); use --layout towers") from None


# The frameworks whose layouts layers declare (``Layer.exports``), and how each joins scope and name.
SEPARATORS = {"torch": ".", "keras": "/"}


def convert(model, named: dict, framework: str) -> dict:
    """``named`` (towers names and layouts) in ``framework``'s layout, as each layer declares it
    (``Layer.exports`` for its weights, ``Layer.export_order`` for the order of the features it hands on)."""
    out, shape, order = {}, model.input_shape, None
    by_layer = {}
    for li, name, _ in model.params:
        by_layer.setdefault(li, []).append(name)
    sep = SEPARATORS[framework]
    for li, layer in enumerate(model.layers):
        next_shape = layer.build(shape)[1]  # again, for the shapes between the layers (build is pure)
        declared = layer.exports(framework) if li in by_layer else {}
        for name in by_layer.get(li, []):
            local = name[len(layer.scope) + 1:] if layer.scope else name
            found = declared.get(local)
            if not found:
                raise UserError(f"weight {name!r} ({type(layer).__name__}) has no {framework} layout: "
                                f"{type(layer).__name__}.exports does not declare it; export it with --layout towers")
            for e in found if isinstance(found, tuple) else (found,):
                target = f"{layer.scope}/{e.name}" if layer.scope else e.name
                out[target.replace("/", sep)] = np.ascontiguousarray(e.convert(named[name], order))
        order = layer.export_order(framework, shape, order)
        shape = next_shape
    return out


def export(path: str, out: str, ema: bool = False, layout: str = "towers") -> dict:
    """Write the weights of the checkpoint or final.npz ``path`` to the safetensors file ``out``; return
    name -> shape of what was written.  A bad input or output path is a UserError, a failed write (full
    disk, I/O error) a DiskError; either way ``out`` is not written."""
    if layout not in LAYOUTS:
        raise UserError(f"--layout {layout!r} is unknown: use one of {', '.join(LAYOUTS)}")
    check_new_output(out, "export", "-o", "model.safetensors")
    named, run = read_weights(path, ema)
    metadata = {"format": "pt" if layout == "torch" else "np", "towers.layout": layout,
                "towers.weights": "ema" if ema else "raw", "towers.step": str(run["step"])}
    if layout in SEPARATORS:
        if "config" not in run:
            run = dict(_run_of_final(path, run), step=run["step"])
        model = build(run, path, layout)
        Layout(model.layout() + model.buffer_layout()).check(named, f"{path} does not fit its own settings' model")
        tensors = convert(model, named, layout)
    else:
        tensors = named
    if "config" in run:
        metadata.update({"towers.model": str(run["config"].get("model", "mlp")),
                         "towers.input_shape": json.dumps(list(run["shape"])), "towers.classes": str(run["classes"])})
        if run["class_names"]:  # an image folder's, label k at k
            metadata["towers.class_names"] = json.dumps(run["class_names"])
    from safetensors.numpy import save

    data = save(tensors, metadata=metadata)
    write_new_output(out, lambda f: f.write(data), "-o")
    return {k: tuple(v.shape) for k, v in tensors.items()}


NAME = "towers.export"  # in its error lines (docs/errors.md's)


def build_parser(prog: str = "python -m towers.export") -> Parser:
    ap = Parser(prog=prog, name=NAME, description="A towers checkpoint or final.npz to a safetensors file.")
    ap.add_argument("checkpoint", metavar="CHECKPOINT", help="a ckpt-*.npz or the final.npz of a run")
    ap.add_argument("-o", "--output", required=True, metavar="OUT.safetensors", help="the file to write (not over "
                    "an existing one)")
    ap.add_argument("--ema", action="store_true", help="the EMA weights (default: the raw ones)")
    ap.add_argument("--layout", choices=LAYOUTS, default="towers",
                    help="towers: names and shapes as towers (and Keras) keep them; torch: PyTorch's names and "
                         "shapes (see docs/export.md)")
    return ap


def main(argv=None, prog: str = "towers-export") -> int:
    args = build_parser(prog).parse_args(argv)

    def body():
        shapes = export(args.checkpoint, args.output, args.ema, args.layout)
        print(f"wrote {args.output}: {len(shapes)} tensors ({'EMA' if args.ema else 'raw'} weights, "
              f"{args.layout} layout)", flush=True)

    return run_main(NAME, body)


if __name__ == "__main__":
    sys.exit(main(prog="python -m towers.export"))
