"""Image input: decoding against TensorFlow, the ImageNet layout, image folders, augmentation that does not
depend on the workers and resumes exactly, damaged images, and workers and shared memory that end with a
killed run."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO, run_cli, shared_file
from towers import Config, Trainer
from towers.data.image import codec, folder
from towers.data.image.augment import Transform, uniforms
from towers.data.image.to_tfrecord import example
from towers.data.loading import load_dataset
from towers.data.tfrecord.framing import TFRecordWriter
from towers.errors import TrainingError, UserError

DECODE = "image/encoded:image:12,12,1"
FLAGS = ("--x-key", "image/encoded", "--y-key", "image/class/label", "--decode", DECODE)


def _images(n=60, size=12, seed=0):
    """Little images whose class shows in them (a bright square's corner), uint8 (n, size, size)."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    x = rng.integers(0, 60, (n, size, size), np.uint8)
    for i, label in enumerate(y):
        r = 0 if label == 0 else size // 2
        c = 0 if label != 2 else size // 2
        x[i, r:r + size // 2, c:c + size // 2] += 150
    return x, y


def _records(path, x, y, fmt="jpeg", bad=()):
    """TFRecord of x (uint8 (n, h, w)) in the ImageNet layout; rows in ``bad`` hold bytes that are no image."""
    with open(path, "wb") as f, TFRecordWriter(f, "none") as w:
        for i, (img, label) in enumerate(zip(x, y)):
            data = b"\xff\xd8\xff\xe0 not really a jpeg" if i in bad else codec.encode(img[:, :, None], fmt)
            w.write(example(data, int(label), img.shape + (1,)))
    return str(path)


def _folder(root, x, y, names=("cat", "dog", "emu")):
    for i, (img, label) in enumerate(zip(x, y)):
        os.makedirs(root / names[label], exist_ok=True)
        (root / names[label] / f"{i:03d}.png").write_bytes(codec.encode(img[:, :, None], "png"))
    return str(root)


def _md5(path):
    return hashlib.md5(open(path, "rb").read()).hexdigest()


# -- decoding ------------------------------------------------------------------------------------------------


def _tf_samples(name):
    """(encoded bytes, TensorFlow's decoded pixels) of a shared sample file."""
    from towers.data.sources import RecordSource
    from towers.data.tfrecord.index import file_index, positions

    path = str(shared_file("image-samples", f"{name}.tfrecords"))
    index = file_index(path)
    source = RecordSource([path], "image/encoded", *positions([index]))
    with np.load(shared_file("image-samples", f"{name}.npz")) as z:
        return [source.read(r) for r in source.refs(range(len(source)))], z["x"]


def test_png_pixels_equal_tensorflows_decode_png():
    data, tf_pixels = _tf_samples("mnist_png_head500")
    ours = np.stack([codec.decode(d, 1) for d in data])
    assert ours.shape == tf_pixels.shape == (500, 28, 28, 1)
    assert np.array_equal(ours, tf_pixels)


def test_jpeg_pixels_match_tensorflows_decode_jpeg():
    data, tf_pixels = _tf_samples("mnist_jpeg_head500")
    ours = np.stack([codec.decode(d, 3) for d in data]).astype(int)
    assert ours.shape == tf_pixels.shape == (500, 28, 28, 3)
    diff = np.abs(ours - tf_pixels)
    # libjpeg-turbo with TensorFlow's IDCT (integer fast) and upsampling: identical here; decoders may differ.
    assert diff.mean() < 0.5 and diff.max() <= 12


def test_format_comes_from_the_bytes_and_channels_convert():
    rgb = np.zeros((8, 10, 3), np.uint8)
    rgb[..., 0] = 200
    png = codec.encode(rgb, "png")
    assert codec.sniff(png) == "png" and codec.size(png) == (8, 10, 3)
    assert codec.decode(png, 3).shape == (8, 10, 3) and np.array_equal(codec.decode(png, 3), rgb)
    grey = codec.decode(png, 1)
    assert grey.shape == (8, 10, 1) and 50 < grey.mean() < 70  # luma of pure red ~ 0.3 * 200
    from PIL import Image
    import io

    cmyk = io.BytesIO()
    Image.new("CMYK", (6, 4), (0, 255, 255, 0)).save(cmyk, "JPEG")  # red in CMYK
    out = codec.decode(cmyk.getvalue(), 3)
    assert out.shape == (4, 6, 3) and out[..., 0].mean() > 200 and out[..., 1].mean() < 60
    with pytest.raises(codec.ImageError):
        codec.decode(b"GIF89a but cut", 3)


# -- the ImageNet layout, folders --------------------------------------------------------------------------


def test_imagenet_layout_trains_with_the_decode_flag_and_is_proposed(tmp_path):
    x, y = _images()
    path = _records(tmp_path / "train.tfrecords", x, y + 1)  # ImageNet counts labels from 1
    ds = load_dataset(path, "image/encoded", "image/class/label", decode=DECODE, workers=0)
    try:
        assert ds.x.shape == (60, 12, 12, 1) and ds.x.dtype == np.uint8 and ds.num_classes == 4
        assert np.abs(ds.x[0:5].astype(int) - x[:5, :, :, None]).mean() < 4  # JPEG; evaluation path: no crop
    finally:
        ds.close()
    with pytest.raises(UserError, match="encoded images: train from them with x_key image/encoded y_key "
                                        "image/class/label decode image/encoded:image:12,12,1"):
        load_dataset(path)


def test_tf_written_jpeg_records_train_from_the_command_line(tmp_path):
    path = shared_file("image-samples", "mnist_jpeg_head500.tfrecords")
    r = run_cli("--data", str(path), "--x-key", "image/encoded", "--y-key", "image/class/label",
                "--decode", "image/encoded:image:28,28,1", "--devices", "cpu", "--steps", "3",
                "--batch-size", "50", "--logdir", str(tmp_path / "run"), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "no test data" in r.stdout


def test_image_folder_classes_sizes_and_test_folder(tmp_path):
    x, y = _images(30)
    train = _folder(tmp_path / "train", x, y)
    test = _folder(tmp_path / "test", x[:9], y[:9])
    ds = load_dataset(train, test_path=test, workers=0)
    try:
        assert ds.class_names == ["cat", "dog", "emu"] and ds.x.shape == (30, 12, 12, 1)
        assert np.array_equal(np.sort(ds.y), np.sort(y)) and len(ds.x_test) == 9
        assert np.array_equal(ds.x[np.arange(3)][:, :, :, 0], x[[0, 3, 6]])  # class order: cat's files first
    finally:
        ds.close()
    ds = load_dataset(train, image_size="8,8,3", workers=0)
    assert ds.x.shape == (30, 8, 8, 3)
    ds.close()
    r = run_cli("--data", train, "--test-data", test, "--devices", "cpu", "--steps", "4", "--batch-size", "10",
                "--logdir", str(tmp_path / "run"), "--quiet", "--checkpoint-every", "2")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "classes.txt").read_text() == "cat\ndog\nemu\n"
    r = run_cli("--logdir", str(tmp_path / "run"), module="towers.eval")
    assert r.returncode == 0, r.stderr
    assert "classes 0 cat, 1 dog, 2 emu" in r.stdout


def test_the_fingerprint_of_image_data_is_of_its_stored_files_not_of_the_decoded_cache(tmp_path):
    """What a checkpoint records of on-demand data (towers.data.fingerprint): the files' names and a sample of
    their bytes, the records' CRCs; the same whether the decoded-image cache holds them or not."""
    import shutil

    x, y = _images(30)

    def fingerprint(path, **kw):
        ds = load_dataset(str(path), workers=0, **kw)
        try:
            return ds.fingerprint
        finally:
            ds.close()
    root = _folder(tmp_path / "imgs", x, y)
    folder = fingerprint(root)
    assert folder["count"] == 30 and folder["dtype"] == "uint8"
    assert fingerprint(root, cache_mib=64) == folder
    moved = tmp_path / "moved"
    os.rename(root, moved)
    assert fingerprint(moved) == folder  # a moved folder is the same data
    (moved / "cat" / "000.png").write_bytes(codec.encode(255 - x[0][:, :, None], "png"))  # another image, same name
    changed = fingerprint(moved)
    assert changed["labels"] == folder["labels"] and changed["examples"] != folder["examples"]
    records = _records(tmp_path / "d.tfrecords", x, y)
    keys = dict(x_key="image/encoded", y_key="image/class/label", decode=DECODE)
    stored = fingerprint(records, **keys)
    assert fingerprint(records, cache_mib=64, **keys) == stored
    shutil.copy(records, tmp_path / "copy.tfrecords")
    assert fingerprint(tmp_path / "copy.tfrecords", **keys) == stored
    _records(tmp_path / "other.tfrecords", x[::-1], y[::-1])  # the same records in another order
    other = fingerprint(tmp_path / "other.tfrecords", **keys)
    assert other["labels"] != stored["labels"] and other["examples"] != stored["examples"]


def test_folder_mistakes_are_one_line(tmp_path):
    x, y = _images(6)
    root = tmp_path / "f"
    _folder(root, x, y)
    (root / "empty").mkdir()
    r = run_cli("--data", str(root), "--devices", "cpu", "--steps", "1", "--logdir", str(tmp_path / "a"))
    assert r.returncode == 2 and "empty holds no .jpg, .jpeg or .png images" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    (root / "empty").rmdir()
    (root / "cat" / "big.png").write_bytes(codec.encode(np.zeros((20, 20, 1), np.uint8), "png"))
    with pytest.raises(UserError, match="images differ in size.*give the example shape with image_size"):
        load_dataset(str(root))
    (root / "cat" / "big.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(UserError, match="big.png is not a readable image"):
        load_dataset(str(root))
    (tmp_path / "none" / ".hidden").mkdir(parents=True)
    with pytest.raises(UserError, match="is a directory"):  # no class folder: not an image folder
        load_dataset(str(tmp_path / "none"))
    with pytest.raises(UserError, match="holds no class folders"):
        folder.scan(str(tmp_path / "none"))


# -- augmentation: workers, resume ----------------------------------------------------------------------------


def test_draws_are_a_function_of_seed_epoch_and_index():
    a = uniforms(0, [0, 0, 1], [5, 6, 5], 4)
    assert np.array_equal(a[0], uniforms(0, [0], [5], 4)[0]) and not np.array_equal(a[0], a[1])
    assert not np.array_equal(a[0], a[2]) and not np.array_equal(a[0], uniforms(1, [0], [5], 4)[0])
    assert 0 <= a.min() and a.max() < 1
    t = Transform((12, 12, 1), "cifar", encoded=False)
    img = np.arange(144, dtype=np.uint8).reshape(12, 12, 1)
    crops = {t(img, u).tobytes() for u in uniforms(0, np.zeros(50), np.arange(50), t.draws)}
    assert len(crops) > 20  # different examples, different crops and flips
    assert t(img).tobytes() == img.tobytes()  # evaluation: unchanged


def _fit(path, logdir, steps, workers, resume=False):
    cfg = Config(data=path, x_key="image/encoded", y_key="image/class/label", decode=DECODE, augment="cifar",
                 devices="cpu", n_gpu=2, batch_size=20, steps=steps, input_workers=workers, logdir=str(logdir),
                 quiet=True, checkpoint_every=3, summary_every=0, resume=resume)
    with Trainer(cfg) as t:
        t.fit()
    return _md5(os.path.join(logdir, "final.npz"))


def test_augmented_training_does_not_depend_on_workers_and_resumes_exactly(tmp_path):
    x, y = _images()
    path = _records(tmp_path / "d.tfrecords", x, y)
    whole = _fit(path, tmp_path / "w0", 7, 0)
    assert _fit(path, tmp_path / "w2", 7, 2) == whole
    _fit(path, tmp_path / "r", 3, 2)
    assert _fit(path, tmp_path / "r", 7, 1, resume=True) == whole
    plain = Config(data=path, x_key="image/encoded", y_key="image/class/label", decode=DECODE, devices="cpu",
                   n_gpu=2, batch_size=20, steps=7, input_workers=0, logdir=str(tmp_path / "plain"), quiet=True,
                   summary_every=0)
    with Trainer(plain) as t:
        t.fit()
    assert _md5(tmp_path / "plain" / "final.npz") != whole  # the augmentation did something


def test_a_cluster_hosts_slices_are_augmented_as_the_one_process_batches(tmp_path):
    from towers.data.batches import BatchSource
    from towers.run.local import Rows

    x, y = _images()
    ds = load_dataset(_records(tmp_path / "d.tfrecords", x, y), "image/encoded", "image/class/label",
                      decode=DECODE, workers=2, augment="cifar")
    try:
        whole = BatchSource(ds, 20, seed=3)
        hosts = [Rows(BatchSource(ds, 20, 3), 0, 12), Rows(BatchSource(ds, 20, 3), 12, 20)]
        for _ in range(4):  # 80 examples: into the second epoch
            xb, yb = whole.next_batch()
            parts = [host.next_batch() for host in hosts]
            assert np.array_equal(np.concatenate([p[0] for p in parts]), xb)
            assert np.array_equal(np.concatenate([p[1] for p in parts]), yb)
        assert not np.array_equal(xb, ds.x[whole.next_indices()])  # augmented, not the evaluation path
    finally:
        ds.close()


# -- damaged images, killed runs --------------------------------------------------------------------------


def test_an_image_that_does_not_decode_mid_run_stops_or_is_skipped(tmp_path):
    x, y = _images()
    path = _records(tmp_path / "bad.tfrecords", x, y, bad={17})
    args = ("--data", path, *FLAGS, "--devices", "cpu", "--n-gpu", "2", "--batch-size", "10", "--steps", "6",
            "--checkpoint-every", "2", "--quiet", "--input-workers", "1")
    r = run_cli(*args, "--logdir", str(tmp_path / "stop"))
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert f"{path}: record 17 at byte offset" in line and "feature 'image/encoded'" in line
    assert "not a decodable image" in line and "--on-error skip" in line
    assert not (tmp_path / "stop" / "final.npz").exists()
    r = run_cli(*args, "--logdir", str(tmp_path / "skip"), "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    assert "skipped" in r.stderr and "record 17" in r.stderr and "1 so far" in r.stderr
    ds = load_dataset(path, "image/encoded", "image/class/label", decode=DECODE, on_error="skip", workers=0,
                      augment="cifar")
    try:
        with pytest.raises(TrainingError, match="record 17"):
            load_dataset(path, "image/encoded", "image/class/label", decode=DECODE, workers=0).x[15:20]
        batch = ds.x.submit(np.array([17, 20]), np.array([0, 0])).examples()
        assert batch.shape == (2, 12, 12, 1) and ds.x.skipped == 1  # 17 replaced by 20, the next of its class
    finally:
        ds.close()


def _pngsuite_corrupt():
    """PngSuite's 14 corrupt files (``x*.png``), remade from valid PNGs that Pillow writes (PngSuite itself is not
    on this machine, and no package on PyPI ships it), name -> bytes.  Each reproduces the damage PngSuite's list
    gives its file, on an image of the same kind (grey 1, 4 or 8 bits, RGB 8 bits; 32 x 32, noise):

    - ``xs1n0g01``: signature byte 1's high bit reset (0x89 -> 0x09); ``xs2n0g01``: signature byte 2 a 'Q' (not
      'P'); ``xs4n0g01``: signature byte 4 lower case ('g'); ``xs7n0g01``: signature byte 7 a space, not ^Z;
    - ``xcrn0g04``: CR bytes added (a text-mode copy: every LF became CR LF); ``xlfn0g04``: LF bytes added (every
      CR became CR LF);
    - ``xhdn0g08``: the IHDR's checksum wrong;
    - ``xc1n0g08``: colour type 1; ``xc9n2c08``: colour type 9 (IHDR's CRC made to match: only the field is bad);
    - ``xd0n2c08``, ``xd3n2c08``, ``xd9n2c08``: bit depth 0, 3 and 99 (CRC matching);
    - ``xdtn0g01``: no IDAT chunk (the pixel data left out);
    - ``xcsn0g01``: the IDAT's checksum wrong.
    """
    import io
    import zlib

    from PIL import Image

    noise = np.random.default_rng(5).integers(0, 256, (32, 32, 3), np.uint8)

    def png(mode, **options):
        out = io.BytesIO()
        Image.fromarray(noise).convert(mode).save(out, "PNG", **options)
        return out.getvalue()

    def chunks(data):  # (offset, type, data length) of each chunk
        at = 8
        while at < len(data):
            n = int.from_bytes(data[at:at + 4], "big")
            yield at, data[at + 4:at + 8], n
            at += 12 + n

    def byte(data, at, value):
        out = bytearray(data)
        out[at] = value
        return bytes(out)

    def ihdr_field(data, field, value):  # IHDR's data begins at 16; its CRC (at 29) recomputed
        out = bytearray(byte(data, 16 + field, value))
        out[29:33] = zlib.crc32(bytes(out[12:29])).to_bytes(4, "big")
        return bytes(out)

    g01, g04, g08, c08 = png("1"), png("L", bits=4), png("L"), png("RGB")
    assert (g01[24:26], g04[24:26], g08[24:26], c08[24:26]) == (b"\x01\x00", b"\x04\x00", b"\x08\x00", b"\x08\x02")
    at, _, n = next(c for c in chunks(g01) if c[1] == b"IDAT")
    return {
        "xs1n0g01": byte(g01, 0, 0x09), "xs2n0g01": byte(g01, 1, ord("Q")), "xs4n0g01": byte(g01, 3, ord("g")),
        "xs7n0g01": byte(g01, 6, 0x20),
        "xcrn0g04": g04.replace(b"\n", b"\r\n"), "xlfn0g04": g04.replace(b"\r", b"\r\n"),
        "xhdn0g08": byte(g08, 29, g08[29] ^ 0x01),
        "xc1n0g08": ihdr_field(g08, 9, 1), "xc9n2c08": ihdr_field(c08, 9, 9),
        "xd0n2c08": ihdr_field(c08, 8, 0), "xd3n2c08": ihdr_field(c08, 8, 3), "xd9n2c08": ihdr_field(c08, 8, 99),
        "xdtn0g01": g01[:8] + b"".join(g01[a:a + 12 + k] for a, t, k in chunks(g01) if t != b"IDAT"),
        "xcsn0g01": byte(g01, at + 8 + n, g01[at + 8 + n] ^ 0x01),
    }


def test_pngsuite_corrupt_files_are_each_one_undecodable_image_line(tmp_path, capsys):
    """Each of PngSuite's corrupt files is an ImageError (xdtn0g01, without IDAT, was an IndexError traceback from
    Pillow's verify); the converter stops at it with one line, and training stops or skips and counts it."""
    from towers.tfrecord_to_npz import main as tfrecord_to_npz

    corrupt = _pngsuite_corrupt()
    assert len(corrupt) == 14
    for name, data in corrupt.items():
        for channels in (1, 3):
            with pytest.raises(codec.ImageError):
                codec.decode(data, channels)
        if name in ("xdtn0g01", "xcsn0g01"):  # whole headers (an image folder reads them first); damaged pixels
            assert codec.size(data) == (32, 32, 1)
        else:
            with pytest.raises(codec.ImageError):
                codec.size(data)
    assert "no IDAT" in str(pytest.raises(codec.ImageError, codec.decode, corrupt["xdtn0g01"], 3).value)
    assert "bit depth 3, colour type 2" in str(pytest.raises(codec.ImageError, codec.decode, corrupt["xd3n2c08"], 3).value)

    good = codec.encode(np.full((32, 32, 3), 90, np.uint8), "png")
    for name, data in corrupt.items():  # the converter, as the issue ran it: one line, exit 1, no output
        path = tmp_path / f"{name}.tfrecords"
        with open(path, "wb") as f, TFRecordWriter(f, "none") as w:
            for image in (good, data, good):
                w.write(example(image, 0, (32, 32, 3)))
        out = tmp_path / f"{name}.npz"
        assert tfrecord_to_npz([str(path), "-o", str(out), "--decode", "image/encoded:image:32,32,3",
                                "--input-workers", "0"]) == 1, name
        err = capsys.readouterr().err
        assert "Traceback" not in err and "record 1: feature 'image/encoded' is not a decodable image" in \
            err.strip().splitlines()[-1], (name, err)
        assert not out.exists() and sorted(os.listdir(tmp_path)) == sorted(
            p.name for p in tmp_path.glob("*.tfrecords*"))

    path = tmp_path / "all.tfrecords"  # training: every corrupt file stops the run, or is skipped and counted
    with open(path, "wb") as f, TFRecordWriter(f, "none") as w:
        for data in corrupt.values():
            w.write(example(data, 0, (32, 32, 3)))
            w.write(example(good, 0, (32, 32, 3)))
    args = (str(path), "image/encoded", "image/class/label")
    with pytest.raises(TrainingError, match="record 0 at byte offset 0: feature 'image/encoded': not a decodable"):
        load_dataset(*args, decode="image/encoded:image:32,32,3", workers=0).x[0:28]
    ds = load_dataset(*args, decode="image/encoded:image:32,32,3", workers=0, on_error="skip")
    try:
        assert ds.x[0:28].shape == (28, 32, 32, 3) and ds.x.skipped == 14
    finally:
        ds.close()


def test_a_damaged_record_or_a_dead_worker_mid_run_is_one_line(tmp_path):
    import multiprocessing

    x, y = _images()
    path = _records(tmp_path / "d.tfrecords", x, y)
    rows, epochs = np.arange(20), np.zeros(20, np.int64)

    def opened():
        ds = load_dataset(path, "image/encoded", "image/class/label", decode=DECODE, workers=2, augment="cifar")
        ds.x.submit(rows, epochs).examples()
        return ds, multiprocessing.active_children()

    ds, workers = opened()
    try:  # a worker killed with a chunk in it: its answer never comes
        for worker in workers:
            os.kill(worker.pid, signal.SIGSTOP)  # so that no chunk can be made before the kill
        started = ds.x.submit(rows, epochs)  # nothing waits: one chunk per worker
        for worker in workers:
            os.kill(worker.pid, signal.SIGKILL)
            worker.join()
        with pytest.raises(TrainingError, match="an input worker process died.*resume"):
            started.examples()
    finally:
        ds.close()
    ds, workers = opened()
    try:  # a worker killed between batches: the next chunk for it cannot be sent
        os.kill(workers[0].pid, signal.SIGKILL)
        workers[0].join()
        with pytest.raises(TrainingError, match="an input worker process died.*resume"):
            for _ in range(2):  # a chunk for each worker
                ds.x.submit(rows, epochs)
    finally:
        ds.close()
    assert not multiprocessing.active_children()
    ds, _ = opened()
    try:
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF  # a record's payload no longer matches its CRC
        open(path, "wb").write(bytes(data))
        with pytest.raises(TrainingError, match=f"{path}: record [0-9]+ at byte offset"):
            ds.x.submit(np.arange(60), np.zeros(60, np.int64)).examples()
    finally:
        ds.close()


def test_a_batch_dropped_unread_does_not_write_into_a_later_one(tmp_path):
    x, y = _images()
    ds = load_dataset(_records(tmp_path / "d.tfrecords", x, y), "image/encoded", "image/class/label",
                      decode=DECODE, workers=2, augment="cifar")
    reference = load_dataset(_records(tmp_path / "r.tfrecords", x, y), "image/encoded", "image/class/label",
                             decode=DECODE, workers=0, augment="cifar")
    long, small = np.arange(6000) % 60, np.arange(20)
    zero = np.zeros(6000, np.int64)
    try:
        first = ds.x.submit(long, zero)  # split: worker 0 and worker 1 busy
        second = ds.x.submit(long, zero)  # whole, for worker 0: it stays busy long after worker 1
        third = ds.x.submit(small + 20, zero[:20])  # whole, for worker 1
        dropped = ds.x.submit(small + 40, zero[:20])  # whole, for worker 0, after `second`
        del dropped  # its block is free, but worker 0 will write into it
        kept = ds.x.submit(small, zero[:20])  # whole, for worker 1: made before `dropped` is
        got = kept.examples().copy()
        for batch in (first, second, third):
            batch.examples()
        ds.x.submit(small, zero[:20]).examples()  # one chunk each: worker 0 has now made `dropped`
        assert np.array_equal(kept.examples(), got)
        assert np.array_equal(got, reference.x.submit(small, zero[:20]).examples())
    finally:
        ds.close()
        reference.close()


class _Odd(Exception):
    def __init__(self, a, b):  # pickles, but cannot be made again from its one message
        super().__init__(f"{a} {b}")


class _OddSource:
    """Rows of zeros, except row 0, which raises _Odd."""

    encoded = False

    def __len__(self):
        return 4

    def refs(self, rows):
        return np.asarray(rows)

    def read(self, ref):
        if ref == 0:
            raise _Odd(1, 2)
        return np.zeros((2, 2, 1), np.uint8)

    def close(self):
        pass


def test_an_answer_that_cannot_be_read_does_not_shift_the_next():
    import concurrent.futures

    from towers.data.jobs import Transformed
    from towers.data.workers import Workers

    workers = Workers(1)
    jid = workers.add(Transformed(_OddSource(), Transform((2, 2, 1), "none", encoded=False)))
    waiter = concurrent.futures.ThreadPoolExecutor(1)
    try:
        bad, good = workers.start(jid, [0, 1]), workers.start(jid, [1, 2])
        with pytest.raises(RuntimeError, match="answer cannot be read"):
            bad.wait()
        out, failed = waiter.submit(good.wait).result(timeout=30)  # a shifted answer would never come
        assert failed == [] and out.shape == (2, 2, 2, 1)
    finally:
        workers.close()  # ends a wait that is still reading (the pipe closes)
        waiter.shutdown()


def test_workers_spawned_while_sigterm_is_ignored_still_stop(tmp_path):
    import multiprocessing

    x, y = _images()
    ds = load_dataset(_records(tmp_path / "d.tfrecords", x, y), "image/encoded", "image/class/label",
                      decode=DECODE, workers=2, augment="cifar")
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as during a run's SIGTERM handling
    try:
        ds.x[0:4]  # the workers start now and inherit SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
    workers = multiprocessing.active_children()
    assert len(workers) == 2
    ds.close()
    assert [w.exitcode for w in workers] == [-signal.SIGTERM] * 2  # SIGTERM ended them, not the SIGKILL after it


_DRIVER = """
import os, sys, time, numpy as np
from towers.data.loading import load_dataset
if sys.argv[2] == "raw":  # raw TFRecord examples, read by the same workers (towers.data.tfrecord.records)
    ds = load_dataset(sys.argv[1], "image_raw", "label", decode="image_raw:uint8:28,28", workers=2)
else:
    ds = load_dataset(sys.argv[1], "image/encoded", "image/class/label", decode=sys.argv[2], workers=2,
                      augment="cifar")
batch = ds.x.submit(np.arange(40), np.zeros(40, np.int64)).examples() if sys.argv[2] != "raw" else \\
    [b.examples() for b in [ds.x.submit(np.arange(k, 1000, 2)) for k in range(2)]]  # both workers started
import multiprocessing
from multiprocessing import resource_tracker
pids = [p.pid for p in multiprocessing.active_children()] + [resource_tracker._resource_tracker._pid]
print(" ".join(map(str, pids)), flush=True)
print(" ".join(os.listdir("/dev/shm")), flush=True)
time.sleep(600)
"""


def _running(pid):
    """Whether ``pid`` is a live process (not gone, not a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("kind", ["images", "records"])
def test_workers_and_shared_memory_end_with_a_killed_driver(tmp_path, kind):
    if not os.path.isdir("/dev/shm") or not os.path.isdir("/proc"):
        pytest.skip("no /dev/shm to look at")
    if kind == "images":
        x, y = _images()
        path, how = _records(tmp_path / "d.tfrecords", x, y), DECODE
    else:
        path, how = str(shared_file("tfrecord-samples", "mnist_t10k_head1000.tfrecords")), "raw"
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, path, how], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        children = [int(p) for p in driver.stdout.readline().split()]
        blocks = {name for name in driver.stdout.readline().split() if name.startswith(f"towers-{driver.pid}-")}
        # workers (a pool spawns its second only when the first is busy) and the resource tracker
        assert len(children) >= 2 and all(map(_running, children))
        assert blocks  # the batches' shared memory (one pool for images and raw records)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in children if _running(p)]
        if not alive and not blocks & set(os.listdir("/dev/shm")):
            break
        time.sleep(0.2)
    assert not alive, f"still running after the driver's kill -9: {alive}"
    assert not blocks & set(os.listdir("/dev/shm")), "shared memory left behind"


# -- float features, flat bytes --------------------------------------------------------------------------


def test_decode_reshapes_a_float_feature(tmp_path):
    from towers.data.tfrecord.proto import SequenceExample

    path = str(tmp_path / "f.tfrecords")
    rng = np.random.default_rng(0)
    x = rng.random((20, 4, 4), dtype=np.float32)
    with open(path, "wb") as f, TFRecordWriter(f, "none") as w:
        for img, label in zip(x, np.arange(20) % 2):
            r = SequenceExample()
            r.context.feature["pixels"].float_list.value.extend(img.ravel().tolist())
            r.context.feature["label"].int64_list.value.append(int(label))
            w.write(r.SerializeToString())
    ds = load_dataset(path, "pixels", "label", decode="pixels:float32:4,4", workers=0)
    assert ds.x.shape == (20, 4, 4) and np.array_equal(ds.x[0:20], x)
    ds.close()
    with pytest.raises(UserError, match="float32 of a shape with that many values, so give a shape of 16 values"):
        load_dataset(path, "pixels", "label", decode="pixels:float32:5,5", workers=0)


def test_flat_bytes_for_a_convolution_name_the_decode_shape(tmp_path):
    path = shared_file("tfrecord-samples", "mnist_t10k_head1000.tfrecords")
    r = run_cli("--data", str(path), "--x-key", "image_raw", "--y-key", "label", "--model", "lenet5",
                "--devices", "cpu", "--steps", "1", "--logdir", str(tmp_path / "a"))
    assert r.returncode == 2 and "(784,)" in r.stderr and "--decode NAME:uint8:H,W" in r.stderr
    assert "image_raw:uint8:28,28" in r.stderr


def test_tfrecord_to_npz_decodes_images(tmp_path):
    src = shared_file("image-samples", "mnist_png_head500.tfrecords")
    out = tmp_path / "png.npz"
    r = run_cli(str(src), "-o", str(out), "--decode", "image/encoded:image:28,28,1", "--x", "image/encoded",
                "--y", "image/class/label", "--input-workers", "1", module="tools.tfrecord_to_npz")
    assert r.returncode == 0, r.stderr
    with np.load(out) as z, np.load(shared_file("image-samples", "mnist_png_head500.npz")) as ref:
        assert np.array_equal(z["x"], ref["x"]) and np.array_equal(z["y"], ref["y"])


def test_named_augmentations_shapes_types_and_evaluation_paths():
    rng = np.random.default_rng(0)
    photo = rng.integers(0, 256, (40, 60, 3), np.uint8)
    jpeg = codec.encode(photo, "jpeg")
    u = uniforms(3, [0], [0], 41)[0]
    tf = Transform((32, 32, 3), "tf-cifar10")
    x = tf(jpeg, u[:tf.draws])
    assert x.shape == (24, 24, 3) and x.dtype == np.float32 and abs(float(x.mean())) < 1e-4
    assert abs(float(x.std()) - 1) < 1e-3 and tf(jpeg).shape == (24, 24, 3)
    net = Transform((16, 16, 3), "imagenet", normalize="0.5,0.25")
    train, evaluation = net(jpeg, u), net(jpeg)
    assert train.shape == evaluation.shape == (16, 16, 3) and train.dtype == np.float32
    assert np.array_equal(evaluation, net(jpeg)) and not np.array_equal(train, evaluation)
    from towers.data.image.augment import random_resized_crop

    for row in uniforms(0, np.zeros(200), np.arange(200), 40):
        top, left, h, w = random_resized_crop(30, 50, row)
        assert 0 <= top and top + h <= 30 and 0 <= left and left + w <= 50
        assert 0.08 * 1500 * 0.8 <= h * w or (h, w) == (30, 40)  # area 0.08-1 (rounding), or the fallback


def test_sigterm_stops_the_workers_and_frees_their_shared_memory(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm to look at")
    x, y = _images(200)
    path = _records(tmp_path / "d.tfrecords", x, y)
    run = subprocess.Popen([sys.executable, "-m", "towers.train", "--data", path, *FLAGS, "--augment", "cifar",
                            "--devices", "cpu", "--n-gpu", "2", "--batch-size", "10", "--steps", "100000",
                            "--input-workers", "2", "--logdir", str(tmp_path / "run"), "--quiet"],
                           cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline, blocks = time.monotonic() + 60, set()
        while not blocks and time.monotonic() < deadline:
            time.sleep(0.1)
            blocks = {name for name in os.listdir("/dev/shm") if name.startswith(f"towers-{run.pid}-")}
        assert blocks, "no shared memory seen"
    finally:
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=60)
    assert run.returncode == 143 and "terminated (SIGTERM)" in err
    assert not blocks & set(os.listdir("/dev/shm"))


def test_crop_resize_is_the_bilinear_of_the_cut_out_box():
    """Enlarging boxes go to OpenCV: within 1 level of Pillow's bilinear of the same cut-out box (fixed-point
    rounding), flipped exactly; shrinking or fractional boxes take Pillow's antialiased path unchanged."""
    from PIL import Image

    rng = np.random.default_rng(1)
    small = rng.integers(0, 256, (8, 10, 3), np.uint8)
    photo = np.asarray(Image.fromarray(small).resize((80, 60), Image.BILINEAR))  # smooth, 60 x 80
    for box, size in (((5, 7, 25, 37), (32, 40)), ((0, 0, 60, 80), (60, 80)), ((10, 3, 11, 4), (7, 5))):
        top, left, bottom, right = box
        pil = np.asarray(Image.fromarray(photo[top:bottom, left:right]).resize(size[::-1], Image.BILINEAR))
        ours = codec.crop_resize(photo, *size, box)
        assert ours.shape == size + (3,) and ours.dtype == np.uint8
        assert np.abs(ours.astype(int) - pil).max() <= 1
        assert np.array_equal(codec.crop_resize(photo, *size, box, flip=True), ours[:, ::-1])
    grey = photo[:, :, :1]
    assert codec.crop_resize(grey, 16, 16, (0, 0, 8, 8)).shape == (16, 16, 1)
    for box in ((0, 0, 40, 70), (0.5, 1, 20.5, 31)):  # shrinks a side; fractional
        assert np.array_equal(codec.crop_resize(photo, 30, 30, box, flip=True),
                              codec.resize(photo, 30, 30, box, flip=True))
