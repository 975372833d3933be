"""The data set described once, as data: where its splits are and the operations made on each example.

A :class:`DataSpec` is what the loader (``towers.data.loading.load_dataset``)
runs.  It holds the **source** (``path`` and ``test_path``: an npz, TFRecord
files or a glob of shards, an image folder; ``x_key``/``y_key``, the arrays
or features; ``stored``, how a TFRecord bytes feature is read as it is
stored, ``NAME:DTYPE[:SHAPE]``; ``on_error``) and the **per-example
operations**, in order:

============  ===============================================================  ==================================
op            what it does to one example                                      settings
============  ===============================================================  ==================================
``Images``    the example becomes a uint8 H x W x C image: encoded bytes       ``feature`` (a TFRecord bytes
              decoded (a TFRecord feature, an image folder's files), stored     feature of encoded images),
              pixels kept; resized (shorter side) and center-cropped to H x W   ``size`` ((H, W, C) of the decode,
                                                                                ``image_size`` text, or None: the
                                                                                images' own)
``Augment``   the named augmentation's random draws (training only)             ``name``, ``seed``
``Normalize`` ``(x * scale - mean) / std`` per channel, float32; ``scale``     ``text`` (MEAN,STD ...),
              1/255 unless `input_scale` says 1                                 ``scale``
============  ===============================================================  ==================================

``Augment`` and ``Normalize`` work on images, so an ``Images`` op comes first
whenever there is one of them.  No operation: the examples are the stored
arrays.  The loader, not the caller, decides where each operation runs
(``towers.data.image.load``): the input workers make the rows
(``towers.data.jobs.Transformed``), the decode's output is kept in memory
when it fits (the decoded-image cache) and what follows it runs in the input
thread or the workers by its cost.

:func:`describe` builds a description from a path and the named settings of
the command line and ``Config`` (``decode``, ``augment``, ``normalize``,
``image_size``, ``seed``, ``input_scale``); a description can also be written directly.  Only
the ``decode`` syntax is checked here (a malformed ``NAME:image:...``, or an
``image_size`` that disagrees with it, is a ``UserError``); every other check
of the settings is the loader's, when it reads the data.  Importing this
module loads no decoder or TFRecord reader (Pillow, simplejpeg, protobuf).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from towers.data.kinds import kind_of
from towers.data.tfrecord.schema import parse_image_decode
from towers.errors import UserError


@dataclass(frozen=True)
class Images:
    """Examples become uint8 H x W x C images: decoded from ``feature`` (TFRecord records; None: an image
    folder's files, or stored pixels) and fitted to ``size`` (``(H, W, C)``, ``image_size`` text, or None)."""

    feature: str | None = None
    size: tuple | str | None = None


@dataclass(frozen=True)
class Augment:
    """The named augmentation (``towers.data.image.augment.AUGMENTS``), its draws from (``seed``, epoch, index)."""

    name: str
    seed: int = 0


@dataclass(frozen=True)
class Normalize:
    """``(x * scale - mean) / std`` per channel; ``text``: MEAN,STD or the per-channel means then stds;
    ``scale``: the `input_scale` setting (``towers.data.dataset.INPUT_SCALES``)."""

    text: str
    scale: str = "1/255"


@dataclass(frozen=True)
class DataSpec:
    """A data set: its source and its per-example operations (see the module docstring)."""

    path: str
    test_path: str | None = None
    x_key: str = "x"
    y_key: str = "y"
    stored: str | None = None  # NAME:DTYPE[:SHAPE]: a TFRecord bytes feature as stored
    on_error: str = "stop"
    ops: tuple = ()

    def op(self, kind):
        """The operation of type ``kind`` (``Images``, ``Augment``, ``Normalize``), or None."""
        return next((o for o in self.ops if isinstance(o, kind)), None)

    @property
    def augment(self) -> str:
        a = self.op(Augment)
        return "none" if a is None else a.name

    @property
    def seed(self) -> int:
        a = self.op(Augment)
        return 0 if a is None else a.seed

    @property
    def image_feature(self) -> str | None:
        """The TFRecord bytes feature the ``Images`` op decodes (None: no such op, or not a feature)."""
        images = self.op(Images)
        return None if images is None else images.feature

    @property
    def image_size(self) -> str | None:
        """The ``Images`` op's size (``H,W[,C]`` as given), or None: no such op, or the images' own size."""
        images = self.op(Images)
        return None if images is None else images.size

    @property
    def transforms(self) -> tuple:
        """The operations that change examples after they are read: every op but ``Images``."""
        return tuple(o for o in self.ops if not isinstance(o, Images))

    @property
    def normalize(self) -> str | None:
        n = self.op(Normalize)
        return None if n is None else n.text

    @property
    def input_scale(self) -> str:
        n = self.op(Normalize)
        return "1/255" if n is None else n.scale

    def split(self, path) -> "DataSpec":
        """The same operations on ``path`` alone (a test split read by itself: ``towers.eval``)."""
        return replace(self, path=path, test_path=None)

    def as_images(self) -> "DataSpec":
        """This description with an ``Images`` op (a test split of a model trained from images)."""
        return self if self.op(Images) else replace(self, ops=(Images(),) + self.ops)


def describe(path, x_key="x", y_key="y", test_path=None, *, decode=None, on_error="stop", augment="none",
             normalize=None, image_size=None, seed=0, input_scale="1/255") -> DataSpec:
    """The description of ``path`` (and ``test_path``) with the named settings, as the command line gives them.

    ``decode`` ``NAME:image:H,W,C`` is an ``Images`` op reading that feature;
    ``NAME:DTYPE[:SHAPE]`` is how the feature is stored (``stored``).  A
    split of encoded images (``towers.data.kinds``: an image folder), ``image_size``, ``augment`` other than
    ``none`` and ``normalize`` each need an ``Images`` op, which then has
    the decode's feature and size (``image_size`` must agree), else ``image_size``.  ``input_scale``:
    what ``normalize`` multiplies the pixels by first (the device scales every other uint8 example).
    """
    image = parse_image_decode(decode) if decode else None
    if image is not None and image_size is not None:
        from towers.data.image.augment import parse_image_size

        if parse_image_size(image_size) != image[1]:
            raise UserError(f"`image_size` {image_size} and `decode` {':'.join(map(str, image[1]))} disagree: "
                            "`decode` gives the shape; drop `image_size`")
    ops = []
    if augment != "none":
        ops.append(Augment(augment, seed))
    if normalize is not None:
        ops.append(Normalize(normalize, input_scale))
    if image is not None:
        ops.insert(0, Images(image[0], image[1]))
    elif ops or image_size is not None or any(kind_of(p).encoded for p in (path, test_path) if p is not None):
        ops.insert(0, Images(None, image_size))
    return DataSpec(path, test_path, x_key, y_key, None if image is not None else decode, on_error, tuple(ops))
