"""Atomic output files: write to a temporary file beside the target, then rename.

``os.replace`` within one directory is atomic on POSIX, so readers see either
no file (or the old one) or the complete new one.  On any exception, including
``KeyboardInterrupt``, the temporary file is removed and the target is left
untouched, so a failed or interrupted conversion never leaves a partial output.
"""

import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path in ``path``'s directory; rename it to ``path`` on success."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial", dir=directory)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
