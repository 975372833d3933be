"""Write an npz or an image folder as TFRecord shards in TensorFlow's ImageNet layout (the library half of
``towers-images-to-tfrecord``; its command line is :mod:`towers.images_to_tfrecord`).

Each record is a ``tf.train.Example`` as TensorFlow's
``build_imagenet_data.py`` writes it: ``image/encoded`` (the image),
``image/format`` (``JPEG``/``PNG``), ``image/class/label`` (the label plus
``--label-offset``; the ImageNet files count from 1), ``image/class/text``
(a folder's class name: training from the records reads the class names back
from it, ``towers.data.tfrecord.records.class_names``, as from the folder), ``image/height``, ``image/width``,
``image/channels``, ``image/colorspace`` (``RGB``/``Grayscale``),
``image/filename`` and the empty bounding-box lists
``image/object/bbox/{xmin,ymin,xmax,ymax}`` (float) and
``image/object/bbox/label`` (int64).  Training reads them with ``--x-key
image/encoded --y-key image/class/label --decode image/encoded:image:H,W,C``.

An npz gives its ``x``/``y`` (``test``: ``x_test``/``y_test``), uint8
(N, H, W) or (N, H, W, C) with C 1 or 3, encoded as ``encode`` says (default
jpeg, ``quality`` 90, TensorFlow's ``encode_jpeg`` layout).  An image folder
(``DIR/<class>/*.jpg|jpeg|png``) keeps each file's bytes unless ``encode``
asks to re-encode.  ``shards`` N writes ``OUT-00000-of-0000N`` ...,
records dealt out in order, as contiguous runs.

Limits: the encoded records are held in memory until they are written
(about the size of the output).  Outputs are written as :mod:`towers.files` describes: all shards appear
together at the end, and an error, Ctrl-C or SIGTERM leaves none.  A usage
mistake is a ``UserError`` (``UsageError``), found before anything is written.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np

from towers.data.dataset import load_npz, npz_has_test
from towers.data.image import codec, folder
from towers.data.tfrecord.framing import TFRecordWriter
from towers.data.tfrecord.index import CLASS_TEXT
from towers.data.tfrecord.proto import SequenceExample
from towers.data.tfrecord.schema import UsageError
from towers.errors import UserError
from towers.files import atomic_path, check_new_output, names_folder, output_folder, refuse_overwriting_inputs

_FORMAT = {"jpeg": b"JPEG", "png": b"PNG", "other": b""}


def shard_paths(out: str, shards: int) -> list[str]:
    return [out] if shards == 1 else [f"{out}-{k:05d}-of-{shards:05d}" for k in range(shards)]


def example(encoded: bytes, label: int, shape, name: bytes = b"", text: bytes = b"") -> bytes:
    """One record of the ImageNet layout."""
    record = SequenceExample()
    f = record.context.feature
    f["image/encoded"].bytes_list.value.append(encoded)
    f["image/format"].bytes_list.value.append(_FORMAT[codec.sniff(encoded)])
    f["image/class/label"].int64_list.value.append(int(label))
    f[CLASS_TEXT].bytes_list.value.append(text)
    f["image/filename"].bytes_list.value.append(name)
    for key, value in zip(("image/height", "image/width", "image/channels"), shape):
        f[key].int64_list.value.append(int(value))
    f["image/colorspace"].bytes_list.value.append(b"Grayscale" if shape[2] == 1 else b"RGB")
    for side in ("xmin", "ymin", "xmax", "ymax"):
        f[f"image/object/bbox/{side}"].float_list.SetInParent()
    f["image/object/bbox/label"].int64_list.SetInParent()
    return record.SerializeToString()


def _from_npz(path, test, encode, quality, offset):
    if test and not npz_has_test(path):
        raise UsageError(f"{path} has no x_test/y_test for --test")
    ds = load_npz(path, *(("x_test", "y_test") if test else ("x", "y")))
    x = ds.x
    if x.dtype != np.uint8 or x.ndim not in (3, 4) or (x.ndim == 4 and x.shape[3] not in (1, 3)):
        raise UsageError(f"{path}: images must be uint8 (N, H, W) or (N, H, W, 1 or 3), got {x.dtype} {x.shape}")
    for i in range(len(x)):
        image = x[i].reshape(x.shape[1], x.shape[2], -1)
        yield example(codec.encode(image, encode, quality), int(ds.y[i]) + offset, image.shape)


def _from_folder(root, scanned, encode, quality, offset):
    classes, paths, labels = scanned
    for path, label in zip(paths, labels.tolist()):
        try:
            with open(path, "rb") as f:
                data = f.read()
            if encode:
                image = codec.decode(data, codec.size(data)[2])
                data, shape = codec.encode(image, encode, quality), image.shape
            else:
                shape = codec.size(data)
        except OSError as e:
            raise UserError(f"{path} cannot be read ({e.strerror or e})") from None
        except codec.ImageError as e:
            raise UserError(f"{path} is {e}: remove or replace it") from None
        name = os.path.relpath(path, root).encode()
        yield example(data, label + offset, shape, name, classes[label].encode())


def convert(input: str, output: str, encode: str | None = None, quality: int = 90, shards: int = 1,
            test: bool = False, label_offset: int = 0) -> tuple[int, list[str]]:
    """Write the records of the npz or image folder ``input`` as ``shards`` files named after ``output``;
    (records, their paths).

    ``encode``: ``jpeg`` or ``png`` (None: jpeg for an npz, each file's own bytes for a folder);
    ``test``: an npz's ``x_test``/``y_test``; ``label_offset``: added to every label.
    """
    if shards < 1:
        raise UsageError(f"--shards must be >= 1, got {shards}")
    if not 1 <= quality <= 100:
        raise UsageError(f"--quality must be 1..100, got {quality}")
    is_folder = os.path.isdir(input)
    if is_folder and test:
        raise UsageError("--test picks an npz's x_test/y_test; give the test folder itself instead")
    scanned = folder.scan(input, "input") if is_folder else None
    # ('' and a folder's path, new/, are refused as they are: not a prefix of shards named -00000-of-00002)
    outputs = shard_paths(output, shards) if output and not names_folder(output) else [output]
    for out in outputs:  # every image of a folder is an input: none is written over
        refuse_overwriting_inputs(out, scanned[1] if is_folder else [input])
        check_new_output(out, "images_to_tfrecord", "-o", "out.tfrecords")
    records = list(_from_folder(input, scanned, encode, quality, label_offset) if is_folder else
                   _from_npz(input, test, encode or "jpeg", quality, label_offset))
    bounds = np.linspace(0, len(records), shards + 1).astype(int)
    with contextlib.ExitStack() as stack:  # every shard is renamed into place only when all are written
        for out, a, b in zip(outputs, bounds[:-1], bounds[1:]):
            tmp = stack.enter_context(atomic_path(out, stack.enter_context(output_folder(out, flag="-o"))))
            with open(tmp, "wb") as f, TFRecordWriter(f, "none") as writer:
                for payload in records[a:b]:
                    writer.write(payload)
    return len(records), outputs
