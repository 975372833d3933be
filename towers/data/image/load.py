"""Image data sets: the loader of a description with per-example operations (``towers.data.pipeline``).

``load_images`` is what ``towers.data.loading.load_dataset`` runs when the
description (``DataSpec``) has operations: an ``Images`` op, then
``Augment`` and ``Normalize``.  Each split becomes a source, as its kind
(``towers.data.kinds``) opens it for images:

============================  ================================================================
split given as                source (``towers.data.sources``)
============================  ================================================================
a folder ``DIR/<class>/*``    ``FileSource`` (``towers.data.image.folder``), labels by sorted
                              class name, the class names kept
TFRecord + ``Images`` op      ``RecordSource``: the op's bytes feature (``decode``
reading a feature             ``NAME:image:H,W,C``), labels from ``y_key`` (int64, one a record)
an npz, or raw TFRecord       ``ArraySource`` over its uint8 (N, H, W[, C]) examples, to augment
another kind                  its own (``Kind.open``)
============================  ================================================================

and the operations one ``Transform`` (``towers.data.image.augment``), run by
a ``Transformed`` job (``towers.data.jobs``) in the input workers
(``towers.data.workers``), behind one ``Examples`` array a split
(``towers.data.examples``).  The example shape is the ``Images`` op's size
(``decode``'s, else ``image_size``), else (folders) the images' own when they
all agree, else (arrays) the stored one.  The training split is augmented,
the test split takes the deterministic path, and both share the pool.

What is cached and where each operation runs is decided here: with
``cache_mib``, an encoded training split whose decoded pixels fit the budget,
and the memory the process may take, is decoded once (the ``Images`` op
alone, ``towers.data.image.cache``), and the operations after it run on the
cached pixels, in the input thread when they are cheap (see ``_cache``);
else, or when its memory cannot be had after all, it streams after a notice.
Training and test labels mean the same classes or the data is refused: a
test folder's classes match the training folder's by name, and class folders
named by numbers (``0`` .. ``C-1``) match numbered labels (npz, TFRecord).

:func:`propose` looks at a TFRecord file's first record for an encoded image
(the TensorFlow ImageNet layout: ``image/encoded``, ``image/class/label``) and
returns the settings that train from it.
"""
from __future__ import annotations

import numpy as np

from towers.data.dataset import Dataset, check_test_split, match_test_labels
from towers.data.examples import Examples
from towers.data.image import cache, codec, folder
from towers.data.image.augment import Transform, parse_image_size
from towers.data.inputs import expand_inputs
from towers.data.kinds import kind_of
from towers.data.pipeline import DataSpec, Images
from towers.data.jobs import Gather, Transformed
from towers.data.tfrecord.framing import TFRecordError, TFRecordReader
from towers.data.tfrecord.proto import SequenceExample
from towers.data.workers import Workers
from towers.errors import UserError


def _size(split, size):
    """(H, W, C): the ``Images`` op's ``size`` (the decode's, or ``image_size`` text), else the split's stored
    size, else (folders) the images' common size."""
    if isinstance(size, tuple):
        return size
    if size is not None:
        return parse_image_size(size)
    if split.size is not None:
        return split.size
    return folder.common_size(split.source.paths)


def _images(spec: DataSpec) -> Images:
    """The ``Images`` op of ``spec``, which must not read its feature raw."""
    if spec.stored:
        raise UserError(f"`decode` {spec.stored} reads raw bytes; with an image folder, `augment` or `normalize` "
                        "give encoded images as NAME:image:H,W,C, or convert the data first")
    return spec.op(Images)


def _transform(spec: DataSpec, size, encoded: bool, decode_only: bool = False) -> Transform:
    """The ``Transform`` that runs the operations of ``spec`` on images of ``size`` (``decode_only``: the
    ``Images`` op alone, what the decoded-image cache keeps)."""
    if decode_only:
        return Transform(size, "none", None, spec.seed, encoded)
    return Transform(size, spec.augment, spec.normalize, spec.seed, encoded, spec.input_scale)


def _made(name, split, transform, pool, spec, say, labels=None) -> Examples:
    """The examples of ``split`` made by ``transform`` in ``pool``; stored images (not encoded: decoding gives
    the transform's channels) of other channels than the transform's are a UserError, here rather than at the
    first batch (a test split's: after training)."""
    have, c = split.size[-1] if split.size is not None and not split.source.encoded else None, transform.size[-1]
    if have is not None and have != c:
        grey = " or (N, H, W)" if c == 1 else ""
        raise UserError(f"{name}: the images have {have} channel{'s' * (have != 1)} but the run's have {c} "
                        f"{tuple(transform.size)}: give images of {c} channel{'s' * (c != 1)} (N, H, W, {c}){grey}")
    return Examples(str(name), Transformed(split.source, transform), pool,
                    split.labels if labels is None else labels, spec.on_error, say)


def _cache(spec, train, size, pool):
    """The cache of ``train`` (empty), the job that reads it, the pool that serves it, and the decode job
    with its id in ``pool`` (registered before the pool starts).

    Which operations run where: with no augmentation or normalization the
    cached rows are gathered (``Gather``, no transform); a crop and flip
    (``cifar``) of cached pixels is cheaper than sending the pixels to a
    worker, so it runs in the input thread (``Workers(0)``) too: 148,000-152,000
    32x32 images/s against 92,000-118,000 with 1 or 2 workers (2 cores); the float
    work of ``tf-cifar10`` or ``normalize`` goes to the workers (26,000 in the
    thread, 41,000-44,000 with 2).
    """
    cached = cache.CachedSource(np.zeros((len(train.source),) + tuple(size), np.uint8), "decoded images")
    decode = Transformed(train.source, _transform(spec, size, True, decode_only=True))
    light = spec.augment in ("none", "cifar") and spec.normalize is None
    job = Gather(cached) if spec.augment == "none" and spec.normalize is None else \
        Transformed(cached, _transform(spec, size, False))
    return cached, job, Workers(0) if light else pool, decode, pool.add(decode)


def load_images(spec: DataSpec, workers=2, cache_mib=None, progress=False, say=None) -> Dataset:
    """A ``Dataset`` of the images ``spec`` describes (see the module docstring); every problem is a UserError.

    ``workers``: the input worker processes (0: the input thread); ``cache_mib``: the decoded-image
    cache's budget in MiB (``towers.data.image.cache``; None or 0: off); ``progress``: show its decoding
    as a progress bar; ``say``: where notices go.
    """
    images = _images(spec)
    path, test_path = spec.path, spec.test_path
    train = kind_of(path).images(spec, path, say)
    test = train.test
    if test_path is not None:
        test = kind_of(test_path).images(spec.split(test_path), test_path, say, test=True)
    size = _size(train, images.size)
    pool = Workers(workers)
    n_classes = len(train.classes) if train.classes else int(train.labels.max()) + 1
    transform = _transform(spec, size, train.source.encoded)
    # Streamed (decoded every epoch); with a cache, still registered before the pool starts: the fallback of
    # a cache whose memory cannot be had.
    x = _made(path, train, transform, pool, spec, say)
    fill = None
    need = cache.nbytes(len(train.source), size)
    streams = f"{path}: the {len(train.source)} decoded training images need {need / cache.MIB:.1f} MiB, "
    if cache_mib and cache.cacheable(train.source, spec.augment):
        why = cache.not_cached(need, cache_mib, cache.memory_room(), cache.fill_bytes(len(train.source), size,
                                                                                   pool.n))
        if why is None:
            try:
                fill = _cache(spec, train, size, pool)
            except MemoryError:  # limits that could not be read, or memory taken meanwhile: stream all the same
                why = cache.ALLOCATION_FAILED
        if why is not None and say:
            say(streams + why)
    if fill is not None:
        cached, job, served_by, decode, decode_jid = fill
        cached_x = Examples(str(path), job, served_by, train.labels, spec.on_error, say, train.source)
    tx = ty = None
    if test is not None:
        ty = match_test_labels(train.classes, test.classes, test.labels, test_path, n_classes)
        check_test_split(None, ty, f"{test_path}: ", num_classes=n_classes)
        tx = _made(test_path or path, test, _transform(spec, size, test.source.encoded), pool, spec, say, ty)
    if fill is not None:
        try:
            cache.fill(cached, decode, pool, decode_jid, progress)
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


def load_image_test(spec: DataSpec, example_shape, workers=0, own=False, say=None):
    """(examples, labels, class names or None) of the test split ``spec.path`` alone, made as a training run of
    ``example_shape`` makes its test split (the deterministic path of its operations), for
    ``towers.data.loading.load_test_data``, which matches the labels to the training classes.

    The images are made by ``made_as_trained``.
    """
    test = kind_of(spec.path).images(spec, spec.path, say, test=True, own=own)
    return made_as_trained(spec, test, example_shape, spec.path, workers, say), test.labels, test.classes


def made_as_trained(spec: DataSpec, split, example_shape, name, workers=0, say=None) -> Examples:
    """The examples of ``split`` made as a run of ``example_shape`` (its model's input) that ``spec`` describes
    made its test split: its operations' deterministic path (the center of its augmentation, its
    normalization), by ``workers`` (0: the calling thread).  What ``towers.eval`` evaluates
    (``load_image_test``) and what a loaded run predicts from (``towers.inference.Predictor``).

    The images are fitted (shorter side, center crop) to the ``Images`` op's size (the decode's, else
    ``image_size``), else to the model's (H, W) as the training images were, else (``tf-cifar10``, whose
    model takes its 24 x 24 center) taken at their own size, as the training images were.
    """
    images = _images(spec)
    if images.size is None and len(example_shape) == 3 and spec.augment != "tf-cifar10":
        size = tuple(example_shape)
    else:
        size = _size(split, images.size)
    return _made(name, split, _transform(spec, size, split.source.encoded), Workers(workers), spec, say)


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

