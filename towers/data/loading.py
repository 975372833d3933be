"""The loader: a data set's description (``towers.data.pipeline.DataSpec``) run into a validated ``Dataset``.

``load_dataset`` takes a description, or builds one from a path and the
named settings (``describe``), and runs it.  The data path has three parts:

1. **sources** give random access to examples by row: npz members (read or
   memory-mapped), TFRecord records behind a record index, image files of a
   folder (``towers.data.sources``);
2. **per-example operations** (the description's ``ops``: decode, augment,
   normalize), run in the input workers or the input thread
   (``towers.data.image.load`` decides, with the decoded-image cache);
3. **batches** (``towers.data.batches``) draw global batches from the examples.

A description without operations gives the stored examples: npz arrays in
memory, or TFRecord features read on demand (``towers.data.tfrecord.records``).
With operations, ``towers.data.image.load`` makes them.  Either way the
examples made on demand are one kind of array (``towers.data.examples``).
``load_test_data`` reads a test split alone, for a model a checkpoint
describes (``towers.eval``): no training data is read; ``load_unlabelled``
reads data without labels to predict (``labelled`` tells the two apart).

Notices while loading (an index being built, damaged records skipped) go to
the ``towers`` logger, which the command lines print.  The TFRecord and image
readers (and protobuf behind them) are imported when a path needs them, so
``import towers`` and npz data never load them.
"""
from __future__ import annotations

import os
from dataclasses import replace

import numpy

from towers.data.dataset import (Dataset, OnDemand, TestSet, check_test_split, load_npz, match_test_labels, npz_has,
                                 npz_has_test, read_npz_examples, test_label_warnings)
from towers.data.inputs import is_tfrecord
from towers.data.kinds import Npz, kind_of
from towers.data.pipeline import DataSpec, describe
from towers.data.tfrecord.schema import UsageError
from towers.errors import UserError, notice


def load_dataset(data, *where, workers=2, cache_mib=None, progress=False, seed=0, **settings) -> Dataset:
    """Load and validate the training (and test) data ``data`` describes: a ``DataSpec``, or a path (npz,
    TFRecord file or glob of shards, image folder) that ``towers.data.pipeline.describe`` turns into one with
    ``where`` (``x_key``, ``y_key``, ``test_path``) and the named ``settings`` (``decode``, ``on_error``,
    ``augment``, ``normalize``, ``image_size``, ``seed``).

    How it runs: ``workers`` input worker processes (0: the input thread),
    ``cache_mib`` the budget of the decoded-image cache
    (``towers.data.image.cache``; None or 0: decode every epoch) and
    ``progress`` shows its decoding as a progress bar; ``seed`` draws ``synthetic`` data (its
    ``Augment`` op's seed otherwise).  Every problem is a UserError.  A ``test_path`` file's own ``x_test``/``y_test`` come first,
    then its training keys.
    """
    if isinstance(data, DataSpec):
        if where or settings:
            raise TypeError("load_dataset: a DataSpec already holds its keys and settings")
        spec = data
    else:
        spec = describe(data, *where, seed=seed, **settings)
    kind = kind_of(spec.path)
    if kind.whole:  # made, not read (``synthetic``)
        return kind.dataset(spec, seed)
    if spec.ops:
        from towers.data.image.load import load_images

        return load_images(spec, workers, cache_mib, progress, say=notice)
    try:
        return _load(spec, workers)
    except UsageError as e:
        records = spec.path if is_tfrecord(spec.path) else spec.test_path if is_tfrecord(spec.test_path) else None
        if spec.stored or records is None:
            raise
        from towers.data.image.load import propose

        hint = propose(records)
        if hint is None:
            raise
        raise UsageError(f"{e}; these records hold encoded images: train from them with {hint}") from None


def _load(spec: DataSpec, workers):
    """Stored examples (no per-example operations), each split as its kind (``towers.data.kinds``) stores it."""
    path, test_path = spec.path, spec.test_path
    kind, test_kind = kind_of(path), None if test_path is None else kind_of(test_path)
    if isinstance(kind, Npz) and isinstance(test_kind, (Npz, type(None))):
        _decode_applies(spec.stored, path, test_path)
        return load_npz(path, spec.x_key, spec.y_key, test_path)  # an npz's own test split, checked as its own
    x, y = kind.stored(spec, path, workers, notice)
    tx = ty = None
    if test_path is not None:
        tx, ty = test_kind.stored(spec.split(test_path), test_path, workers, notice, test=True)
    num_classes = int(y.max()) + 1
    check_test_split(tx, ty, f"{test_path}: ", "x_test", x.dtype, x.shape[1:], num_classes)
    return Dataset(x, y, num_classes, tx, ty)


def _decode_applies(decode, *paths) -> None:
    """`decode` reads TFRecord features: with none of ``paths`` a TFRecord file, it is a mistake."""
    if decode and not any(is_tfrecord(p) for p in paths):
        raise UserError("`decode` applies to TFRecord data; the npz arrays are used as stored")


def load_test_data(spec: DataSpec, example_shape, num_classes, class_names=None, dtype=None, workers=0,
                   own=False) -> TestSet:
    """The test examples of ``spec.path`` alone, labelled in the classes of a trained model, without its
    training data: what ``towers.eval`` evaluates a checkpoint on.

    The training data is described by what a checkpoint records: its ``example_shape``, ``num_classes``,
    ``class_names`` (an image folder's, label k at k; None: numbered labels) and the ``dtype`` its examples
    are stored as (None: not recorded).  The test split is read as `test_data` is (an npz's own
    ``x_test``/``y_test`` first, then its training keys; ``own``: ``spec.path`` is a `data` file whose own
    test split is wanted), made by the description's operations on their deterministic path (a model
    trained from images: ``DataSpec.as_images``), checked as a training run checks its test split
    (``check_test_split``) and its labels matched to the training classes by name (``match_test_labels``):
    a test folder without one of the classes keeps every other label's meaning.
    """
    path = spec.path
    if kind_of(path).whole:
        raise UserError(f"{path} has no test split: give test data (`test_data`)")
    if own and not isinstance(kind_of(path), Npz):
        raise UserError(f"{path} has no x_test/y_test: give test data (`test_data`), or data with x_test/y_test")
    if spec.ops:
        from towers.data.image.load import load_image_test

        x, y, test_classes = load_image_test(spec, example_shape, workers, own, say=notice)
        dtype = None  # the transform makes the test examples as it made the training examples
    else:
        _decode_applies(spec.stored, path)
        (x, y), test_classes = kind_of(path).stored(spec, path, workers, notice, test=True, own=own), None
    try:
        y = match_test_labels(class_names, test_classes, y, path, num_classes)
        check_test_split(x, y, f"{path}: ", "x_test", dtype, example_shape, num_classes)
    except BaseException:
        if isinstance(x, OnDemand):
            x.close()
        raise
    return TestSet(x, y, test_label_warnings(y))


def labelled(spec: DataSpec) -> bool:
    """Whether the data at ``spec.path`` has labels: an image folder's class folders (a folder with images
    of its own, beside folders or not, has none), an npz's ``x_test``/``y_test`` or ``y_key``, a TFRecord's
    label feature (``towers.data.tfrecord.records.label_feature``); data a kind makes whole (``synthetic``)
    has labels (and no test split: ``load_test_data`` says so)."""
    path = spec.path
    if kind_of(path).whole:
        return True
    if os.path.isdir(path):
        from towers.data.image.folder import has_loose_images

        return kind_of(path).encoded and not has_loose_images(path)  # class folders, and only them
    if is_tfrecord(path):
        from towers.data.tfrecord.records import label_feature

        x_key = spec.image_feature or spec.x_key
        return label_feature(path, x_key, spec.y_key, spec.on_error, notice) is not None
    return npz_has_test(path) or npz_has(path, spec.y_key)


def load_unlabelled(spec: DataSpec, example_shape, workers=0):
    """(examples, their file names or None) of the data at ``spec.path`` read without labels, to predict, as
    a trained model of ``example_shape`` takes them: every image below a folder (flat, or in class folders;
    their paths below it are the names), an npz's ``x_key``, a TFRecord's examples (or its encoded images).
    A description with operations (a model trained from images) makes the examples by them
    (``towers.data.image.load.made_as_trained``), else they are the stored ones, which the caller checks
    against the model's.  Each row is its own example: an image or record that cannot be made stops the
    prediction, whatever ``spec.on_error`` says (``skip`` would put another example's logits on its row)."""
    spec = replace(spec, on_error="stop")
    path = spec.path
    names = None
    if os.path.isdir(path):
        from towers.data.image.folder import image_files
        from towers.data.kinds import Split
        from towers.data.sources import FileSource

        files = image_files(path)  # (a folder without images: one line naming it)
        if not spec.ops:  # (``describe`` gives a folder of images an ``Images`` op: a description made by hand)
            raise UserError(f"{path} is a folder of images: its description needs an `Images` op to read them")
        names = [os.path.relpath(f, path) for f in files]
        split = Split(FileSource(files), numpy.zeros(len(files), numpy.int32))
    elif is_tfrecord(path):
        from towers.data.kinds import Split
        from towers.data.tfrecord.records import encoded_images, load_split

        if spec.image_feature is not None:
            split = Split(*encoded_images(path, spec.x_key, None, spec.image_feature, spec.on_error, notice))
        else:
            x, y = load_split(path, spec.x_key, None, spec.stored, spec.on_error, workers, say=notice)
            if not spec.ops:
                return x, None
            from towers.data.kinds import image_arrays

            split = image_arrays(x[:], y, str(path))
    else:
        x = read_npz_examples(path, spec.x_key)
        if not spec.ops:
            return x, None
        from towers.data.kinds import image_arrays

        split = image_arrays(x, numpy.zeros(len(x), numpy.int32), str(path))
    from towers.data.image.load import made_as_trained

    return made_as_trained(spec, split, example_shape, path, workers, notice), names
