"""What the command lines share (towers.cli): exceptions as one line and an exit status."""
from __future__ import annotations

import pytest


def test_running_out_of_memory_is_one_line_exit_1():
    # Before: a MemoryError (NumPy's _ArrayMemoryError) reached the command line as a traceback, exit 1.
    from towers.cli import exit_status

    error = MemoryError("Unable to allocate 1.17 GiB for an array with shape (100, 1024, 1024, 3) and data type "
                        "float32")
    status, line = exit_status(error)
    assert status == 1 and line == (
        "error: out of memory (Unable to allocate 1.17 GiB for an array with shape (100, 1024, 1024, 3) and data "
        "type float32): free memory or raise this process's limit (ulimit -v), or use smaller batches or data")


def test_a_signal_that_c_code_wraps_in_a_system_error_is_still_that_signal():
    # Seen in test_sigterm_ends_a_run_of_two_hosts_with_one_line: SIGTERM's Terminated, raised while Ray's
    # `wait` checked for signals, came out as "SystemError: <cyfunction CoreWorker.wait> returned a result with
    # an exception set", a traceback and exit 1 instead of the one line and 143.
    from towers.cli import Terminated, _run

    def raises(cause):
        def body():
            try:
                raise cause
            except BaseException as e:
                raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set") from e
        return body

    terminated = "terminated (SIGTERM); the last checkpoint is kept"
    assert _run("towers.train", raises(Terminated()), None, None, terminated) == 143
    assert _run("towers.train", raises(KeyboardInterrupt()), None, None, None) == 130
    with pytest.raises(SystemError):  # a SystemError of anything else stays a bug's traceback
        _run("towers.train", raises(ValueError("x")), None, None, None)
