"""Which files a data path names: a file, or a glob of shards expanded in sorted order; and which reader it needs.

Shared by training from TFRecord files (``towers.data.tfrecord.records``,
``towers.data.image.load``) and the converter's INPUT arguments
(``towers.data.tfrecord.convert``).  A path that names an existing file is
that file, whatever characters it holds (``a[1].tfrecords`` is not the
pattern matching ``a1.tfrecords``); any other path with ``*``, ``?`` or
``[`` is a glob.  A pattern that matches nothing, a folder and a missing file
are one-line usage errors.  What a file holds, not its name, says whether it
is TFRecord data: numpy's magic means an npz or ``.npy``, and a file named
``.npz`` is TFRecord data only when it starts with a TFRecord record or a
gzip stream.
"""
import glob
import os

from numpy.lib import format as npy

from towers.data.tfrecord.framing import HEADER, header_intact
from towers.data.tfrecord.schema import UsageError

# Files that start with these are numpy's, never TFRecord: a zip (an npz) or a single .npy array.
_NUMPY_MAGIC = (b"PK\x03\x04", b"PK\x05\x06", npy.MAGIC_PREFIX)  # (PK 05 06: an npz of no arrays)
_GZIP_MAGIC = b"\x1f\x8b"


def is_tfrecord(path) -> bool:
    """Whether ``path`` names TFRecord data (a glob, or a file that is neither an npz nor a .npy).

    Anything numpy wrote goes to the npz loader, which names what it is (".npy
    file (one array), not an npz") instead of a TFRecord framing error.
    """
    if path is None:
        return False
    path = str(path)
    if glob.has_magic(path) and not os.path.lexists(path):
        return not path.endswith(".npz")
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER)
    except OSError:
        return False  # missing, a directory, unreadable: the npz loader names what it is
    if head.startswith(_NUMPY_MAGIC):
        return False
    if path.endswith(".npz"):  # named an npz: TFRecord only by its bytes, else the npz loader says what it is
        return header_intact(head) or head.startswith(_GZIP_MAGIC)
    return True


def expand_inputs(patterns):
    """Paths for the INPUT arguments: globs expanded and sorted, argument order kept."""
    paths = []
    for pattern in patterns:
        if glob.has_magic(pattern) and not os.path.lexists(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise UsageError(f"no file matches {pattern!r}; check the pattern (quote it for the shell)")
            paths += matches
        elif os.path.isfile(pattern):
            paths.append(pattern)
        elif os.path.isdir(pattern):
            raise UsageError(f"{pattern} is a folder, not a TFRecord file; give its files, "
                             f"e.g. {os.path.join(pattern, '*.tfrecords')!r}")
        else:
            raise UsageError(f"{pattern}: no such file; give a TFRecord file or a glob")
    return paths
