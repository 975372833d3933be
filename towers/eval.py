"""Evaluate a checkpoint on test data: ``python -m towers.eval --logdir DIR``.

Prints the cross-entropy loss (without the L2 term) and the accuracy on the test
data, with the EMA weights by default (``--no-ema``: the raw ones), as the
original's ``mnist_eval.py`` does.  The model and the data come from the
checkpoint's configuration unless ``--data``/``--test-data`` say otherwise;
only the test split is read, and its labels are matched to the checkpoint's
classes (``data/classes``) by name (``towers.data.loading.load_test_data``);
a run of ``--validation-split`` without test data is evaluated on the
examples it held out, its training data read again and split as it was
(``towers.inference.held_out_test``).
The model is built from the checkpoint, and the test split found, by
``towers.inference`` (what ``towers.load`` gives in Python).  ``--predict
OUT.npz`` also writes the test data's logits, probabilities, predicted
classes, class names and labels, atomically (``towers.files``); test
data without labels (``towers.data.loading.labelled``: a folder of images
without class folders, an npz without its labels' key, a TFRecord without a
label feature) is predicted without an evaluation, its images' paths below
the folder beside (``files``).  ``--watch`` evaluates each new
checkpoint as it appears until interrupted.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy

from towers.cli import Parser, run_main, show_notices, sigterm_raises, warn_about
from towers.errors import UserError
from towers.data.image.load import describe_classes
from towers.devices.placement import resolve
from towers.inference import Predictor, TestSets
from towers.nn.loss import softmax
from towers.files import check_new_output, write_npz, write_new_output
from towers.output.checkpoint import newest_readable, read_checkpoint


MAX_INTERVAL = 86400  # seconds between --watch polls; a longer wait is a typo, not a schedule


NAME = "towers.eval"  # in its error lines (docs/errors.md's)


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
    ap.add_argument("--predict", metavar="OUT.npz",
                    help="also write the test data's logits, probabilities, predicted classes, class names and "
                         "labels to this new .npz (arrays logits, probabilities, predicted, classes, labels); test "
                         "data without labels (a folder of images, flat or in class folders, an npz with x only, "
                         "a TFRecord without labels) is predicted only, with its images' paths (files)")
    ap.add_argument("--watch", action="store_true", help="evaluate each new checkpoint in --logdir until interrupted")
    ap.add_argument("--interval", type=float, default=10.0, metavar="SEC",
                    help=f"seconds between polls with --watch (0 < SEC <= {MAX_INTERVAL})")
    ap.add_argument("--max-evals", type=int, default=0, help=argparse.SUPPRESS)  # tests: stop after N
    return ap


class Evaluator:
    """Evaluates checkpoints on one device, loading each distinct test set once (``towers.inference``)."""

    def __init__(self, args):
        self.args = args
        self.device = resolve(1, None, soft=True).towers[0]  # a GPU when there is one
        self.test_sets = TestSets(loaded=lambda ds: warn_about(ds, NAME))

    def close(self) -> None:
        """Stop the worker processes of TFRecord and image test sets."""
        self.test_sets.close()

    def predictor(self, path: str, arrays: dict) -> Predictor:
        """The checkpoint's model on this device, its test data the flags' (else the checkpoint's)."""
        a = self.args
        test = dict(data=a.data, test_data=a.test_data, x_key=a.x_key, y_key=a.y_key, decode=a.decode)
        return Predictor(path, arrays, device=self.device, test=test, test_sets=self.test_sets, purpose="evaluated")

    def evaluate(self, path: str, arrays: dict) -> str:
        """The line that reports the checkpoint's loss and accuracy (and, with ``--predict``, the file written)."""
        with self.predictor(path, arrays) as p:  # its BLAS threads given back after (the test sets stay)
            return self._evaluate(path, p)

    def _evaluate(self, path: str, p: Predictor) -> str:
        weights = "EMA" if self.args.ema else "raw"
        if self.args.predict is not None and not p.test_labelled():
            return self.write_unlabelled(p, weights)
        result = p.evaluate(ema=self.args.ema)
        classes = f"; classes {describe_classes(p.classes)}" if p.classes else ""
        n = len(p.test_data().y)
        line = (f"{os.path.basename(path)} (step {p.step}): loss = {result['loss']:.4f}, accuracy = "
                f"{result['accuracy']:.4f} on {n} test examples ({weights} weights){classes}")
        if self.args.predict is not None:
            self.write_predictions(p)
            line += (f"\nwrote {self.args.predict}: logits and predicted classes of the {n} test examples "
                     f"({weights} weights)")
        return line

    def write_predictions(self, p: Predictor, logits=None, **more) -> None:
        """``--predict OUT``: the test data's ``logits`` (float32, examples x classes), ``probabilities`` (their
        softmax), ``predicted`` (their argmax: the predicted class), ``classes`` (the class names, label k at k:
        an image folder's, else the numbers) and ``labels`` (int64; data without labels: ``more``'s arrays
        instead, ``files``), written atomically (no partial file, ever)."""
        if logits is None:
            logits = p.predict(ema=self.args.ema)
            more = {"labels": numpy.asarray(p.test_data().y, dtype=numpy.int64)}
        names = p.classes or [str(k) for k in range(p.num_classes)]
        arrays = {"logits": logits, "probabilities": softmax(logits),
                  "predicted": logits.argmax(axis=1).astype(numpy.int64), "classes": numpy.array(names), **more}
        write_new_output(self.args.predict, lambda f: write_npz(f, arrays.items()), "--predict")

    def write_unlabelled(self, p: Predictor, weights: str) -> str:
        """``--predict`` of test data without labels: the predictions alone (``files``: a folder's image paths
        below it), and the line that says so."""
        logits, files = p.predict_unlabelled(ema=self.args.ema)
        self.write_predictions(p, logits, **({} if files is None else {"files": numpy.array(files)}))
        return (f"{os.path.basename(p.path)} (step {p.step}): wrote {self.args.predict}: predicted classes and "
                f"probabilities of {len(logits)} unlabelled examples ({weights} weights)")


def _warn(line: str) -> None:
    print(f"towers.eval: {line}", file=sys.stderr, flush=True)  # (a skipped checkpoint: not a "warning:" line)


def _newest(logdir: str, warn):
    return newest_readable(logdir, warn, "evaluate", lambda newest: f"--checkpoint {newest} shows why it fails")


def run(args) -> None:
    ev = Evaluator(args)
    try:
        _run(args, ev)
    finally:
        ev.close()


def _run(args, ev: "Evaluator") -> None:
    if args.predict is not None:
        if args.watch:
            raise UserError("--predict writes one file, of one checkpoint: not with --watch")
        check_new_output(args.predict, "towers.eval", "--predict")  # before any work
    if args.checkpoint:
        if args.watch:
            raise UserError("--watch needs --logdir (it waits for new checkpoints there), not --checkpoint")
        arrays = read_checkpoint(args.checkpoint)  # a run's final.npz too
        print(ev.evaluate(args.checkpoint, arrays), flush=True)
        return
    if not os.path.isdir(args.logdir):
        raise UserError(f"--logdir {args.logdir} is not a directory: give the --logdir of a training run")
    if not args.watch:
        found = _newest(args.logdir, _warn)
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
        found = _newest(args.logdir, warn_once)
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
            with sigterm_raises():  # SIGTERM (a service manager's stop) is one line and status 143, as in training
                run(args)
        except KeyboardInterrupt:  # the way --watch ends
            if not args.watch:
                raise
            print(f"{NAME}: stopped", file=sys.stderr)

    return run_main(NAME, body, terminated="terminated (SIGTERM): stopped watching" if args.watch else None)


if __name__ == "__main__":
    sys.exit(main(prog="python -m towers.eval"))
