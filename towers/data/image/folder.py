"""Image folders: ``DIR/<class>/*.jpg|jpeg|png``, the torchvision ``ImageFolder`` / Keras layout.

:func:`scan` lists the classes (the sub-folders, in sorted name order, hidden
ones left out) and their images (sorted by name; extensions matched in any
case), and gives the file paths and labels in class order: label ``k`` is the
k-th class name.  :func:`common_size` reads every image's header (the first
``HEADER_BYTES`` of each file; no pixels are decoded) when the example shape
is not given.

Every problem is one ``UserError``: a folder that does not exist, holds no
class folders or no images, a class folder with no images, a file whose header
cannot be read, images of several sizes without ``image_size``.  Files that
become unreadable later are found when a batch reads them
(``towers.data.examples``).  The kind of path it is: ``towers.data.kinds.ImageFolder``.
"""
from __future__ import annotations

import os

import numpy as np

from towers.data.image import codec
from towers.errors import UserError

EXTENSIONS = (".jpg", ".jpeg", ".png")
HEADER_BYTES = 64 << 10  # enough for a JPEG's or PNG's size unless a huge EXIF block comes first


def is_image_folder(path) -> bool:
    """Whether ``path`` is a folder with sub-folders (a folder without any is no data set of any kind: the
    npz loader names it as a folder)."""
    if path is None or not os.path.isdir(str(path)):
        return False
    try:
        return any(e.is_dir() and not e.name.startswith(".") for e in os.scandir(str(path)))
    except OSError:
        return True  # scan() names what is wrong


def scan(root: str, setting: str = "data") -> tuple[list[str], list[str], np.ndarray]:
    """(class names, image paths, int32 labels) of the image folder ``root``."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as e:
        raise UserError(f"`{setting}` {root} cannot be listed ({e.strerror or e})") from None
    classes = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    layout = f"expected {os.path.join(root, '<class>', '*.jpg')} (one folder per class, .jpg, .jpeg or .png)"
    if not classes:
        raise UserError(f"`{setting}` {root} holds no class folders: {layout}")
    paths, labels = [], []
    for k, name in enumerate(classes):
        folder = os.path.join(root, name)
        files = sorted(f.name for f in os.scandir(folder)
                       if f.is_file() and not f.name.startswith(".") and f.name.lower().endswith(EXTENSIONS))
        if not files:
            raise UserError(f"`{setting}`: class folder {folder} holds no .jpg, .jpeg or .png images: add some, or "
                            "remove the folder")
        paths += [os.path.join(folder, f) for f in files]
        labels += [k] * len(files)
    return classes, paths, np.array(labels, np.int32)


def image_files(root: str, setting: str = "test_data") -> list[str]:
    """Every image below the folder ``root`` (.jpg, .jpeg, .png, in any folder below it; hidden ones left out),
    sorted by path: data without labels, to predict.  A folder without images is a ``UserError``."""
    found = []
    try:
        for folder, dirs, files in os.walk(root, onerror=_raise):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            found += [os.path.join(folder, f) for f in sorted(files)
                      if not f.startswith(".") and f.lower().endswith(EXTENSIONS)]
    except OSError as e:
        raise UserError(f"`{setting}` {e.filename or root} cannot be listed ({e.strerror or e})") from None
    if not found:
        raise UserError(f"`{setting}` {root} holds no .jpg, .jpeg or .png images")
    return found


def _raise(error: OSError):
    raise error


def _header(path: str):
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            try:
                return codec.size(head)
            except codec.ImageError:
                if len(head) < HEADER_BYTES:  # the whole file: it is not an image
                    raise
            return codec.size(head + f.read())  # a header past HEADER_BYTES
    except OSError as e:
        raise UserError(f"image {path} cannot be read ({e.strerror or e}): fix its permissions or remove it") from None
    except codec.ImageError as e:
        raise UserError(f"image {path} is {e}: remove or replace it") from None


def common_size(paths, setting: str = "image_size") -> tuple[int, int, int]:
    """(H, W, C) shared by every image of ``paths``, from their headers; a UserError when they differ."""
    first = _header(paths[0])
    for path in paths[1:]:
        other = _header(path)
        if other != first:
            raise UserError(f"images differ in size: {paths[0]} is {'x'.join(map(str, first))} and {path} "
                            f"{'x'.join(map(str, other))} (H x W x C): give the example shape with `{setting}` "
                            "H,W,C (they are resized and cropped to it)")
    return first
