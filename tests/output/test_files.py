"""The atomic npz writer and the TensorBoard event file under interruptions and full disks.

An interruption is simulated deterministically: a trace function raises
KeyboardInterrupt at the k-th line that zipfile or ``write_npz`` executes,
for every k until a write completes, which is where a signal handler raises
when a signal lands there.
"""
from __future__ import annotations

import os
import sys
import zipfile

import numpy as np
import pytest

from tests.test_reliability import tmpfs, train
from towers import files
from towers.errors import TrainingError
from towers.files import atomic_save_npz
from towers.output.summaries import TensorBoard


def interrupted_at(k: int, write) -> BaseException | None:
    """Run ``write()`` with a KeyboardInterrupt raised at the k-th line of zipfile or write_npz; its exception."""
    seen = 0

    def tracer(frame, event, arg):
        nonlocal seen
        code = frame.f_code
        if event == "line" and (code.co_filename == zipfile.__file__ or code is files.write_npz.__code__):
            seen += 1
            if seen == k:
                raise KeyboardInterrupt
        return tracer

    sys.settrace(tracer)
    try:
        write()
    except BaseException as e:  # noqa: BLE001 - what surfaces is the point
        return e
    finally:
        sys.settrace(None)
    return None


# One of the points is inside the discarded archive's __del__: that interrupt is "ignored" there, as
# Python reports any exception raised while an object is collected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_anywhere_in_a_checkpoint_write_surfaces_as_itself_and_keeps_the_old_file(tmp_path):
    out = tmp_path / "ckpt.npz"
    old = {"params/w": np.zeros((3, 4), np.float32), "step": np.int64(1)}
    new = {"params/w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.int64(2)}
    atomic_save_npz(str(out), old)
    kept = out.read_bytes()
    k, surfaced = 0, set()
    while True:
        k += 1
        exc = interrupted_at(k, lambda: atomic_save_npz(str(out), new))
        if exc is None:
            break
        surfaced.add(type(exc).__name__)
        # Before the rename the old file is whole; the write is never half there.
        assert out.read_bytes() == kept, k
        assert sorted(os.listdir(tmp_path)) == ["ckpt.npz"], k  # the temporary folder went too
    assert k > 100  # the interrupts did land in the member writes
    # Before the fix, 36 of these points surfaced as zipfile's "ValueError: Can't close the ZIP file
    # while there is an open writing handle", a traceback and exit 1 instead of 130/143.
    assert surfaced == {"KeyboardInterrupt"}
    with np.load(out) as z:
        np.testing.assert_array_equal(z["params/w"], new["params/w"])


def test_a_full_disk_at_start_leaves_no_event_file_behind(tmp_path):
    with tmpfs(tmp_path / "disk", 16) as disk:
        filler = disk / "filler"
        with open(filler, "wb", buffering=0) as f:  # fill the disk to the last block
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        for _ in range(3):  # three resumes on the full disk
            with pytest.raises(TrainingError, match="No space left on device"):
                TensorBoard(str(disk), every=1, start_step=10, purge_step=11)
        # Before the fix each attempt left an empty events.out.tfevents.* file.
        assert sorted(os.listdir(disk)) == ["filler"]


def test_resumes_that_fail_on_a_full_disk_before_their_first_summary_leave_no_event_file(tmp_path):
    # The disk takes the first checkpoint, not the second: each resume writes its event file's first events
    # into the room the failed checkpoint's temporary file leaves, then fails at that checkpoint again.
    args = ["--steps", 60, "--checkpoint-every", 10, "--log-every", 100]
    with tmpfs(tmp_path / "disk", 44) as disk:
        p = train(disk, *args, "--summary-every", 0)
        assert p.returncode == 1 and "ckpt-00000020.npz: No space left on device" in p.stderr, p.stderr
        for _ in range(3):
            p = train(disk, *args, "--summary-every", 100, "--resume")
            assert p.returncode == 1 and "ckpt-00000020.npz: No space left on device" in p.stderr, p.stderr
        # Before the fix each resume left one more events.out.tfevents.* file of its first events only.
        assert not [n for n in os.listdir(disk) if n.startswith("events.out.tfevents.")], os.listdir(disk)
