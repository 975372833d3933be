"""Image folders: ``DIR/<class>/*.jpg|jpeg|png``, the torchvision ``ImageFolder`` / Keras layout.

:func:`scan` lists the classes (the sub-folders, in sorted name order, hidden
ones left out) and their images at any depth below each (sorted by name
within each folder, depth first, as torchvision's ``ImageFolder`` finds
them; symbolic links followed; extensions matched in any case), and gives the
file paths and labels in class order: label ``k`` is the k-th class name.  :func:`common_size` reads every image's header (the first
``HEADER_BYTES`` of each file; no pixels are decoded) when the example shape
is not given.

Every problem is one ``UserError``: a folder that does not exist, holds no
class folders or no images, holds images outside any class folder, a class
folder with no images, an image that cannot be opened (a dangling link), a
link that loops back to a folder holding it, a file whose header cannot be
read, images of several sizes without ``image_size``.  Files that
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


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(EXTENSIONS)


def is_image_folder(path) -> bool:
    """Whether ``path`` is a folder with sub-folders or images in it (a folder with neither is no data set of any
    kind: the npz loader names it as a folder)."""
    if path is None or not os.path.isdir(str(path)):
        return False
    try:
        return any((e.is_dir() and not e.name.startswith(".")) or _is_image(e.name) for e in os.scandir(str(path)))
    except OSError:
        return True  # scan() names what is wrong


def _unreadable(path: str, error: OSError) -> UserError:
    return UserError(f"image {path} cannot be read ({error.strerror or error}): fix its permissions or remove it")


def _images(folder: str, setting: str) -> list[str]:
    """The image files under the class folder ``folder``, at any depth, sorted by name within each folder
    (depth first); symbolic links are followed.  A link that leads back to a folder it is in (a loop), an
    image name that cannot be opened (a dangling link) and a folder that cannot be listed are UserErrors."""
    found, above = [], []  # above: (st_dev, st_ino) of the folders being walked, to tell a loop

    def walk(here: str) -> None:
        try:
            st = os.stat(here)
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError as e:
            raise UserError(f"`{setting}`: folder {here} cannot be read ({e.strerror or e}): fix its permissions "
                            "or remove it") from None
        if (st.st_dev, st.st_ino) in above:
            raise UserError(f"`{setting}`: folder {here} cannot be read: it is a symbolic link to a folder that "
                            "holds it (a loop); remove the link")
        above.append((st.st_dev, st.st_ino))
        for e in entries:
            if e.name.startswith("."):
                continue
            try:
                is_dir, is_file = e.is_dir(), e.is_file()
            except OSError as err:  # a link loop
                raise _unreadable(e.path, err) from None
            if is_dir:
                walk(e.path)
            elif _is_image(e.name):
                if not is_file:  # a dangling link, a loop of links, a device
                    try:
                        os.stat(e.path)
                        raise _unreadable(e.path, OSError(0, "not a regular file"))
                    except OSError as err:
                        raise _unreadable(e.path, err) from None
                found.append(e.path)
        above.pop()

    walk(folder)
    return found


def scan(root: str, setting: str = "data") -> tuple[list[str], list[str], np.ndarray]:
    """(class names, image paths, int32 labels) of the image folder ``root``: each class folder's images at
    any depth below it (torchvision's ``ImageFolder`` reads them so); an image directly in ``root`` belongs to
    no class and is refused, as is an image that cannot be opened."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
        classes = [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]
    except OSError as e:
        raise UserError(f"`{setting}` {root} cannot be listed ({e.strerror or e})") from None
    layout = f"expected {os.path.join(root, '<class>', '*.jpg')} (one folder per class, .jpg, .jpeg or .png)"
    loose = _loose(entries)
    if loose:
        shown = ", ".join(loose[:3]) + (", ..." if len(loose) > 3 else "")
        raise UserError(f"`{setting}` {root} holds {len(loose)} image(s) outside any class folder ({shown}): "
                        f"{layout}; move them into their class folder, or remove them")
    if not classes:
        raise UserError(f"`{setting}` {root} holds no class folders: {layout}")
    paths, labels = [], []
    for k, name in enumerate(classes):
        folder = os.path.join(root, name)
        files = _images(folder, setting)
        if not files:
            raise UserError(f"`{setting}`: class folder {folder} holds no .jpg, .jpeg or .png images: add some, or "
                            "remove the folder")
        paths += files
        labels += [k] * len(files)
    return classes, paths, np.array(labels, np.int32)


def _loose(entries) -> list[str]:
    """The names of the images among a folder's ``entries`` (``os.scandir``'s): in no class folder."""
    return [e.name for e in entries if _is_image(e.name) and not e.is_dir()]


def has_loose_images(root: str) -> bool:
    """Whether the folder ``root`` holds images of its own, outside any class folder (data without labels to
    ``towers.data.loading.labelled``; refused by :func:`scan`)."""
    try:
        with os.scandir(root) as entries:
            return bool(_loose(entries))
    except OSError:
        return False  # scan() or image_files() names what is wrong


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
        raise _unreadable(path, e) from None
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
