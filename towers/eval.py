"""Evaluate a checkpoint on test data: ``python -m towers.eval --logdir DIR``.

Prints the cross-entropy loss (without the L2 term) and the accuracy on the test
data, with the EMA weights by default (``--no-ema``: the raw ones), as the
original's ``mnist_eval.py`` does.  The model and the data come from the
checkpoint's configuration unless ``--data``/``--test-data`` say otherwise;
only the test split is read, and its labels are matched to the checkpoint's
classes (``data/classes``) by name (``towers.data.loading.load_test_data``).
``--watch`` evaluates each new checkpoint as it appears until interrupted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from towers.cli import Parser, run_main, show_notices, warn_about
from towers.errors import UserError
from towers.output.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, \
    model_weights, named_to_flat, recorded_classes
from towers.data.image.load import describe_classes
from towers.data.loading import load_test_data, uses_images
from towers.data.inputs import is_tfrecord
from towers.nn.models import build_model
from towers.nn.replica import Replica
from towers.state import Layout, under
from towers.devices.cpu_threads import input_workers
from towers.devices.placement import resolve


MAX_INTERVAL = 86400  # seconds between --watch polls; a longer wait is a typo, not a schedule


NAME = "towers.eval"  # in its error lines (the README's)


def build_parser(prog: str = "python -m towers.eval") -> argparse.ArgumentParser:
    ap = Parser(prog=prog, name=NAME, description="Loss and accuracy of a towers checkpoint on test data.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--logdir", help="evaluate the latest valid checkpoint of this run")
    src.add_argument("--checkpoint", metavar="PATH",
                     help="evaluate this ckpt-*.npz, or a run's final.npz (its run's last checkpoint beside it)")
    ap.add_argument("--no-ema", dest="ema", action="store_false", help="use the raw weights, not the EMA")
    ap.add_argument("--data", help="data whose x_test/y_test to evaluate on (.npz), in place of the checkpoint's "
                    "--data and --test-data")
    ap.add_argument("--test-data", help="test data (.npz, TFRecord or image folder), read alone: the training data "
                    "is not needed; default: the checkpoint's --test-data")
    ap.add_argument("--x-key", help="npz key or TFRecord feature of the examples (default: the checkpoint's)")
    ap.add_argument("--y-key", help="npz key or TFRecord feature of the labels (default: the checkpoint's)")
    ap.add_argument("--decode", help="TFRecord: NAME:DTYPE[:SHAPE] or NAME:image:H,W,C (default: the checkpoint's)")
    ap.add_argument("--watch", action="store_true", help="evaluate each new checkpoint in --logdir until interrupted")
    ap.add_argument("--interval", type=float, default=10.0, metavar="SEC",
                    help=f"seconds between polls with --watch (0 < SEC <= {MAX_INTERVAL})")
    ap.add_argument("--max-evals", type=int, default=0, help=argparse.SUPPRESS)  # tests: stop after N
    return ap


class Evaluator:
    """Evaluates checkpoints on one device, loading each distinct test set once."""

    def __init__(self, args):
        self.args = args
        self.device = resolve(1, None, soft=True).towers[0]  # a GPU when there is one
        self._data: dict = {}

    def dataset(self, arrays: dict):
        """The test set a checkpoint is evaluated on (loaded once per distinct source), labelled in its classes.

        ``--test-data`` (else the checkpoint's, unless ``--data`` replaces the whole data source) is read
        alone; without one, the test split of ``--data`` (else the checkpoint's): an npz's ``x_test``/
        ``y_test``.  The training data is never read: what the test split is checked and matched against
        (example shape, classes and their names, the stored dtype) is in the checkpoint.
        """
        a, ck = self.args, arrays["config"]
        test = a.test_data or (None if a.data else ck.get("test_data"))
        path = test or a.data or ck["data"]
        x_key, y_key = a.x_key or ck.get("x_key", "x"), a.y_key or ck.get("y_key", "y")
        shape = tuple(int(v) for v in arrays["data/shape"][1:])
        classes = recorded_classes(arrays)
        stored = json.loads(str(arrays["data/fingerprint"][()])) if "data/fingerprint" in arrays else {}
        key = (path, test is None, x_key, y_key, shape, int(arrays["data/num_classes"]),
               tuple(classes) if classes else None, stored.get("dtype"))
        if key not in self._data:
            # Trained from images (a folder: it recorded its classes): the test split is made as images too.
            images = classes is not None or uses_images(None, ck.get("decode"), ck.get("augment", "none"),
                                                        ck.get("normalize"), ck.get("image_size"))
            ds = load_test_data(path, shape, key[5], classes, stored.get("dtype"), x_key, y_key,
                                decode=a.decode or (ck.get("decode") if is_tfrecord(path) else None),
                                on_error=ck.get("on_error", "stop"), workers=input_workers(ck.get("input_workers"), 0),
                                augment=ck.get("augment", "none"), normalize=ck.get("normalize"),
                                image_size=ck.get("image_size"), own=test is None, images=images)
            warn_about(ds, NAME)
            self._data[key] = ds
        return self._data[key]

    def close(self) -> None:
        """Stop the worker processes of TFRecord and image test sets."""
        for ds in self._data.values():
            ds.close()

    def evaluate(self, path: str, arrays: dict) -> str:
        ck, step = arrays["config"], int(arrays["step"])
        shape, classes = tuple(int(v) for v in arrays["data/shape"][1:]), int(arrays["data/num_classes"])
        ds = self.dataset(arrays)
        model = build_model(ck.get("model", "mlp"), shape, classes, ck.get("hidden", 500))
        which = "ema" if self.args.ema else "params"
        flat = named_to_flat(model, model_weights(model, arrays, which, path, "it cannot be evaluated"))
        buffers = Layout(model.buffer_layout())  # moving statistics: evaluation normalizes with them
        buffers = buffers.join(buffers.check(under(arrays, "buffers"), f"{path} does not fit this model", "buffer"))
        with self.device.scope():
            replica = Replica(model, self.device.xp)
            replica.set_params(flat)
            replica.set_buffers(buffers)
            loss, acc = replica.evaluate(ds.x, ds.y)
        names = recorded_classes(arrays)
        classes = f"; classes {describe_classes(names)}" if names else ""
        return (f"{os.path.basename(path)} (step {step}): loss = {loss:.4f}, accuracy = {acc:.4f} "
                f"on {len(ds.y)} test examples ({'EMA' if self.args.ema else 'raw'} weights){classes}")


def _warn(line: str) -> None:
    print(f"towers.eval: {line}", file=sys.stderr, flush=True)  # (a skipped checkpoint: not a "warning:" line)


def newest_readable(logdir: str, warn) -> tuple[str, dict] | None:
    """``latest_checkpoint`` for evaluation: the newest checkpoint that loads, or None when there is none.

    The files skipped on the way are reported through ``warn`` only when one
    loads; when none does, the error says so in eval's terms (the checkpoint
    module's message advises a training run to start fresh).
    """
    skipped = []
    try:
        found = latest_checkpoint(logdir, warn=skipped.append)
    except UserError:
        names = list_checkpoints(logdir)  # a training run's rotation may have removed them since
        newest, why = ((f" (newest: {names[0][1]})", f"; --checkpoint {names[0][1]} shows why it fails")
                       if names else ("", ""))
        raise UserError(f"none of the {len(skipped)} checkpoints in {logdir} can be read{newest}: "
                        f"nothing to evaluate{why}") from None
    for line in skipped:
        warn(line)
    return found


def run(args) -> None:
    ev = Evaluator(args)
    try:
        _run(args, ev)
    finally:
        ev.close()


def _run(args, ev: "Evaluator") -> None:
    if args.checkpoint:
        if args.watch:
            raise UserError("--watch needs --logdir (it waits for new checkpoints there), not --checkpoint")
        try:
            arrays = load_checkpoint(args.checkpoint, final=True)  # a run's final.npz too
        except CheckpointError as e:
            raise UserError(f"{args.checkpoint} is not a readable checkpoint ({e})") from None
        print(ev.evaluate(args.checkpoint, arrays), flush=True)
        return
    if not os.path.isdir(args.logdir):
        raise UserError(f"--logdir {args.logdir} is not a directory: give the --logdir of a training run")
    if not args.watch:
        found = newest_readable(args.logdir, _warn)
        if found is None:
            raise UserError(f"no checkpoint in {args.logdir}: train with --logdir {args.logdir} first")
        print(ev.evaluate(*found), flush=True)
        return
    last_step, evals, warned = None, 0, set()

    def warn_once(line):  # a corrupt file would otherwise be reported at every poll
        if line not in warned:
            warned.add(line)
            _warn(line)

    print(f"watching {args.logdir} for new checkpoints every {args.interval:g} s (Ctrl-C stops)", flush=True)
    while True:
        found = newest_readable(args.logdir, warn_once)
        if found is not None and int(found[1]["step"]) != last_step:
            print(ev.evaluate(*found), flush=True)
            last_step, evals = int(found[1]["step"]), evals + 1
            if args.max_evals and evals >= args.max_evals:
                return
        time.sleep(args.interval)


def main(argv=None, prog: str = "towers-eval") -> int:
    """The command line (``towers-eval``, ``python -m towers.eval``: ``prog``, the command its usage line names);
    returns the exit status."""
    args = build_parser(prog).parse_args(argv)
    show_notices()  # the loader's notices (an index being built, records skipped)

    def body():
        if not 0 < args.interval <= MAX_INTERVAL:  # also false for nan; time.sleep raises past int64 ns
            raise UserError(f"--interval must be a finite number of seconds > 0 (at most {MAX_INTERVAL}, a day), "
                            f"got {args.interval:g}")
        try:
            run(args)
        except KeyboardInterrupt:  # the way --watch ends
            if not args.watch:
                raise
            print(f"{NAME}: stopped", file=sys.stderr)

    return run_main(NAME, body)


if __name__ == "__main__":
    sys.exit(main(prog="python -m towers.eval"))
