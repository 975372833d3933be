"""Image data sets: a source per split, one transform, one worker pool, as a validated ``Dataset``.

``load_images`` is what ``towers.data.loading.load_dataset`` calls when the
data holds images to decode or to augment:

============================  ================================================================
split given as                source (``towers.data.sources``)
============================  ================================================================
a folder ``DIR/<class>/*``    ``FileSource`` (``towers.data.image.folder``), labels by sorted
                              class name, the class names kept
TFRecord + ``decode``         ``RecordSource``: the ``NAME:image:H,W,C`` bytes feature of
``NAME:image:H,W,C``          each record, labels from ``y_key`` (int64, one a record)
an npz, or raw TFRecord       ``ArraySource`` over its uint8 (N, H, W[, C]) examples, to augment
============================  ================================================================

The example shape is ``decode``'s, else ``image_size``, else (folders) the
images' own when they all agree, else (arrays) the stored one.  The training
split is augmented (``augment``), the test split takes the deterministic path,
and both share the ``Workers`` (``towers.data.workers``).  With ``cache_mib``, an
encoded training split whose decoded pixels fit the budget, and the memory the
process may take, is decoded once (``towers.data.image.cache``) and its array
reads them from memory; else, or when its memory cannot be had after all, it
streams after a notice.  Training and
test labels mean the same classes or the data is refused: a test folder's
classes match the training folder's by name, and class folders named by
numbers (``0`` .. ``C-1``) match numbered labels (npz, TFRecord).

:func:`propose` looks at a TFRecord file's first record for an encoded image
(the TensorFlow ImageNet layout: ``image/encoded``, ``image/class/label``) and
returns the settings that train from it.
"""
from __future__ import annotations

import numpy as np

from towers.data.dataset import Dataset, check_test_split, load_npz, match_test_labels, read_npz_pair, test_keys
from towers.data.image import cache, codec, folder
from towers.data.image.array import ImageArray
from towers.data.image.augment import Transform, parse_image_size
from towers.data.sources import ArraySource, FileSource, RecordSource
from towers.data.workers import Workers
from towers.data.tfrecord.framing import TFRecordError, TFRecordReader
from towers.data.tfrecord.proto import KIND_BYTES, SequenceExample
from towers.data.inputs import expand_inputs, is_tfrecord
from towers.data.tfrecord.records import _choose, index_split, load_split
from towers.data.tfrecord.schema import UsageError, parse_image_decode
from towers.errors import UserError


class _Split:
    """One split before it becomes an array: its source, labels, class names and example size."""

    def __init__(self, source, labels, classes=None, size=None):
        self.source, self.labels, self.classes, self.size = source, labels, classes, size
        self.test = None  # an npz's own x_test/y_test


def _folder(path, setting):
    classes, paths, labels = folder.scan(path, setting)
    return _Split(FileSource(paths), labels, classes)


def _records(path, x_key, y_key, feature, on_error, say):
    """The encoded-image feature ``feature`` and the labels ``y_key`` of the TFRecord file or glob ``path``."""
    indexes, n, columns = index_split(path, on_error, say)
    if x_key not in ("x", feature):
        raise UsageError(f"`decode` names {feature!r} but `x_key` is {x_key!r}: drop `x_key`, or make them agree")
    column = columns.get(feature)
    if column is None or column.kind != KIND_BYTES or column.is_list or column.present_count != n \
            or column.min_count != 1 or column.max_count != 1:
        what = "no such feature" if column is None else column.describe(n)
        raise UsageError(f"{path}: `decode` {feature}:image needs one encoded image (bytes) in every record, but "
                         f"{feature!r} is {what}; the features: " + "; ".join(
                             f"{k} ({c.describe(n)})" for k, c in sorted(columns.items())))
    labels = [k for k in columns if all(k in i.scalars for i in indexes) and k != feature]
    yname = _choose(path, columns, n, y_key, "y", labels, "labels", "y_key")
    if not all(yname in i.scalars for i in indexes):
        raise UsageError(f"{path}: feature {yname!r} ({columns[yname].describe(n)}) cannot be labels: "
                         "labels are one int64 per record")
    y = np.concatenate([i.scalars[yname] for i in indexes])
    if y.min() < 0 or y.max() > np.iinfo(np.int32).max:
        raise UsageError(f"{path}: labels in {yname!r} run from {int(y.min())} to {int(y.max())}; labels are 0..C-1")
    positions = [np.concatenate([np.full(len(i.offsets), k, np.int64) for k, i in enumerate(indexes)])]
    positions += [np.concatenate([getattr(i, a) for i in indexes]) for a in ("offsets", "lengths", "numbers", "crcs")]
    return _Split(RecordSource([i.path for i in indexes], feature, *positions), y.astype(np.int32))


def _arrays(x, y, name):
    """Stored uint8 images (N, H, W) or (N, H, W, C) to augment."""
    if x.dtype != np.uint8 or x.ndim not in (3, 4) or (x.ndim == 4 and x.shape[3] not in (1, 3)):
        raise UserError(f"{name}: `augment` and `normalize` work on uint8 images (N, H, W) or (N, H, W, 1 or 3), "
                        f"got {x.dtype} {tuple(x.shape[1:])} per example")
    if x.ndim == 3:
        x = x.reshape(x.shape + (1,))
    return _Split(ArraySource(x, name), np.asarray(y, np.int32), size=tuple(x.shape[1:]))


def _split(path, x_key, y_key, spec, on_error, say, setting, test=False, own=False):
    if folder.is_image_folder(path):
        return _folder(path, setting)
    if is_tfrecord(path):
        if spec is not None:
            return _records(path, x_key, y_key, spec[0], on_error, say)
        x, y = load_split(path, x_key, y_key, None, on_error, workers=0, say=say)
        return _arrays(x, y, str(path))
    if spec is not None:
        raise UserError(f"`decode` {spec[0]}:image reads TFRecord files; `{setting}` {path} is not one")
    if test:  # its own test split first, then its training keys (`own`: its test split only)
        what = ("data", "data") if own else ("test data", "test_data")
        return _arrays(*read_npz_pair(path, *test_keys(path, x_key, y_key, own, *what), *what), str(path))
    ds = load_npz(path, x_key, y_key)
    train = _arrays(ds.x, ds.y, str(path))
    train.test = None if ds.x_test is None else _arrays(ds.x_test, ds.y_test, f"{path} (x_test)")
    return train


def _size(train, spec, image_size):
    if spec is not None:
        if image_size is not None and parse_image_size(image_size) != spec[1]:
            raise UserError(f"`image_size` {image_size} and `decode` {':'.join(map(str, spec[1]))} disagree: "
                            "`decode` gives the shape; drop `image_size`")
        return spec[1]
    if image_size is not None:
        return parse_image_size(image_size)
    if train.size is not None:
        return train.size
    return folder.common_size(train.source.paths)


def _cache(train, size, augment, normalize, seed, pool):
    """The cache of ``train`` (empty), the transform that reads it (None: a gather), the pool that serves it,
    and the decode stage with its id in ``pool`` (registered before the pool starts).

    A crop and flip (``cifar``) of cached pixels is cheaper than sending the pixels to a worker: in the input
    thread (``Workers(0)``) 148,000-152,000 32x32 images/s against 92,000-118,000 with 1 or 2 workers
    (2 cores); the float work of ``tf-cifar10`` or ``normalize`` goes to the workers (26,000 in the thread,
    41,000-44,000 with 2).
    """
    cached = cache.CachedSource(np.zeros((len(train.source),) + tuple(size), np.uint8), "decoded images")
    decode = Transform(size, "none", None, seed, True)
    light = augment in ("none", "cifar") and normalize is None
    transform = None if augment == "none" and normalize is None else Transform(size, augment, normalize, seed, False)
    return cached, transform, Workers(0) if light else pool, decode, pool.add(train.source, decode)


def load_images(path, x_key="x", y_key="y", test_path=None, decode=None, on_error="stop", workers=2,
                augment="none", normalize=None, image_size=None, seed=0, say=None, cache_mib=None,
                progress=False) -> Dataset:
    """A ``Dataset`` of ``ImageArray`` examples (see the module docstring); every problem is a UserError.

    ``cache_mib``: the decoded-image cache's budget in MiB (``towers.data.image.cache``; None or 0: off);
    ``progress``: show its decoding as a progress bar.
    """
    spec = parse_image_decode(decode) if decode else None
    if decode and spec is None:
        raise UserError(f"`decode` {decode} reads raw bytes; with an image folder, `augment` or `normalize` give "
                        "encoded images as NAME:image:H,W,C, or convert the data first")
    train = _split(path, x_key, y_key, spec, on_error, say, "data")
    test = train.test
    if test_path is not None:
        test = _split(test_path, x_key, y_key, spec, on_error, say, "test_data", test=True)
    size = _size(train, spec, image_size)
    pool = Workers(workers)
    n_classes = len(train.classes) if train.classes else int(train.labels.max()) + 1
    transform = Transform(size, augment, normalize, seed, train.source.encoded)
    # Streamed (decoded every epoch); with a cache, still registered before the pool starts: the fallback of
    # a cache whose memory cannot be had.
    x = ImageArray(str(path), train.source, transform, train.labels, pool, on_error, say)
    fill = None
    need = cache.nbytes(len(train.source), size)
    streams = f"{path}: the {len(train.source)} decoded training images need {need / cache.MIB:.1f} MiB, "
    if cache_mib and cache.cacheable(train.source, augment):
        why = cache.not_cached(need, cache_mib, cache.memory_room(), cache.fill_bytes(len(train.source), size,
                                                                                   pool.n))
        if why is None:
            try:
                fill = _cache(train, size, augment, normalize, seed, pool)
            except MemoryError:  # limits that could not be read, or memory taken meanwhile: stream all the same
                why = cache.ALLOCATION_FAILED
        if why is not None and say:
            say(streams + why)
    if fill is not None:
        cached, cached_transform, served_by, decode, decode_sid = fill
        cached_x = ImageArray(str(path), cached, cached_transform, train.labels, served_by, on_error, say,
                              train.source)
    tx = ty = None
    if test is not None:
        ty = match_test_labels(train.classes, test.classes, test.labels, test_path, n_classes)
        check_test_split(None, ty, f"{test_path}: ", num_classes=n_classes)
        tx = ImageArray(str(test_path or path), test.source,
                        Transform(size, augment, normalize, seed, test.source.encoded), ty, pool, on_error, say)
    if fill is not None:
        try:
            cache.fill(cached, train.source, decode, pool, decode_sid, progress)
        except MemoryError:  # a batch of the fill could not be allocated: stream, the cache goes
            fill = cached = cached_x = None
            if say:
                say(streams + cache.ALLOCATION_FAILED)
        except BaseException:  # a worker died, Ctrl-C: no worker outlives the load
            pool.close()
            raise
    if fill is not None:
        x = cached_x
        if served_by is not pool and test is None:
            pool.close()  # it decoded the cache; nothing else reads through it
        if say:
            say(f"{path}: decoded-image cache: {len(cached)} images of {'x'.join(map(str, size))}, "
                f"{cached.array.nbytes / cache.MIB:.1f} MiB in memory, decoded once for every epoch")
    return Dataset(x, train.labels, n_classes, tx, ty, class_names=train.classes)


def load_image_test(path, example_shape, x_key="x", y_key="y", decode=None, on_error="stop", workers=0,
                    augment="none", normalize=None, image_size=None, seed=0, own=False, say=None):
    """(examples, labels, class names or None) of the test split ``path`` alone, made as a training run of
    ``example_shape`` makes its test split (the deterministic path of ``augment``, ``normalize``), for
    ``towers.data.loading.load_test_data``, which matches the labels to the training classes.

    The example shape is ``decode``'s, else ``image_size``, else the training examples' (H, W, C) (images
    of another size are fitted to it as the training images were), else the test images' own.
    """
    spec = parse_image_decode(decode) if decode else None
    if decode and spec is None:
        raise UserError(f"`decode` {decode} reads raw bytes; with an image folder, `augment` or `normalize` give "
                        "encoded images as NAME:image:H,W,C, or convert the data first")
    test = _split(path, x_key, y_key, spec, on_error, say, "test_data", test=True, own=own)
    if spec is None and image_size is None and len(example_shape) == 3:
        size = tuple(example_shape)
    else:
        size = _size(test, spec, image_size)
    x = ImageArray(str(path), test.source, Transform(size, augment, normalize, seed, test.source.encoded),
                   test.labels, Workers(workers), on_error, say)
    return x, test.labels, test.classes


def propose(path) -> str | None:
    """The settings that train from the encoded images of the TFRecord file (or glob) ``path``, or None.

    Looks at the first record: a bytes feature holding one JPEG or PNG, and an
    int64 label (named ``*label*`` when there are several).
    """
    try:
        first = expand_inputs([path])[0]
        batch = next(iter(TFRecordReader(first, "auto", "skip")), None)
        features = SequenceExample.FromString(batch.payloads[0]).context.feature if batch else {}
    except (UserError, TFRecordError, OSError, ValueError):
        return None
    images = [k for k, f in sorted(features.items()) if f.WhichOneof("kind") == "bytes_list"
              and len(f.bytes_list.value) == 1 and codec.sniff(f.bytes_list.value[0]) != "other"]
    ints = [k for k, f in sorted(features.items()) if f.WhichOneof("kind") == "int64_list"
            and len(f.int64_list.value) == 1]
    labels = [k for k in ints if "label" in k] or ints
    if not images or not labels:
        return None
    h, w, c = codec.size(features[images[0]].bytes_list.value[0])
    return f"`x_key` {images[0]} `y_key` {labels[0]} `decode` {images[0]}:image:{h},{w},{c}"


def describe_classes(names) -> str:
    """``0 cat, 1 dog, ...`` (the first 20) for messages and logs."""
    shown = ", ".join(f"{k} {name}" for k, name in enumerate(names[:20]))
    return shown + (f", ... ({len(names)} classes)" if len(names) > 20 else "")

