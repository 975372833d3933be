"""Datasets: examples and labels in host memory, validated once, from a file or from arrays.

``Dataset.from_arrays(x, y, x_test=None, y_test=None)`` checks what training
needs (integer labels 0..C-1, examples as uint8 pixels or floats, matching
lengths and shapes, test labels within the training classes) and every loader
goes through it, so in-memory arrays and files are held to the same rules.
Every problem is a ``UserError`` naming the array (or the file and key).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy

from towers.errors import UserError


@dataclass
class Dataset:
    x: numpy.ndarray  # (N, ...) uint8 or float32
    y: numpy.ndarray  # (N,) int32
    num_classes: int
    x_test: numpy.ndarray | None = None
    y_test: numpy.ndarray | None = None

    @property
    def example_shape(self) -> tuple:
        return tuple(self.x.shape[1:])

    @classmethod
    def from_arrays(cls, x, y, x_test=None, y_test=None, names=("x", "y", "x_test", "y_test"),
                    where: str = "Dataset.from_arrays") -> "Dataset":
        """A validated dataset from host arrays (uint8 or float examples, integer labels)."""
        if (x_test is None) != (y_test is None):
            raise UserError(f"{where}: give both {names[2]} and {names[3]}, or neither")
        x, y = _pair(numpy.asarray(x), numpy.asarray(y), where, names[0], names[1])
        if len(x) == 0:
            raise UserError(f"{where}: the dataset is empty ({names[0]!r} has 0 examples)")
        num_classes = int(y.max()) + 1
        if x_test is not None:
            x_test, y_test = _pair(numpy.asarray(x_test), numpy.asarray(y_test), where, names[2], names[3])
            if x_test.shape[1:] != x.shape[1:]:
                raise UserError(
                    f"{where}: test examples have shape {x_test.shape[1:]} but training examples {x.shape[1:]}"
                )
            if len(y_test) and int(y_test.max()) >= num_classes:
                raise UserError(
                    f"{where}: test label {int(y_test.max())} is out of range: "
                    f"training labels are 0..{num_classes - 1}"
                )
        return cls(x, y, num_classes, x_test, y_test)


def _labels(y: numpy.ndarray, where: str, key: str) -> numpy.ndarray:
    if y.ndim != 1 or not numpy.issubdtype(y.dtype, numpy.integer):
        raise UserError(
            f"{where}: key {key!r} must be 1-D integer labels, got {y.dtype} {y.shape}"
        )
    if y.size and y.min() < 0:
        raise UserError(f"{where}: key {key!r} has a negative label ({int(y.min())}); labels are 0..C-1")
    return y.astype(numpy.int32)


def _images(x: numpy.ndarray, where: str, key: str) -> numpy.ndarray:
    if x.dtype == numpy.uint8:
        return x
    if numpy.issubdtype(x.dtype, numpy.floating):
        return x.astype(numpy.float32, copy=False)
    raise UserError(f"{where}: key {key!r} is {x.dtype}; give uint8 pixels or float32 features")


def _load_npz(path: str):
    if not os.path.exists(path):
        raise UserError(f"data file {path} does not exist: set `data` to an .npz file")
    try:
        return numpy.load(path, allow_pickle=False)
    except Exception as e:
        raise UserError(f"cannot read {path} as .npz ({e.__class__.__name__}: {e})") from None


def _member(npz, path: str, key: str):
    if key not in npz.files:
        raise UserError(
            f"{path} has no key {key!r} (keys: {', '.join(npz.files) or 'none'}); "
            "use `x_key`/`y_key` to pick others"
        )
    return npz[key]


def _pair(x, y, where: str, xk: str, yk: str):
    x, y = _images(x, where, xk), _labels(y, where, yk)
    if x.ndim < 2:
        raise UserError(f"{where}: key {xk!r} has shape {x.shape}; expected (N, features...)")
    if len(x) != len(y):
        raise UserError(f"{where}: {xk!r} has {len(x)} examples but {yk!r} has {len(y)} labels")
    return x, y


def load_dataset(path: str, x_key: str = "x", y_key: str = "y", test_path: str | None = None,
                 **tfrecord) -> Dataset:
    """Load and validate training (and test) data from .npz files; every problem is a UserError.

    TFRecord files and globs of shards go to ``towers.data.tfrecord.records``
    (``tfrecord``: its ``decode``, ``on_error`` and ``workers``).
    """
    from towers.data.tfrecord.records import load_if_tfrecord

    found = load_if_tfrecord(path, x_key, y_key, test_path, **tfrecord)
    if found is not None:
        return found
    npz = _load_npz(path)
    x, y = _member(npz, path, x_key), _member(npz, path, y_key)
    tx = ty = None
    tkx, tky = "x_test", "y_test"
    if test_path is not None:
        tnpz = _load_npz(test_path)
        # A test file's own test split comes first, then its training keys.
        tkx = "x_test" if "x_test" in tnpz.files and "y_test" in tnpz.files else x_key
        tky = "y_test" if tkx == "x_test" else y_key
        tx, ty = _member(tnpz, test_path, tkx), _member(tnpz, test_path, tky)
    elif "x_test" in npz.files and "y_test" in npz.files:
        tx, ty = npz["x_test"], npz["y_test"]
    return Dataset.from_arrays(x, y, tx, ty, names=(x_key, y_key, tkx, tky), where=path)
