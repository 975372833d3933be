"""Loading a dataset from files: npz (``towers.data.dataset``) or TFRecord (``towers.data.tfrecord``).

The one entry point, ``load_dataset``, picks the reader by the path: TFRecord
files and globs of shards keep their examples on disk behind a record index;
npz members are read or memory-mapped.  Either way the result is a validated
``Dataset``.
"""
from __future__ import annotations

import sys

from towers.data.dataset import Dataset, load_npz, npz_has
from towers.data.tfrecord.records import is_tfrecord, load_split
from towers.errors import UserError, render


def _say(message):
    print(render(message), file=sys.stderr, flush=True)


def load_dataset(path, x_key="x", y_key="y", test_path=None, decode=None, on_error="stop", workers=2):
    """Load and validate training (and test) data: npz files, TFRecord files or globs of shards.

    Every problem is a UserError.  A ``test_path`` file's own ``x_test``/``y_test``
    come first, then its training keys.  ``decode``, ``on_error`` and
    ``workers`` are for TFRecord data (``towers.data.tfrecord.records``).
    """
    if not (is_tfrecord(path) or is_tfrecord(test_path)):
        if decode:
            raise UserError("`decode` applies to TFRecord data; the npz arrays are used as stored")
        return load_npz(path, x_key, y_key, test_path)
    options = dict(x_key=x_key, y_key=y_key, decode=decode, on_error=on_error, workers=workers, say=_say)
    if is_tfrecord(path):
        x, y = load_split(path, **options)
    else:
        train = load_npz(path, x_key, y_key)
        x, y = train.x, train.y
    tx = ty = None
    if test_path is not None and is_tfrecord(test_path):
        tx, ty = load_split(test_path, **options)
    elif test_path is not None:
        keys = ("x_test", "y_test") if npz_has(test_path, "x_test", "y_test") else (x_key, y_key)
        test = load_npz(test_path, *keys)  # its own test split first, then its training keys
        tx, ty = test.x, test.y
    num_classes = int(y.max()) + 1
    if tx is not None:
        if tuple(tx.shape[1:]) != tuple(x.shape[1:]):
            raise UserError(f"{test_path}: test examples have shape {tuple(tx.shape[1:])} but training examples "
                            f"{tuple(x.shape[1:])}")
        if len(ty) and int(ty.max()) >= num_classes:
            raise UserError(f"{test_path}: test label {int(ty.max())} is out of range: training labels are "
                            f"0..{num_classes - 1}")
    return Dataset(x, y, num_classes, tx, ty)
