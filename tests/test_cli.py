"""What the command lines share (towers.cli): exceptions as one line and an exit status."""
from __future__ import annotations


def test_running_out_of_memory_is_one_line_exit_1():
    # Before: a MemoryError (NumPy's _ArrayMemoryError) reached the command line as a traceback, exit 1.
    from towers.cli import exit_status

    error = MemoryError("Unable to allocate 1.17 GiB for an array with shape (100, 1024, 1024, 3) and data type "
                        "float32")
    status, line = exit_status(error)
    assert status == 1 and line == (
        "error: out of memory (Unable to allocate 1.17 GiB for an array with shape (100, 1024, 1024, 3) and data "
        "type float32): free memory or raise this process's limit (ulimit -v), or use smaller batches or data")
