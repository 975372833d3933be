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
validated ``Dataset``.

Notices while loading (an index being built, damaged records skipped) go to
the ``towers`` logger, which the command lines print.  The TFRecord and image
readers (and protobuf behind them) are imported when a path needs them, so
``import towers`` and npz data never load them.
"""
from __future__ import annotations

from towers.data.dataset import Dataset, check_test_split, load_npz, npz_has
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
    images = (bool(decode) and parse_image_decode(decode) is not None) or is_image_folder(path) or \
        is_image_folder(test_path) or augment != "none" or normalize is not None or image_size is not None
    if images:
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


def _load(path, x_key, y_key, test_path, decode, on_error, workers):
    """Stored examples (no image transforms): npz arrays or TFRecord features."""
    if not (is_tfrecord(path) or is_tfrecord(test_path)):
        if decode:
            raise UserError("`decode` applies to TFRecord data; the npz arrays are used as stored")
        return load_npz(path, x_key, y_key, test_path)
    from towers.data.tfrecord.records import load_split

    options = dict(x_key=x_key, y_key=y_key, decode=decode, on_error=on_error, workers=workers, say=notice)
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
        check_test_split(x, tx, f"{test_path}: ", "x_test")
        if tuple(tx.shape[1:]) != tuple(x.shape[1:]):
            raise UserError(f"{test_path}: test examples have shape {tuple(tx.shape[1:])} but training examples "
                            f"{tuple(x.shape[1:])}")
        if len(ty) and int(ty.max()) >= num_classes:
            raise UserError(f"{test_path}: test label {int(ty.max())} is out of range: training labels are "
                            f"0..{num_classes - 1}")
    return Dataset(x, y, num_classes, tx, ty)
