"""Loading a dataset from files: npz (``towers.data.dataset``), TFRecord (``towers.data.tfrecord``) or images.

The one entry point, ``load_dataset``, picks the reader by the path and the
settings.  The data path has three stages:

1. **sources** give random access to examples by row: npz members (read or
   memory-mapped), TFRecord records behind a record index, image files of a
   folder (``towers.data.sources``);
2. **per-example transforms** (decoding, augmentation, ``towers.data.image``)
   run in the input workers;
3. **batches** (``towers.data.batches``) draw global batches from the examples.

Without image settings (``decode`` NAME:image:H,W,C, an image folder,
``augment``, ``normalize``, ``image_size``) there are no transforms and the
examples are the stored arrays, as before.  Either way the result is a
validated ``Dataset``.  ``load_test_data`` reads a test split alone, for a
model a checkpoint describes (``towers.eval``): no training data is read.

Notices while loading (an index being built, damaged records skipped) go to
the ``towers`` logger, which the command lines print.  The TFRecord and image
readers (and protobuf behind them) are imported when a path needs them, so
``import towers`` and npz data never load them.
"""
from __future__ import annotations

from towers.data.dataset import (Dataset, OnDemand, TestSet, check_test_split, load_npz, match_test_labels,
                                 read_npz_pair, test_keys, test_label_warnings)
from towers.data.image.folder import is_image_folder
from towers.data.inputs import is_tfrecord
from towers.data.tfrecord.schema import UsageError, parse_image_decode
from towers.errors import UserError, notice


def load_dataset(path, x_key="x", y_key="y", test_path=None, decode=None, on_error="stop", workers=2,
                 augment="none", normalize=None, image_size=None, seed=0, cache_mib=None, progress=False):
    """Load and validate training (and test) data: npz files, TFRecord files or globs of shards, image folders.

    Every problem is a UserError.  A ``test_path`` file's own ``x_test``/``y_test``
    come first, then its training keys.  ``decode``, ``on_error`` and
    ``workers`` are for TFRecord data (``towers.data.tfrecord.records``) and
    images; ``augment``, ``normalize``, ``image_size`` and ``seed`` (of the
    augmentation's draws) for images (``towers.data.image.load``); ``cache_mib`` is the budget of the
    decoded-image cache (``towers.data.image.cache``; None or 0: decode every epoch) and ``progress`` shows
    its decoding as a progress bar.
    """
    if uses_images(path, decode, augment, normalize, image_size) or is_image_folder(test_path):
        from towers.data.image.load import load_images

        return load_images(path, x_key, y_key, test_path, decode, on_error, workers, augment, normalize, image_size,
                           seed, say=notice, cache_mib=cache_mib, progress=progress)
    try:
        return _load(path, x_key, y_key, test_path, decode, on_error, workers)
    except UsageError as e:
        records = path if is_tfrecord(path) else test_path if is_tfrecord(test_path) else None
        if decode or records is None:
            raise
        from towers.data.image.load import propose

        hint = propose(records)
        if hint is None:
            raise
        raise UsageError(f"{e}; these records hold encoded images: train from them with {hint}") from None


def uses_images(path, decode=None, augment="none", normalize=None, image_size=None) -> bool:
    """Whether data goes through the image path (``towers.data.image``): an image folder, encoded images
    (``decode`` NAME:image:H,W,C), or an image setting."""
    return (bool(decode) and parse_image_decode(decode) is not None) or is_image_folder(path) or \
        augment != "none" or normalize is not None or image_size is not None


def _load(path, x_key, y_key, test_path, decode, on_error, workers):
    """Stored examples (no image transforms): npz arrays or TFRecord features."""
    if not (is_tfrecord(path) or is_tfrecord(test_path)):
        _decode_applies(decode, path, test_path)
        return load_npz(path, x_key, y_key, test_path)
    from towers.data.tfrecord.records import load_split

    options = dict(x_key=x_key, y_key=y_key, decode=decode, on_error=on_error, workers=workers, say=notice)
    if is_tfrecord(path):
        x, y = load_split(path, **options)
    else:
        train = load_npz(path, x_key, y_key)
        x, y = train.x, train.y
    tx = ty = None
    if test_path is not None:
        tx, ty = _test_split(test_path, x_key, y_key, options)
    num_classes = int(y.max()) + 1
    check_test_split(tx, ty, f"{test_path}: ", "x_test", x.dtype, x.shape[1:], num_classes)
    return Dataset(x, y, num_classes, tx, ty)


def _decode_applies(decode, *paths) -> None:
    """`decode` reads TFRecord features: with none of ``paths`` a TFRecord file, it is a mistake."""
    if decode and not any(is_tfrecord(p) for p in paths):
        raise UserError("`decode` applies to TFRecord data; the npz arrays are used as stored")


def _test_split(path, x_key, y_key, options, own=False):
    """Stored test examples and labels: TFRecord features, or an npz's own test split first, then its training
    keys (``own``: its test split only, ``test_keys``)."""
    if is_tfrecord(path):
        from towers.data.tfrecord.records import load_split

        return load_split(path, **options)
    what = ("data", "data") if own else ("test data", "test_data")
    return read_npz_pair(path, *test_keys(path, x_key, y_key, own, *what), *what)


def load_test_data(path, example_shape, num_classes, class_names=None, dtype=None, x_key="x", y_key="y",
                   decode=None, on_error="stop", workers=0, augment="none", normalize=None, image_size=None, seed=0,
                   own=False, images=False) -> TestSet:
    """The test examples of ``path`` alone, labelled in the classes of a trained model, without its training
    data: what ``towers.eval`` evaluates a checkpoint on.

    The training data is described by what a checkpoint records: its ``example_shape``, ``num_classes``,
    ``class_names`` (an image folder's, label k at k; None: numbered labels) and the ``dtype`` its examples
    are stored as (None: not recorded).  The test split is read as `test_data` is (an npz's own
    ``x_test``/``y_test`` first, then its training keys; ``own``: ``path`` is a `data` file whose own test
    split is wanted), made with the image settings on the deterministic path (``images``: the training data
    went through the image path, ``uses_images``, so the test split does too), checked as a training run
    checks its test split (``check_test_split``) and its labels matched to the training classes by name
    (``match_test_labels``): a test folder without one of the classes keeps every other label's meaning.
    """
    images = images or uses_images(path, decode, augment, normalize, image_size)
    if own and (is_image_folder(path) or is_tfrecord(path)):
        raise UserError(f"{path} has no x_test/y_test: give test data (`test_data`), or data with x_test/y_test")
    if images:
        from towers.data.image.load import load_image_test

        x, y, test_classes = load_image_test(path, example_shape, x_key, y_key, decode, on_error, workers, augment,
                                             normalize, image_size, seed, own, say=notice)
        dtype = None  # the transform makes the test examples as it made the training examples
    else:
        _decode_applies(decode, path)
        options = dict(x_key=x_key, y_key=y_key, decode=decode, on_error=on_error, workers=workers, say=notice)
        (x, y), test_classes = _test_split(path, x_key, y_key, options, own), None
    try:
        y = match_test_labels(class_names, test_classes, y, path, num_classes)
        check_test_split(x, y, f"{path}: ", "x_test", dtype, example_shape, num_classes)
    except BaseException:
        if isinstance(x, OnDemand):
            x.close()
        raise
    return TestSet(x, y, test_label_warnings(y))
