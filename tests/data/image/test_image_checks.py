"""Image input checks: test labels that mean the training labels' classes, crops clipped to the decoded
image, damaged PNGs and oversized JPEGs refused, scripts without the ``__main__`` guard, and the small ones
(worker count, the resource tracker's warning, a closed data set, a file that is no TFRecord)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.data.image.test_images import DECODE, _folder, _images, _records
from towers.data.image import codec
from towers.data.loading import load_dataset
from towers.errors import UserError


# -- 1: a test folder's labels ------------------------------------------------------------------------------


def _numbered_folder(root, x, y, skip=()):
    """An image folder whose class folders are the label numbers, leaving out the classes in ``skip``."""
    keep = ~np.isin(y, skip)
    return _folder(root, x[keep], y[keep], names=[str(k) for k in range(int(y.max()) + 1)])


def test_a_test_folder_beside_an_npz_is_labelled_by_its_folders_numbers(tmp_path):
    x, y = _images(60)  # classes 0, 1, 2
    np.savez(tmp_path / "train.npz", x=x, y=y)
    test = _numbered_folder(tmp_path / "test", x, y, skip=[1])  # class folder 1 missing: 2 must stay 2
    ds = load_dataset(str(tmp_path / "train.npz"), test_path=test, workers=0)
    try:
        assert np.array_equal(np.sort(ds.y_test), np.sort(y[y != 1]))
        assert set(ds.y_test.tolist()) == {0, 2}
    finally:
        ds.close()
    records = _records(tmp_path / "train.tfrecords", x, y)  # the same beside TFRecord training data
    ds = load_dataset(records, "image/encoded", "image/class/label", test_path=test, decode=DECODE, workers=0)
    try:
        assert set(ds.y_test.tolist()) == {0, 2} and np.array_equal(np.sort(ds.y_test), np.sort(y[y != 1]))
    finally:
        ds.close()
    test = _numbered_folder(tmp_path / "test7", x, np.where(y == 2, 7, y))
    r = run_cli("--data", str(tmp_path / "train.npz"), "--test-data", test, "--devices", "cpu", "--steps", "1",
                "--logdir", str(tmp_path / "a"))
    assert r.returncode == 2 and "class folders the training data lacks: 7" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    test = _folder(tmp_path / "named", x, y)  # cat, dog, emu: nothing says which number each one is
    r = run_cli("--data", str(tmp_path / "train.npz"), "--test-data", test, "--devices", "cpu", "--steps", "1",
                "--logdir", str(tmp_path / "b"))
    assert r.returncode == 2 and "cat, dog, emu cannot be matched" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_test_folder_beside_a_training_folder_matches_by_name(tmp_path):
    x, y = _images(60)
    train = _folder(tmp_path / "train", x, y)
    test = _folder(tmp_path / "test", x[y != 1], y[y != 1])  # no dog: emu must stay label 2
    ds = load_dataset(train, test_path=test, workers=0)
    try:
        assert ds.class_names == ["cat", "dog", "emu"] and set(ds.y_test.tolist()) == {0, 2}
    finally:
        ds.close()
    with pytest.raises(UserError, match="class folders the training data lacks: owl"):
        load_dataset(train, test_path=_folder(tmp_path / "owls", x, y, names=("cat", "dog", "owl")), workers=0)


def test_numbered_test_labels_beside_a_training_folder_need_numbered_classes(tmp_path):
    x, y = _images(60)
    np.savez(tmp_path / "test.npz", x=x, y=y)
    numbered = _numbered_folder(tmp_path / "train", x, y)
    ds = load_dataset(numbered, test_path=str(tmp_path / "test.npz"), workers=0)
    try:
        assert np.array_equal(ds.y_test, y)
    finally:
        ds.close()
    with pytest.raises(UserError, match="numbered labels, but the training classes are the folders cat, dog, emu"):
        load_dataset(_folder(tmp_path / "named", x, y), test_path=str(tmp_path / "test.npz"), workers=0)


# -- 5: crops clipped to the decoded image -------------------------------------------------------------------


def _odd_images(n=48):
    """Encoded images 17 to 97 pixels a side: colour and grey JPEGs, colour and grey PNGs, and a PNG where
    a JPEG would be expected (the format comes from the bytes)."""
    rng = np.random.default_rng(5)
    out = []
    for k in range(n):
        h, w = (int(v) for v in rng.integers(17, 98, 2))
        pixels = rng.integers(0, 256, (h, w, 1 if k % 3 == 2 else 3), np.uint8)
        out.append(codec.encode(pixels, "png" if k % 4 == 3 else "jpeg"))
    return out


@pytest.mark.parametrize("augment", ["none", "cifar", "tf-cifar10", "imagenet"])
def test_every_augmentation_makes_small_odd_grey_and_png_images(augment):
    from towers.data.image.augment import Transform, uniforms

    data = _odd_images()
    for size in ((32, 32, 3), (24, 28, 1), (224, 224, 3)):
        transform = Transform(size, augment, seed=3)
        indices = np.arange(20 * len(data))  # 20 draws (seeds of the example's randomness) per image
        u = uniforms(3, np.zeros(len(indices), np.int64), indices, transform.draws) if transform.draws else None
        for i in indices:
            out = transform(data[i % len(data)], None if u is None else u[i])
            assert out.shape == transform.shape and out.dtype == transform.dtype
        for example in data:  # evaluation
            assert transform(example).shape == transform.shape


# -- 3: a PNG whose checksums fail ---------------------------------------------------------------------------


def _damaged(png: bytes, chunk: bytes, at: int) -> bytes:
    """``png`` with one bit flipped at byte ``at`` of ``chunk``'s data (``at`` = its length: in the CRC)."""
    start = png.index(chunk) + 4
    out = bytearray(png)
    out[start + at] ^= 0x01
    return bytes(out)


def test_a_png_whose_chunk_crc_fails_is_refused_or_skipped_and_counted(tmp_path):
    from towers.errors import TrainingError

    x, y = _images(12)
    png = codec.encode(x[4][:, :, None], "png")
    idat = int.from_bytes(png[png.index(b"IDAT") - 4:png.index(b"IDAT")], "big")
    # The CRC itself damaged (PngSuite's xcsn0g01.png): the pixels still inflate, and decoded as if whole.
    for damaged in (_damaged(png, b"IDAT", idat), _damaged(png, b"IDAT", idat // 2)):
        with pytest.raises(codec.ImageError, match="^damaged PNG: CRC of chunk IDAT fails$"):
            codec.decode(damaged, 1)
    with pytest.raises(codec.ImageError, match="^damaged PNG: CRC of chunk IHDR fails$"):
        codec.decode(_damaged(png, b"IHDR", 3), 1)  # was "not an image (... bytes starting 89504e47)"
    root = _folder(tmp_path / "f", x, y)
    victim = os.path.join(root, "dog", "004.png")
    assert open(victim, "rb").read() == png
    open(victim, "wb").write(_damaged(png, b"IDAT", idat))
    ds = load_dataset(root, workers=0)
    try:
        with pytest.raises(TrainingError, match="004.png: not a decodable image: damaged PNG: CRC of chunk IDAT"):
            ds.x[0:12]
    finally:
        ds.close()
    ds = load_dataset(root, workers=0, on_error="skip")
    try:
        assert ds.x[0:12].shape == (12, 12, 12, 1) and ds.x.skipped == 1
    finally:
        ds.close()


# -- 8: the decompression-bomb limit -------------------------------------------------------------------------


def test_the_decompression_bomb_limit_holds_for_jpeg_as_for_png(monkeypatch):
    from PIL import Image

    pixels = np.full((40, 50, 3), 128, np.uint8)
    jpeg, png = codec.encode(pixels, "jpeg"), codec.encode(pixels, "png")
    assert codec.decode(jpeg, 3).shape == codec.decode(png, 3).shape == (40, 50, 3)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40 * 50 - 1)  # the limit, scaled down to this image
    line = r"too large to decode \(40 x 50 = 2,000 pixels, over the decompression-bomb limit of 1,999 pixels\)"
    with pytest.raises(codec.ImageError, match=line):
        codec.decode(jpeg, 3)
    # Before: a PNG got Pillow's text ("Image size (2000 pixels) exceeds limit of 1999 pixels, could be
    # decompression bomb DOS attack."), a JPEG the line above; each, its header read or decoded, gets the line.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40 * 50 // 2 - 1)  # past twice the limit: Pillow's error
    for read in (codec.size, lambda data: codec.decode(data, 3)):
        with pytest.raises(codec.ImageError, match=line.replace("1,999", "999")):
            read(png)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40 * 50 - 1)  # within twice the limit: Pillow's warning
    with pytest.raises(codec.ImageError, match=line):
        codec.decode(png, 3)
    with pytest.raises(codec.ImageError, match="too large to decode"):
        codec.decode(jpeg, 1, (8, 8))  # a DCT-scaled decode is refused by the stored size too


# -- 9: what an image folder holds ------------------------------------------------------------------------


def test_images_below_a_class_folder_are_its_images(tmp_path):
    # Before: DIR/cat/2020/x.png was ignored, exit 0, training on a subset (torchvision's ImageFolder reads it).
    from towers.data.image import folder

    x, y = _images(9)
    root = tmp_path / "f"
    _folder(root, x[:6], y[:6])
    (root / "cat" / "2020" / "deeper").mkdir(parents=True)
    (root / "cat" / "2020" / "a.png").write_bytes(codec.encode(x[6][:, :, None], "png"))
    (root / "cat" / "2020" / "deeper" / "b.png").write_bytes(codec.encode(x[7][:, :, None], "png"))
    (root / "cat" / "zz.png").write_bytes(codec.encode(x[8][:, :, None], "png"))
    classes, paths, labels = folder.scan(str(root))
    assert classes == ["cat", "dog", "emu"]
    names = [os.path.relpath(p, root) for p in paths]
    assert names == ["cat/000.png", "cat/003.png", "cat/2020/a.png", "cat/2020/deeper/b.png", "cat/zz.png",
                     "dog/001.png", "dog/004.png", "emu/002.png", "emu/005.png"]
    assert labels.tolist() == [0, 0, 0, 0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("case", ["loose image", "dangling link", "link loop", "folder link loop"])
def test_an_image_folder_that_would_train_on_a_subset_or_loop_is_one_line(tmp_path, case):
    # Before: an image loose in DIR and a dangling .png link were skipped silently (exit 0); a link loop gave
    # "Too many levels of symbolic links; check the path, its permissions and free space", exit 1.
    x, y = _images(6)
    root = tmp_path / "f"
    _folder(root, x, y)
    if case == "loose image":
        (root / "stray.png").write_bytes(codec.encode(x[0][:, :, None], "png"))
        expected = f"--data {root} holds 1 image(s) outside any class folder (stray.png): expected {root}/<class>/"
    elif case == "dangling link":
        (root / "dog" / "gone.png").symlink_to(tmp_path / "nowhere.png")
        expected = f"image {root}/dog/gone.png cannot be read (No such file or directory)"
    elif case == "link loop":
        (root / "dog" / "self.png").symlink_to(root / "dog" / "self.png")
        expected = f"image {root}/dog/self.png cannot be read (Too many levels of symbolic links)"
    else:
        (root / "dog" / "up").symlink_to(root)
        expected = f"--data: folder {root}/dog/up/dog cannot be read: it is a symbolic link to a folder that holds it"
    r = run_cli("--data", str(root), "--devices", "cpu", "--steps", "1", "--logdir", str(tmp_path / "run"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and expected in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("content", ["images", "nothing"])
def test_a_folder_without_class_folders_names_the_image_folder_layout(tmp_path, content):
    # Before: "data file D is a directory: set --data to an .npz or TFRecord file", for a flat folder of images
    # too, without the DIR/<class>/ layout.
    x, y = _images(3)
    root = tmp_path / "flat"
    root.mkdir()
    if content == "images":
        for i in range(3):
            (root / f"{i}.png").write_bytes(codec.encode(x[i][:, :, None], "png"))
        expected = f"--data {root} holds 3 image(s) outside any class folder (0.png, 1.png, 2.png): expected {root}/"
    else:
        expected = (f"data file {root} is a directory: set --data to an .npz or TFRecord file, or to an image folder "
                    f"{root}/<class>/*.jpg")
    r = run_cli("--data", str(root), "--devices", "cpu", "--steps", "1", "--logdir", str(tmp_path / "run"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and expected in r.stderr, r.stderr
    assert "<class>" in r.stderr


# -- 11: small ones ------------------------------------------------------------------------------------------


def test_input_workers_above_the_cores_are_capped_with_a_notice(notices):
    from towers.devices.cpu_threads import cpu_count, input_workers

    cores = cpu_count()
    assert input_workers(cores, 0) == cores and not notices
    assert input_workers(cores + 62, 0) == cores
    assert len(notices) == 1 and f"input_workers {cores + 62} is more than the {cores} cores" in notices[0]


def test_a_killed_driver_leaves_no_shared_memory_and_no_tracker_warning(tmp_path):
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.data.image.test_images import _DRIVER

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm to look at")
    x, y = _images()
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, _records(tmp_path / "d.tfrecords", x, y), DECODE],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        driver.stdout.readline()  # the children: started
        blocks = {name for name in driver.stdout.readline().split() if name.startswith(f"towers-{driver.pid}-")}
        assert blocks
    finally:
        driver.send_signal(signal.SIGKILL)
    _, err = driver.communicate(timeout=60)  # stderr ends once the workers and the resource tracker are gone
    assert not blocks & set(os.listdir("/dev/shm")), "shared memory left behind"
    assert "leaked" not in err and "resource_tracker" not in err, err


def test_an_image_data_set_used_after_close_says_it_is_closed(tmp_path):
    x, y = _images(12)
    root = _folder(tmp_path / "f", x, y)
    for workers in (0, 1):
        ds = load_dataset(root, workers=workers)
        assert ds.x[0:2].shape == (2, 12, 12, 1)
        ds.x.close()
        with pytest.raises(UserError, match="the image data set is closed"):
            ds.x[0:2]


# -- 6: a script without the __main__ guard ------------------------------------------------------------------

_UNGUARDED = """
import sys
import towers
print("body", flush=True)
cfg = towers.Config(devices="cpu", data=sys.argv[1], steps=2, batch_size=4, input_workers=1, logdir=sys.argv[2])
with towers.Trainer(cfg) as tr:
    tr.fit()
"""

_HALF_GUARDED = """
import sys
from towers.data.loading import load_dataset
print("body", flush=True)
ds = load_dataset(sys.argv[1], workers=2)
ds.x[0:4]  # outside the guard: run again in each worker
if __name__ == "__main__":
    print("done", flush=True)
"""


@pytest.mark.parametrize("script", [_UNGUARDED, _HALF_GUARDED], ids=["no-guard", "spawn-outside-the-guard"])
def test_a_script_that_starts_workers_outside_the_main_guard_is_told_so(tmp_path, script):
    import subprocess
    import sys

    from tests.conftest import REPO

    x, y = _images(12)
    root = _folder(tmp_path / "f", x, y)
    (tmp_path / "train.py").write_text(script)
    r = subprocess.run([sys.executable, str(tmp_path / "train.py"), root, str(tmp_path / "run")], cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("towers.errors.UserError: input workers start with spawn, which runs ") and \
        'under \'if __name__ == "__main__":\'' in last, r.stderr
    assert "process died" not in r.stderr and "bootstrapping" not in r.stderr, r.stderr
    if script is _UNGUARDED:  # refused before any worker started: the body ran once
        assert r.stdout.splitlines().count("body") == 1


def test_a_file_that_is_no_tfrecord_is_not_announced_as_being_indexed(tmp_path):
    from towers.data.tfrecord.framing import TFRecordError
    from towers.data.tfrecord.records import file_index

    x, y = _images(6)
    png = tmp_path / "F.png"
    png.write_bytes(codec.encode(x[0][:, :, None], "png"))
    said = []
    with pytest.raises((TFRecordError, UserError), match="not a TFRecord file"):
        file_index(str(png), say=said.append)
    assert not said
    r = run_cli("--data", str(png), "--devices", "cpu", "--steps", "1", "--logdir", str(tmp_path / "a"))
    assert r.returncode == 2 and "not a TFRecord file" in r.stderr and "indexing" not in r.stderr, r.stderr
    records = tmp_path / "d.tfrecords"  # a real one is still announced
    _records(records, x, y)
    file_index(str(records), say=said.append)
    assert len(said) == 1 and said[0].startswith(f"indexing {records} (")


def test_a_block_is_never_registered_with_the_resource_tracker(monkeypatch):
    # Registered and then unregistered, a block has a window in which a killed process leaves it with the
    # tracker, which then prints its 'leaked shared_memory objects' warning: it must never be registered.
    from multiprocessing import resource_tracker

    from towers.data.orphans import SHM_DIR, unlink, untracked_block

    if not os.path.isdir(SHM_DIR):
        pytest.skip("no /dev/shm: blocks stay with the tracker there")
    registered = []
    monkeypatch.setattr(resource_tracker, "register", lambda name, rtype: registered.append(name))
    made = untracked_block(f"towers-test-{os.getpid()}-untracked", create=True, size=64)
    try:
        untracked_block(made.name).close()  # attached, as a worker does
    finally:
        unlink(made)
        made.close()
    assert registered == []


def test_stored_images_of_other_channels_than_the_runs_are_one_line_before_training(tmp_path):
    # Before: colour (N, H, W, 3) test arrays beside grey training images passed the loader and ended the run at
    # its first evaluation, after training, with "ValueError: could not broadcast input array from shape
    # (12,12,3) into shape (12,12,1)" (exit 1); towers.eval and eval --predict of such an npz did the same.
    x, y = _images(30)
    train = _numbered_folder(tmp_path / "train", x, y)
    np.savez(tmp_path / "rgb.npz", x=np.repeat(x[..., None], 3, axis=3), y=y)
    want = (r"rgb.npz: the images have 3 channels but the run's have 1 \(12, 12, 1\): give images of 1 "
            r"channel \(N, H, W, 1\) or \(N, H, W\)")
    with pytest.raises(UserError, match=want):
        load_dataset(train, test_path=str(tmp_path / "rgb.npz"), workers=0)
    r = run_cli("--data", train, "--test-data", str(tmp_path / "rgb.npz"), "--devices", "cpu", "--steps", "1",
                "--logdir", str(tmp_path / "run"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists()  # refused before the logdir is made


def test_a_class_folder_named_like_an_image_is_a_class_to_labelled_as_to_scan(tmp_path):
    # labelled() (eval --predict: labelled or not) and scan() tell an image of the folder's own the same way
    # (one rule, folder.has_loose_images).  Before: a class folder "b.png" was a loose image to labelled(), so
    # --predict of this labelled folder predicted it as unlabelled images.
    from towers.data.image.folder import scan
    from towers.data.loading import labelled
    from towers.data.pipeline import describe

    x, y = _images(6)
    root = _folder(tmp_path / "d", x, y, names=("a", "b.png", "c"))
    assert scan(root)[0] == ["a", "b.png", "c"]
    assert labelled(describe(root))
    (tmp_path / "d" / "loose.png").write_bytes(codec.encode(x[0][:, :, None], "png"))
    assert not labelled(describe(root))
