"""Kinds of data source: what a data path is, and how a split of each kind is opened.

``KINDS`` lists them, the first that claims a path (``claims``) is its kind
(``kind_of``): an image folder, TFRecord files (a glob of shards), else an
npz.  This list is the one place a new kind of source is added: a
:class:`Kind` that claims its paths and opens a split (``open``: a source of
rows, ``towers.data.sources``, with the labels) is then read by every
description (``towers.data.pipeline``) and loader (``towers.data.loading``,
``towers.data.image.load``) as the built-in kinds are; the tests add a folder
of ``.npy`` files so (``tests/data/test_kinds.py``).

A kind gives a split in two forms, chosen by the loader from the description:

- ``stored``: (examples as stored, int32 labels), for a description without
  per-example operations.  By default the split's rows gathered by its
  source's ``read_rows`` in input workers of its own
  (``towers.data.examples.Examples`` over a ``Gather`` job); an npz gives
  its arrays themselves (in memory or mapped), TFRecord files their raw
  records.
- ``images``: a :class:`Split` (source, labels, class names, stored size)
  whose rows the ``Images`` op decodes or fits: by default ``open``'s;
  TFRecord files give the op's encoded-image feature (``RecordSource``) or
  their raw examples as arrays, an npz its uint8 arrays (``ArraySource``).

A kind that makes its data set whole rather than reading splits (``whole``:
``synthetic``) gives ``dataset(spec)`` instead, which the loader returns as it is.

Importing this module loads no image or TFRecord code; each kind imports its
readers when it opens a split.
"""
from __future__ import annotations

import numpy as np

from towers.data.image.folder import is_image_folder
from towers.data.inputs import is_tfrecord
from towers.errors import UserError


class Split:
    """One split before it becomes an examples array: its source, labels, class names and example size."""

    def __init__(self, source, labels, classes=None, size=None):
        self.source, self.labels, self.classes, self.size = source, labels, classes, size
        self.test = None  # an npz's own x_test/y_test


class Kind:
    """A kind of data path.  A new kind gives ``name``, ``claims`` and ``open``; ``stored`` and ``images``
    follow from ``open`` (the built-in kinds give their own)."""

    name = "data"
    encoded = False  # rows are encoded images: a description of this kind has an ``Images`` op
    whole = False  # it makes its data set itself (``dataset``), no split is read

    def claims(self, path) -> bool:
        raise NotImplementedError

    def open(self, spec, path, say, test=False, own=False) -> Split:
        """The split at ``path`` (``test``: a test split; ``own``: a `data` file's own test split)."""
        raise NotImplementedError

    def stored(self, spec, path, workers, say, test=False, own=False):
        """(examples as stored, int32 labels) of the split at ``path``, read by ``workers`` of its own."""
        from towers.data.examples import Examples
        from towers.data.jobs import Gather
        from towers.data.workers import Workers

        split = self.open(spec, path, say, test, own)
        labels = np.asarray(split.labels, np.int32)
        return Examples(str(path), Gather(split.source), Workers(workers), labels, spec.on_error, say,
                        own_workers=True), labels

    def images(self, spec, path, say, test=False, own=False) -> Split:
        """The split at ``path`` whose rows the description's ``Images`` op makes into images."""
        return self.open(spec, path, say, test, own)


def _setting(test: bool) -> str:
    return "test_data" if test else "data"


def image_arrays(x, y, name) -> Split:
    """Stored uint8 images (N, H, W) or (N, H, W, C) to augment, as a split (``ArraySource``)."""
    from towers.data.sources import ArraySource

    if x.dtype != np.uint8 or x.ndim not in (3, 4) or (x.ndim == 4 and x.shape[3] not in (1, 3)):
        raise UserError(f"{name}: `augment` and `normalize` work on uint8 images (N, H, W) or (N, H, W, 1 or 3), "
                        f"got {x.dtype} {tuple(x.shape[1:])} per example")
    if x.ndim == 3:
        x = x.reshape(x.shape + (1,))
    return Split(ArraySource(x, name), np.asarray(y, np.int32), size=tuple(x.shape[1:]))


class ImageFolder(Kind):
    """``DIR/<class>/*.jpg|jpeg|png``: one encoded image a file, labelled by sorted class name
    (``towers.data.image.folder``); its description always has an ``Images`` op."""

    name = "image folder"
    encoded = True

    def claims(self, path) -> bool:
        return is_image_folder(path)

    def open(self, spec, path, say, test=False, own=False) -> Split:
        from towers.data.image import folder
        from towers.data.sources import FileSource

        classes, paths, labels = folder.scan(path, _setting(test))
        return Split(FileSource(paths), labels, classes)


class Records(Kind):
    """TFRecord files or a glob of shards (``towers.data.tfrecord``): a raw feature as stored
    (``towers.data.tfrecord.records.load_split``), or the ``Images`` op's encoded-image feature."""

    name = "TFRecord"

    def claims(self, path) -> bool:
        return is_tfrecord(path)

    def stored(self, spec, path, workers, say, test=False, own=False):
        from towers.data.tfrecord.records import load_split

        return load_split(path, spec.x_key, spec.y_key, spec.stored, spec.on_error, workers, say=say)

    def images(self, spec, path, say, test=False, own=False) -> Split:
        from towers.data.tfrecord.records import encoded_images, load_split

        feature = spec.image_feature
        if feature is not None:
            return Split(*encoded_images(path, spec.x_key, spec.y_key, feature, spec.on_error, say))
        x, y = load_split(path, spec.x_key, spec.y_key, None, spec.on_error, workers=0, say=say)
        return image_arrays(x, y, str(path))


class Npz(Kind):
    """An npz file (``towers.data.dataset``): its arrays, in memory or mapped; the kind of every path no other
    kind claims (a missing file is the npz reader's error)."""

    name = "npz"

    def claims(self, path) -> bool:
        return True

    def stored(self, spec, path, workers, say, test=False, own=False):
        from towers.data.dataset import load_npz, read_npz_pair, test_keys

        if test:  # its own test split first, then its training keys (`own`: its test split only)
            what = ("data", "data") if own else ("test data", "test_data")
            return read_npz_pair(path, *test_keys(path, spec.x_key, spec.y_key, own, *what), *what)
        train = load_npz(path, spec.x_key, spec.y_key)
        return train.x, train.y

    def images(self, spec, path, say, test=False, own=False) -> Split:
        from towers.data.dataset import load_npz

        feature = spec.image_feature
        if feature is not None:
            raise UserError(f"`decode` {feature}:image reads TFRecord files; `{_setting(test)}` {path} is not one")
        if test:
            return image_arrays(*self.stored(spec, path, 0, say, test, own), str(path))
        ds = load_npz(path, spec.x_key, spec.y_key)
        train = image_arrays(ds.x, ds.y, str(path))
        train.test = None if ds.x_test is None else image_arrays(ds.x_test, ds.y_test, f"{path} (x_test)")
        return train


SYNTHETIC = "synthetic"
SYNTHETIC_SIZE = (224, 224, 3)  # without `image_size`: ImageNet's training crop
SYNTHETIC_EXAMPLES = 512  # at least; one per class when there are more classes


def is_synthetic(path) -> bool:
    """Whether ``path`` names synthetic data (``synthetic`` or ``synthetic:CLASSES``), not a file."""
    return isinstance(path, str) and (path == SYNTHETIC or path.startswith(SYNTHETIC + ":"))


class Synthetic(Kind):
    """``synthetic`` or ``synthetic:CLASSES`` (default 1000): random uint8 images of ``image_size`` (default
    224,224,3) and labels, made once from the run's seed, for measuring a host without a data set (as
    ``tf_cnn_benchmarks`` does without ``--data_dir``).

    max(512, CLASSES) examples, label k of example i = i mod CLASSES (every class present), pixels uniform
    in 0..255 from ``numpy.random.default_rng(seed)``; no test split.  The examples are an array in
    memory, so GPU towers get them copied once to each device and gather each step's batch there
    (``towers.data.device_data``): a step costs its compute, its all-reduce and a gather, no input
    pipeline.  What they learn means nothing; augmentation and normalization are refused (random
    pixels), as is a test split."""

    name = "synthetic data"
    whole = True

    def claims(self, path) -> bool:
        return is_synthetic(path)

    def classes(self, path) -> int:
        text = path[len(SYNTHETIC) + 1:] if path != SYNTHETIC else "1000"
        if not text.isdigit() or not 2 <= int(text) <= 2 ** 20:
            raise UserError(f"`data` {path}: give synthetic or synthetic:CLASSES, CLASSES a whole number from 2 to "
                            f"{2 ** 20} (e.g. synthetic:1000)")
        return int(text)

    def dataset(self, spec, seed: int = 0):
        from towers.data.dataset import Dataset
        from towers.data.image.augment import parse_image_size

        classes = self.classes(spec.path)
        extra = spec.transforms
        if extra or spec.test_path is not None or spec.stored:
            given = ("`augment` or `normalize`" if extra else "`test_data`" if spec.test_path is not None
                     else "`decode`")
            raise UserError(f"`data` {spec.path} makes random images and labels with no test split: {given} "
                            "does not apply to it; drop it")
        size = parse_image_size(spec.image_size) if spec.image_size is not None else SYNTHETIC_SIZE
        n = max(SYNTHETIC_EXAMPLES, classes)
        x = np.random.default_rng(seed).integers(0, 256, (n,) + size, dtype=np.uint8)
        return Dataset(x, np.arange(n, dtype=np.int32) % classes, classes)


KINDS: list[Kind] = [Synthetic(), ImageFolder(), Records(), Npz()]


def kind_of(path) -> Kind:
    """The first of ``KINDS`` that claims ``path``."""
    return next(kind for kind in KINDS if kind.claims(path))
