"""Loading .npz files: damaged files and bad values are refused with one line, uncompressed members are mapped.

Each bad case is checked through the library (``load_dataset`` raises a
``UserError``) and through ``python -m towers.train`` (exit 2, one stderr line,
no traceback, nothing written in ``--logdir``).
"""
from __future__ import annotations

import mmap
import re
import zipfile

import numpy as np
import pytest

from tests.conftest import run_cli, shared_file
from towers import Config, Trainer
from towers.data.dataset import Dataset
from towers.data.loading import load_dataset
from towers.errors import UserError


def arrays(n=40, dtype=np.float32):
    """n examples of 6 features (a compressible ramp) and labels 0..3."""
    x = (np.arange(n * 6) % 251).reshape(n, 6).astype(dtype)
    return dict(x=x, y=np.arange(n) % 4)


def member_data(path, name) -> tuple[int, int]:
    """(offset, length) of a member's stored bytes in the zip file at ``path``."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        n, e = np.frombuffer(f.read(4), "<u2")
    return info.header_offset + 30 + int(n) + int(e), info.compress_size


def damage(path, at: int, length: int = 1) -> None:
    """Invert ``length`` bytes of the file at offset ``at``."""
    b = bytearray(path.read_bytes())
    b[at : at + length] = bytes(v ^ 0xFF for v in b[at : at + length])
    path.write_bytes(bytes(b))


def bad_crc(p):
    np.savez(p, **arrays())
    off, size = member_data(p, "x.npy")
    damage(p, off + size - 1)  # the last pixel: the .npy header stays valid, the CRC does not


def bad_deflate(p):
    np.savez_compressed(p, **arrays(400))
    off, size = member_data(p, "x.npy")
    damage(p, off + size // 2, 8)


def pickled(p):
    d = arrays()
    np.savez(p, x=d["x"].astype(object), y=d["y"])


def random_bytes(p):
    p.write_bytes(np.random.default_rng(0).bytes(1000))


def truncated(p):
    np.savez(p, **arrays())
    p.write_bytes(p.read_bytes()[:300])


def npy_file(p):
    with open(p, "wb") as f:
        np.save(f, arrays()["x"])


def label_beyond_int32(p):
    d = arrays()
    d["y"] = d["y"].astype(np.int64)
    d["y"][7] = 2**32 + 1  # as int32 this was label 1
    np.savez(p, **d)


def label_absurd(p):
    d = arrays()
    d["y"][3] = 2**24  # 16,777,217 classes: a 31 GiB output layer at --hidden 500
    np.savez(p, **d)


def negative_label(p):
    d = arrays()
    d["y"][[5, 9]] = -1
    np.savez(p, **d)


def nonfinite_x(p):
    d = arrays()
    d["x"][5, 1], d["x"][9, 0], d["x"][9, 3] = np.nan, np.inf, -np.inf
    np.savez(p, **d)


def nonfinite_x_test(p):
    d = arrays()
    xt = d["x"][:10].copy()
    xt[4, 2] = np.nan
    np.savez(p, **d, x_test=xt, y_test=d["y"][:10])


def beyond_float32_x(p):
    d = arrays()
    x = d["x"].astype(np.float64)
    x[6, 1] = 1e39  # float32's largest is 3.4e38
    x[9, 0] = -1e300
    np.savez(p, **{**d, "x": x})


def directory(p):
    p.mkdir()


def x_test_without_y_test(p):  # before: trained without test data, saying "no test data"
    d = arrays()
    np.savez(p, **d, x_test=d["x"][:10])


def y_test_without_x_test(p):
    d = arrays()
    np.savez(p, **d, y_test=d["y"][:10])


def no_features(p):  # before: trained, then "TypeError: memoryview" at the first checkpoint, exit 1, logdir made
    d = arrays()
    np.savez(p, x=d["x"][:, :0], y=d["y"])


CASES = [  # the start of the message (after "towers.train: error: " on the command line)
    (bad_crc, r"member 'x\.npy' of {f} is corrupt \(bad CRC\)"),
    (bad_deflate, r"member 'x\.npy' of {f} is corrupt \(bad deflate data\)"),
    (pickled, r"member 'x\.npy' of {f} holds pickled objects, which towers does not load"),
    (random_bytes, r"data file {f} is not an npz \(zip\) file"),
    (truncated, r"data file {f} is not an npz \(zip\) file"),
    (npy_file, r"data file {f} is a \.npy file \(one array\), not an npz"),
    (label_beyond_int32, r"{f}: key 'y' has 1 label that does not fit int32: 4294967297 at index 7"),
    (label_absurd, r"{f}: key 'y' has 1 label of 2\*\*20 or more: 16777216 at index 3 would make 16777217 classes"),
    (negative_label, r"{f}: key 'y' has 2 negative labels: -1 at index 5"),
    (nonfinite_x, r"{f}: key 'x' has 3 non-finite values \(NaN or inf\); the first in example 5"),
    (nonfinite_x_test, r"{f}: key 'x_test' has 1 non-finite value \(NaN or inf\); the first in example 4"),
    (beyond_float32_x, r"{f}: key 'x' has 2 values beyond float32's range \(\+-3\.403e\+38\); the first in example 6: "
                       r"towers trains in float32, where they would be inf; scale or clip them"),
    (directory, r"data file {f} is a directory: set {data} to an \.npz or TFRecord file"),
    (x_test_without_y_test, r"{f} has x_test but no y_test: an npz's test split is both arrays; add y_test, or "
                            r"remove x_test"),
    (y_test_without_x_test, r"{f} has y_test but no x_test"),
    (no_features, r"the examples have shape \(0,\) each: they hold no features \(an axis of length 0\)"),
]


@pytest.mark.parametrize("make, message", CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_files_are_one_line_user_errors(tmp_path, make, message):
    path = tmp_path / "d.npz"
    make(path)
    with pytest.raises(UserError) as e:
        load_dataset(str(path))
    assert re.match(message.format(f=re.escape(str(path)), data="data"), str(e.value)), str(e.value)
    logdir = tmp_path / "run"
    p = run_cli("--data", str(path), "--devices", "cpu", "--quiet", "--logdir", str(logdir),
                "--batch-size", "5", "--steps", "2", "--hidden", "4")
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    assert re.match("towers.train: error: .*" + message.format(f=re.escape(str(path)), data="--data"), p.stderr)
    assert not logdir.exists()


def test_arrays_in_memory_get_the_same_value_checks():
    d = arrays()
    d["x"][30, 2] = np.inf
    with pytest.raises(UserError, match="^Dataset.from_arrays: key 'x' has 1 non-finite value .* example 30"):
        Dataset.from_arrays(**d)
    d = arrays()
    d["y"] = d["y"].astype(np.uint64)
    d["y"][[2, 6]] = 2**63
    with pytest.raises(UserError, match="'y' has 2 labels that do not fit int32: 9223372036854775808 at index 2"):
        Dataset.from_arrays(**d)


def test_a_test_data_directory_names_its_flag(tmp_path):
    data, test = tmp_path / "d.npz", tmp_path / "t"
    np.savez(data, **arrays())
    test.mkdir()
    with pytest.raises(UserError, match=f"test data file {re.escape(str(test))} is a directory: set test_data to"):
        load_dataset(str(data), test_path=str(test))


def test_eval_uses_the_test_split_of_a_test_data_file(tmp_path):
    data, test, logdir = tmp_path / "d.npz", tmp_path / "t.npz", tmp_path / "run"
    np.savez(data, **arrays())
    d = arrays(30)
    np.savez(test, **d, x_test=d["x"][:12], y_test=d["y"][:12])
    p = run_cli("--data", str(data), "--devices", "cpu", "--quiet", "--logdir", str(logdir),
                "--batch-size", "5", "--steps", "2", "--hidden", "4")
    assert p.returncode == 0, p.stderr
    p = run_cli("--logdir", str(logdir), "--test-data", str(test), module="towers.eval")
    assert p.returncode == 0, p.stderr
    assert "on 12 test examples" in p.stdout, p.stdout


def is_mapped(a) -> bool:
    """Whether an array's memory is a file mapping (through views, down to the mmap)."""
    while a is not None:
        if isinstance(a, mmap.mmap):
            return True
        a = getattr(a, "base", None)
    return False


@pytest.mark.parametrize("devices", ["cpu", pytest.param("0", marks=pytest.mark.gpu)])
def test_stored_members_are_mapped_and_train_like_in_memory(tmp_path, devices):
    d = arrays(60)
    d["x_test"], d["y_test"] = d["x"][:10] * 0.5, d["y"][:10]
    stored, packed = tmp_path / "s.npz", tmp_path / "c.npz"
    np.savez(stored, **d)
    np.savez_compressed(packed, **d)
    mapped, in_memory = load_dataset(str(stored)), load_dataset(str(packed))
    assert isinstance(mapped.x, np.memmap) and is_mapped(mapped.x) and is_mapped(mapped.x_test)
    assert not mapped.x.flags.writeable
    assert not is_mapped(in_memory.x)
    assert np.array_equal(mapped.x, d["x"]) and np.array_equal(in_memory.x, d["x"])
    assert np.array_equal(mapped.y, in_memory.y) and mapped.num_classes == in_memory.num_classes == 4

    def train(ds):
        cfg = Config(n_gpu=2, devices=devices, hidden=8, batch_size=5, steps=6, lr=0.1, quiet=True,
                     logdir=str(tmp_path / f"run{len(runs)}"), summary_every=0)
        runs.append(cfg.logdir)
        with Trainer(cfg, dataset=ds) as tr:
            metrics = tr.fit()  # the background input thread gathers batches from the mapping
            return tr.get_weights(), metrics["test_accuracy_ema"]

    runs = []

    (wm, em), (wi, ei) = train(mapped), train(in_memory)
    assert wm.keys() == wi.keys()
    assert all(wm[k].tobytes() == wi[k].tobytes() for k in wm) and em == ei


def test_fortran_order_and_uint8_members_map_too(tmp_path):
    x = np.asfortranarray(np.arange(24 * 5, dtype=np.uint8).reshape(24, 5))
    path = tmp_path / "f.npz"
    np.savez(path, x=x, y=np.arange(24) % 3)
    ds = load_dataset(str(path))
    assert is_mapped(ds.x) and ds.x.dtype == np.uint8 and np.array_equal(ds.x, x)


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_damaged_files_never_escape_as_other_errors(tmp_path, save):
    """Seeded random byte flips and cuts anywhere in a file: it loads, or a UserError says why."""
    good_path, path = tmp_path / "good.npz", tmp_path / "d.npz"
    save(good_path, **arrays(100))
    good, rng = good_path.read_bytes(), np.random.default_rng(1)
    refused = 0
    for it in range(300):
        b = bytearray(good)
        for at in rng.integers(len(b), size=rng.integers(1, 4)):
            b[at] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(b[: rng.integers(len(b))] if it % 10 == 0 else b))
        try:
            load_dataset(str(path))
        except UserError as e:
            refused += 1
            assert "\n" not in str(e)
    assert refused > 200


def test_a_tfrecord_file_named_npz_is_read_as_tfrecord(tmp_path):
    # Before: the name decided: with `decode`, "decode applies to TFRecord data; the npz arrays are used as stored".
    import shutil

    source = shared_file("tfrecord-samples", "mnist_t10k_head1000.tfrecords")
    named = tmp_path / "mnist.npz"
    shutil.copy(source, named)
    keys = dict(decode="image_raw:uint8:28,28", workers=0)
    got, want = (load_dataset(str(p), "image_raw", "label", **keys) for p in (named, source))
    try:
        assert got.x.shape == want.x.shape == (1000, 28, 28)
        assert np.array_equal(got.x[:50], want.x[:50]) and np.array_equal(got.y, want.y)
    finally:
        got.close()
        want.close()
    np.savez(tmp_path / "real.npz", **arrays())  # an npz is still an npz, and another file named so is named
    assert load_dataset(str(tmp_path / "real.npz")).x.shape == (40, 6)
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(UserError, match="is not an npz"):
        load_dataset(str(tmp_path / "text.npz"))
