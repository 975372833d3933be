"""The converters never damage a user's file and never leave litter behind.

* An output that is one of the inputs (same path, another spelling, a symlink,
  a hard link, a glob match) is refused before anything is read.
* SIGTERM cleans up as Ctrl-C does; what SIGKILL leaves behind is removed by
  the next run, but only when its owner is provably dead.
* A full disk (a real, tiny tmpfs) gives one line naming the output, exit 1,
  and no output or temporary files; outputs get the mode ``open()`` gives.

Conversions that must be caught in the middle read a named pipe as their
second input: the converter then waits in ``read()`` with its spill folder
holding the first input's columns, for as long as the test keeps the pipe
open, so the signal lands mid-conversion without depending on timing.
"""

import errno
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tools import npz_to_tfrecord, tfrecord_to_npz

REPO = Path(__file__).resolve().parents[3]
SAMPLES = REPO.parent / "shared" / "tfrecord-samples"
DEADLINE = 60  # seconds a subprocess may take to reach the pipe on a loaded machine


def sample(name, suffix=".tfrecords"):
    path = SAMPLES / (name + suffix)
    if not path.is_file():
        pytest.skip(f"{path} is absent: the shared TFRecord samples are needed for this test")
    return path


def run(module, capsys, *argv):
    """Run a tool's main() in process; return (exit status, stderr lines)."""
    status = module.main([str(a) for a in argv])
    return status, capsys.readouterr().err.splitlines()


def hidden(folder):
    """Hidden entries of ``folder``: where the tools keep their temporaries."""
    return sorted(name for name in os.listdir(folder) if name.startswith("."))


# --- 1. never write over an input --------------------------------------------------------------

def _same_file_cases():
    def same(d, src):
        return src, [src]

    def respelled(d, src):
        return src, [d / "sub" / ".." / src.name]

    def symlink(d, src):
        (d / "link.npz").symlink_to(src)
        return d / "link.npz", [src]

    def hardlink(d, src):
        os.link(src, d / "hard.npz")
        return d / "hard.npz", [src]

    def glob_match(d, src):
        return src, [d / "*.tfrecords"]

    return {"same path": same, "another spelling": respelled, "symlink": symlink,
            "hard link": hardlink, "glob match": glob_match}


SAME_FILE = _same_file_cases()


@pytest.mark.parametrize("case", SAME_FILE)
def test_tfrecord_to_npz_refuses_to_write_over_an_input(case, tmp_path, capsys):
    src = tmp_path / "in.tfrecords"
    data = sample("mnist_t10k_head1000").read_bytes()
    src.write_bytes(data)
    (tmp_path / "sub").mkdir()
    damaged = tmp_path / "damaged.tfrecords-x"  # read first, it would fail with status 1
    damaged.write_bytes(b"not a tfrecord file at all")
    out, inputs = SAME_FILE[case](tmp_path, src)
    status, err = run(tfrecord_to_npz, capsys, damaged, *inputs, "-o", out)
    assert status == 2, err
    assert len(err) == 1 and "same file" in err[0] and str(out) in err[0], err
    assert src.read_bytes() == data and not stat.S_ISLNK(src.lstat().st_mode)
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("link", ["same path", "hard link"])
def test_npz_to_tfrecord_refuses_to_write_over_its_input(link, tmp_path, capsys):
    src = tmp_path / "in.npz"
    data = sample("mixed_features", ".npz").read_bytes()
    src.write_bytes(data)
    out = src
    if link == "hard link":
        out = tmp_path / "hard.tfrecords"
        os.link(src, out)
    status, err = run(npz_to_tfrecord, capsys, src, "-o", out)
    assert status == 2 and len(err) == 1 and "same file" in err[0], err
    assert src.read_bytes() == data
    assert hidden(tmp_path) == []


# --- 2. SIGTERM and SIGKILL -------------------------------------------------------------------

class Blocked:
    """A real ``tfrecord_to_npz`` subprocess stopped mid-conversion on a named pipe."""

    def __init__(self, folder, name):
        self.fifo = folder / f"{name}.pipe"
        os.mkfifo(self.fifo)
        self.out = folder / f"{name}.npz"
        # The bracket makes the pipe a glob match: plain INPUT arguments must be regular files.
        pipe_glob = str(self.fifo.parent / f"[{self.fifo.name[0]}]{self.fifo.name[1:]}")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.tfrecord_to_npz", str(sample("mnist_t10k_head1000")), pipe_glob,
             "-o", str(self.out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.writer = None
        deadline = time.monotonic() + DEADLINE
        while self.writer is None:  # opening the write end succeeds once the converter reads the pipe
            try:
                self.writer = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.finish()
                    pytest.fail(f"the converter never read the pipe: {self.proc.stderr.read()}")
                time.sleep(0.01)

    def finish(self, sig=None):
        """Send ``sig`` (if any), close the pipe; return (exit status, stderr). Idempotent."""
        if self.proc.returncode is not None and self.writer is None:
            return self.proc.returncode, ""
        if sig is not None:
            self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=DEADLINE)
        finally:
            if self.writer is not None:
                os.close(self.writer)
                self.writer = None
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode, err


def test_sigterm_mid_conversion_leaves_no_spill_and_no_output(tmp_path):
    job = Blocked(tmp_path, "out")
    try:
        assert hidden(tmp_path), "the converter should hold a spill folder while it reads"
        assert any(os.scandir(tmp_path / hidden(tmp_path)[0])), "the spill folder should hold columns"
        status, err = job.finish(signal.SIGTERM)
    finally:
        job.finish()
    assert status == 143, err
    assert err.splitlines()[-1] == "tfrecord_to_npz: terminated (SIGTERM): no output written", err
    assert sorted(os.listdir(tmp_path)) == ["out.pipe"]


def test_next_run_removes_a_killed_runs_spill_but_not_a_live_ones(tmp_path, capsys):
    live = Blocked(tmp_path, "live")
    try:
        (live_spill,) = hidden(tmp_path)
        killed = Blocked(tmp_path, "killed")
        (dead_spill,) = set(hidden(tmp_path)) - {live_spill}
        killed.finish(signal.SIGKILL)
        assert killed.proc.returncode == -signal.SIGKILL and hidden(tmp_path) == sorted([dead_spill, live_spill])
        lookalike = tmp_path / (dead_spill[:-3] + "zzz")  # a name like ours but no owner: not ours to delete
        lookalike.mkdir()
        status, err = run(tfrecord_to_npz, capsys, sample("mixed_features"), "-o", tmp_path / "next.npz")
        assert status == 0, err
        assert any(line.startswith(f"tfrecord_to_npz: removed {tmp_path / dead_spill}: ") for line in err), err
        assert hidden(tmp_path) == sorted([live_spill, lookalike.name])
        assert any(os.scandir(tmp_path / live_spill))
    finally:
        status, err = live.finish(signal.SIGTERM)
    assert status == 143, err
    assert sorted(os.listdir(tmp_path)) == sorted([lookalike.name, "killed.pipe", "live.pipe", "next.npz"])


# --- 3. full disk, file mode, fsync --------------------------------------------------------------

@pytest.fixture
def tiny_disk(tmp_path):
    """Mount a tmpfs of the requested size (KiB) under tmp_path; unmount afterwards."""
    mounted = []

    def mount(kib):
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root; run as root to test a full disk")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    try:
        yield mount
    finally:
        for point in mounted:
            subprocess.run(["umount", str(point)], check=True)


@pytest.mark.parametrize("kib, phase", [(128, "temporary"), (1200, "npz")])
def test_full_disk_names_the_output_and_leaves_nothing(kib, phase, tiny_disk, capsys):
    # 1000 MNIST records: about 800 KiB of spilled columns, then an npz of the same size.
    disk = tiny_disk(kib)
    out = disk / "out.npz"
    status, err = run(tfrecord_to_npz, capsys, sample("mnist_t10k_head1000"), "-o", out)
    assert status == 1, err
    errors = [line for line in err if "error" in line]
    assert errors == [err[-1]] and "Traceback" not in "".join(err)
    assert f"{out}: No space left on device" in errors[0], errors
    assert ("temporary" in errors[0]) == (phase == "temporary"), errors
    assert os.listdir(disk) == []


def test_full_disk_in_npz_to_tfrecord_names_the_output(tiny_disk, capsys):
    disk = tiny_disk(128)
    out = disk / "out.tfrecords"
    status, err = run(npz_to_tfrecord, capsys, sample("mnist_t10k_head1000", ".npz"), "-o", out)
    assert status == 1 and len(err) == 1, err
    assert f"{out}: No space left on device" in err[0], err
    assert os.listdir(disk) == []


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_outputs_get_the_mode_open_would_give(umask, tmp_path, capsys):
    old = os.umask(umask)
    try:
        assert run(tfrecord_to_npz, capsys, sample("mixed_features"), "-o", tmp_path / "a.npz")[0] == 0
        assert run(npz_to_tfrecord, capsys, tmp_path / "a.npz", "-o", tmp_path / "b.tfrecords")[0] == 0
    finally:
        os.umask(old)
    for name in ("a.npz", "b.tfrecords"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


def test_outputs_are_fsynced_with_their_folder(tmp_path, capsys, monkeypatch):
    synced = []  # (inode, is a directory) of every descriptor fsynced
    real_fsync = os.fsync

    def spy(fd):
        st = os.fstat(fd)
        synced.append((st.st_ino, stat.S_ISDIR(st.st_mode)))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    assert run(tfrecord_to_npz, capsys, sample("mixed_features"), "-o", tmp_path / "a.npz")[0] == 0
    assert ((tmp_path / "a.npz").stat().st_ino, False) in synced
    assert (tmp_path.stat().st_ino, True) in synced
    synced.clear()
    assert run(npz_to_tfrecord, capsys, tmp_path / "a.npz", "-o", tmp_path / "b.tfrecords")[0] == 0
    assert ((tmp_path / "b.tfrecords").stat().st_ino, False) in synced
    assert (tmp_path.stat().st_ino, True) in synced
    with np.load(tmp_path / "a.npz") as npz, np.load(sample("mixed_features", ".npz")) as want:
        assert sorted(npz.files) == sorted(want.files)


# --- 5. bad command lines: one line, the right status, nothing written ----------------------------

def cli(module, capsys, *argv):
    """Run a tool's main() in process, flag errors included; return (exit status, stderr lines)."""
    try:
        status = module.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's exit on a flag mistake
        status = exc.code
    return status, capsys.readouterr().err.splitlines()


def assert_one_line(result, status, *texts):
    got, err = result
    assert got == status and len(err) == 1 and all(t in err[0] for t in texts), (got, err)


@pytest.mark.parametrize("size", ["0", "-5"])
def test_chunk_size_must_be_positive(size, tmp_path, capsys):
    result = cli(tfrecord_to_npz, capsys, sample("mnist_t10k_head1000"), "-o", tmp_path / "o.npz", "--chunk-size", size)
    assert_one_line(result, 2, "--chunk-size must be > 0")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("module, argv", [
    (tfrecord_to_npz, ["--bogus"]),
    (tfrecord_to_npz, ["in.tfrecords", "--compression", "lzma"]),
    (npz_to_tfrecord, ["in.npz"]),
    (npz_to_tfrecord, ["in.npz", "-o", "o.tfrecords", "--compression", "auto"]),
    ("images_to_tfrecord", []),  # no arguments at all: a usage error like any other
])
def test_flag_mistakes_are_one_line(module, argv, tmp_path, capsys):
    if module == "images_to_tfrecord":
        from tools import images_to_tfrecord as module
    assert_one_line(cli(module, capsys, *argv), 2, "error:", "(see --help)")


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 cut short", "head"])
def test_damaged_npz_is_one_line_and_writes_nothing(content, tmp_path, capsys):
    src = tmp_path / "in.npz"
    src.write_bytes(sample("mixed_features", ".npz").read_bytes()[:300] if content == "head" else content)
    result = cli(npz_to_tfrecord, capsys, src, "-o", tmp_path / "o.tfrecords")
    assert_one_line(result, 1, str(src), "damaged or not an npz")
    assert sorted(os.listdir(tmp_path)) == ["in.npz"]


def test_npy_given_to_npz_to_tfrecord_is_named(tmp_path, capsys):
    src = tmp_path / "in.npz"
    with open(src, "wb") as f:
        np.save(f, np.zeros(3, np.float32))
    result = cli(npz_to_tfrecord, capsys, src, "-o", tmp_path / "o.tfrecords")
    assert_one_line(result, 2, str(src), "is a .npy file")
    assert sorted(os.listdir(tmp_path)) == ["in.npz"]


@pytest.mark.parametrize("module, source", [(tfrecord_to_npz, ("mnist_t10k_head1000", ".tfrecords")),
                                            (npz_to_tfrecord, ("mixed_features", ".npz"))])
def test_output_that_is_a_folder_is_refused(module, source, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert_one_line(cli(module, capsys, sample(*source), "-o", out), 2, f"-o {out} is a directory: give a file path")
    assert os.listdir(out) == [] and hidden(tmp_path) == []


@pytest.mark.parametrize("module, source", [(tfrecord_to_npz, ("mnist_t10k_head1000", ".tfrecords")),
                                            (npz_to_tfrecord, ("mixed_features", ".npz"))])
def test_output_inside_a_file_names_the_file(module, source, tmp_path, capsys):
    blocker = tmp_path / "F"
    blocker.write_bytes(b"keep me")
    result = cli(module, capsys, sample(*source), "-o", blocker / "x.out")
    assert_one_line(result, 2, str(blocker), "is a file")
    assert blocker.read_bytes() == b"keep me" and hidden(tmp_path) == []


@pytest.mark.parametrize("module, argv, text", [
    (tfrecord_to_npz, ["DIR", "-o", "x.npz"], "is a folder"),
    (npz_to_tfrecord, ["DIR", "-o", "x.tfrecords"], "is a folder"),
    (npz_to_tfrecord, ["missing.npz", "-o", "x.tfrecords"], "no such file"),
])
def test_input_that_is_a_folder_or_missing(module, argv, text, tmp_path, capsys):
    (tmp_path / "DIR").mkdir()
    result = cli(module, capsys, *[str(tmp_path / a) if a != "-o" else a for a in argv])
    assert_one_line(result, 2, text)
    assert sorted(os.listdir(tmp_path)) == ["DIR"]


@pytest.mark.parametrize("lengths, text", [([1, 1], "has 2 entries, x.present 3"), ([3, -1, 0], "negative length")])
def test_npz_whose_lengths_disagree_is_a_layout_error(lengths, text, tmp_path, capsys):
    """Lengths that do not fit the rows failed mid-write (IndexError) or sliced the values wrongly."""
    src = tmp_path / "in.npz"
    np.savez(src, **{"x.present": np.ones(3, np.uint8), "x.values": np.arange(2, dtype=np.int64),
                     "x.row_lengths": np.array(lengths, np.int64)})
    assert_one_line(cli(npz_to_tfrecord, capsys, src, "-o", tmp_path / "o.tfrecords"), 2, str(src), text)
    assert sorted(os.listdir(tmp_path)) == ["in.npz"]


# --- 6. an output that exists, an empty or impossible -o, a read-only folder --------------------------

def _image_folder(root):
    """root/cat/0.png, root/cat/1.png, root/dog/0.png: 4x4 grey PNGs."""
    from towers.data.image import codec

    for name, k in (("cat", 0), ("cat", 1), ("dog", 0)):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / f"{k}.png").write_bytes(codec.encode(np.full((4, 4, 1), 40 * k, np.uint8), "png"))
    return root


def _converters(tmp_path):
    """(module, input) of each converter."""
    from tools import images_to_tfrecord

    return [(tfrecord_to_npz, sample("mixed_features")), (npz_to_tfrecord, sample("mixed_features", ".npz")),
            (images_to_tfrecord, _image_folder(tmp_path / "photos"))]


def test_converters_write_no_file_over_another(tmp_path, capsys):
    # Before: each converter replaced an existing -o silently, exit 0 (towers.export and eval --predict refuse).
    for module, source in _converters(tmp_path):
        out = tmp_path / "taken"
        out.write_bytes(b"keep me")
        name = module.__name__.split(".")[-1]
        assert_one_line(cli(module, capsys, source, "-o", out), 2,
                        f"{name}: error: {out} exists: {name} writes no file over another; remove it or choose "
                        "another -o")
        assert out.read_bytes() == b"keep me" and hidden(tmp_path) == []


def test_images_to_tfrecord_never_writes_over_an_image_of_its_folder(tmp_path, capsys):
    # Before: -o photos/cat/1.png replaced that image with the records, exit 0.
    from tools import images_to_tfrecord

    photos = _image_folder(tmp_path / "photos")
    image = photos / "cat" / "1.png"
    before = image.read_bytes()
    assert_one_line(cli(images_to_tfrecord, capsys, photos, "-o", image), 2,
                    f"{image} is the same file as the input {image}: writing it would destroy the input")
    assert image.read_bytes() == before


@pytest.mark.parametrize("shards", ["1", "2"])
def test_an_empty_output_is_refused(shards, tmp_path, capsys, monkeypatch):
    # Before: images_to_tfrecord -o '' exited 1 naming a temporary path; with --shards 2 it wrote
    # -00000-of-00002 and -00001-of-00002 into the current folder, exit 0.
    monkeypatch.chdir(tmp_path)
    for module, source in _converters(tmp_path):
        extra = ["--shards", shards] if module.__name__.endswith("images_to_tfrecord") else []
        assert_one_line(cli(module, capsys, source, "-o", "", *extra), 2, "error: -o is empty: give the output "
                                                                           "file's path")
    assert sorted(os.listdir(tmp_path)) == ["photos"]


@pytest.mark.parametrize("tail", ["/", "/."])
def test_an_output_that_names_a_folder_not_there_is_refused_before_reading(tail, tmp_path, capsys):
    # Before: -o new/ (a folder path that does not exist) read the whole input, then exited 1 naming a hidden
    # temporary file ("..tmp-4130-avej0dia/output.partial: Not a directory; check ... free space"); towers.export
    # and eval --predict said "Not a directory [ENOTDIR]: ... make <its parent> writable".
    for module, source in _converters(tmp_path):
        out = f"{tmp_path / 'new'}{tail}"
        assert_one_line(cli(module, capsys, source, "-o", out), 2,
                        f"error: -o {out} names a folder, not a file: give a file path, for example "
                        f"{os.path.join(tmp_path / 'new', '')}")
    assert sorted(os.listdir(tmp_path)) == ["photos"]
    # Shards of a folder's path: before, -o new/ --shards 2 into an existing folder wrote new/-00000-of-00002 and
    # new/-00001-of-00002, exit 0.
    from tools import images_to_tfrecord

    (tmp_path / "new").mkdir()
    out = f"{tmp_path / 'new'}{tail}"
    assert_one_line(cli(images_to_tfrecord, capsys, tmp_path / "photos", "-o", out, "--shards", "2"), 2,
                    f"error: -o {out} is a directory: give a file path, for example "
                    f"{os.path.join(out, 'out.tfrecords')}")
    assert os.listdir(tmp_path / "new") == []


def test_an_output_name_too_long_for_its_folder_is_refused_before_reading(tmp_path, capsys):
    # Before: each converter read its input, then exited 1 naming a hidden temporary file (".aaa...tmp-5191-x4e4lozm/
    # output.partial: File name too long; check the path, its permissions and free space").
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    out = tmp_path / ("a" * (limit + 1))
    for module, source in _converters(tmp_path):
        assert_one_line(cli(module, capsys, source, "-o", out), 2,
                        f"error: cannot write {out}: its name is {limit + 1} bytes, more than the {limit} that "
                        f"{tmp_path} takes; choose a shorter -o")
    assert sorted(os.listdir(tmp_path)) == ["photos"]


def test_an_output_below_a_file_names_the_file(tmp_path, capsys):
    # Before: images_to_tfrecord -o file.npz/x said "the folder .../file.npz does not exist; create it first".
    from tools import images_to_tfrecord

    blocker = tmp_path / "file.npz"
    blocker.write_bytes(b"keep me")
    assert_one_line(cli(images_to_tfrecord, capsys, _image_folder(tmp_path / "photos"), "-o", blocker / "x"), 2,
                    f"cannot write {blocker / 'x'}: {blocker} is a file, not a folder; choose another -o")
    assert blocker.read_bytes() == b"keep me"


@pytest.fixture
def read_only(tmp_path):
    """A folder that refuses new files: a read-only tmpfs as root, else a folder without write permission."""
    point = tmp_path / "ro"
    point.mkdir()
    if os.geteuid() != 0:
        point.chmod(0o500)
        try:
            yield point, "[EACCES]"
        finally:
            point.chmod(0o700)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(point)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield point, "Read-only file system [EROFS]"
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_a_read_only_folder_is_named_as_export_names_it(read_only, tmp_path, capsys):
    # Before: exit 1, "error: /.../.OUT.tmp-PID-XXXXXXXX: Read-only file system; check the path, its permissions
    # and free space" (a hidden temporary path); towers.export says "cannot write OUT ... [EROFS]", exit 2.
    folder, reason = read_only
    for module, source in _converters(tmp_path):
        out = folder / "out"
        assert_one_line(cli(module, capsys, source, "-o", out), 2,
                        f"error: cannot write {out}: ", f"{reason}: choose another -o, or make {folder} writable")
        assert os.listdir(folder) == []
