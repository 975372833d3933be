"""Which files a data path names: a file, or a glob of shards expanded in sorted order.

Shared by training from TFRecord files (``towers.data.tfrecord.records``,
``towers.data.image.load``) and the converter's INPUT arguments
(``towers.data.tfrecord.convert``).  A pattern that matches nothing, a folder
and a missing file are one-line usage errors.
"""
import glob
import os

from towers.data.tfrecord.schema import UsageError


def expand_inputs(patterns):
    """Paths for the INPUT arguments: globs expanded and sorted, argument order kept."""
    paths = []
    for pattern in patterns:
        if glob.has_magic(pattern):
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
