"""Training straight from TFRecord files (towers/data/tfrecord/records.py) through the command line.

The records are the embedded digits, written here with the package's writer;
each run is 2 CPU towers x 50 for a few dozen steps, so the shuffle crosses
epochs (1,438 records, 100 a step).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.conftest import DIGITS, run_cli
from towers.data.tfrecord import from_npz
from towers.data.tfrecord.records import file_index, index_cache_paths
from towers.train import main as train_main
from tools import tfrecord_to_npz

RUN = ["--devices", "cpu", "--n-gpu", "2", "--batch-size", "50", "--quiet", "--summary-every", "0"]
FEATURES = ["--x-key", "image_raw", "--y-key", "label", "--decode", "image_raw:uint8:8,8"]


def write_examples(path, x, y, compression="none"):
    from_npz.write_examples(path, x, y, compression)
    return path


@pytest.fixture(scope="module")
def digits():
    with np.load(DIGITS) as z:
        return z["x"], z["y"]


@pytest.fixture
def records(tmp_path, digits):
    return write_examples(tmp_path / "digits.tfrecords", *digits)


def train(capsys, logdir, *args):
    status = train_main([*RUN, "--logdir", str(logdir), *map(str, args)])
    return status, capsys.readouterr().err.strip().splitlines()


def final(logdir):
    return (logdir / "final.npz").read_bytes()


def test_tfrecord_file_and_shards_train_byte_identical_weights_to_the_npz_conversion(tmp_path, capsys, digits,
                                                                                       records):
    converted = tmp_path / "digits.npz"
    assert tfrecord_to_npz.main([str(records), "-o", str(converted), "--decode", "image_raw:uint8:8,8",
                                 "--x", "image_raw", "--y", "label"]) == 0
    x, y = digits
    bounds = [0, 500, 1000, len(y)]
    for k in range(3):  # shards in glob order hold the records in file order
        write_examples(tmp_path / f"train-{k:05d}-of-00003", x[bounds[k]:bounds[k + 1]], y[bounds[k]:bounds[k + 1]])
    steps = ["--steps", "30", "--checkpoint-every", "0", "--test-data", DIGITS]
    assert train(capsys, tmp_path / "npz", "--data", converted, *steps)[0] == 0
    assert train(capsys, tmp_path / "file", "--data", records, *FEATURES, *steps)[0] == 0
    status, err = train(capsys, tmp_path / "shards", "--data", tmp_path / "train-*-of-*", *FEATURES, *steps,
                        "--input-workers", "0")
    assert status == 0, err
    assert final(tmp_path / "file") == final(tmp_path / "npz")
    assert final(tmp_path / "shards") == final(tmp_path / "npz")
    # Another seed gives other weights: the comparison above can fail.
    assert train(capsys, tmp_path / "seed1", "--data", records, *FEATURES, *steps, "--seed", "1")[0] == 0
    assert final(tmp_path / "seed1") != final(tmp_path / "npz")


def test_resume_from_tfrecord_is_exact(tmp_path, capsys, records):
    data = ["--data", records, *FEATURES, "--checkpoint-every", "20", "--input-workers", "1"]
    assert train(capsys, tmp_path / "whole", *data, "--steps", "40")[0] == 0
    assert train(capsys, tmp_path / "parts", *data, "--steps", "20")[0] == 0
    status, err = train(capsys, tmp_path / "parts", *data, "--steps", "40", "--resume")
    assert status == 0, err
    assert final(tmp_path / "parts") == final(tmp_path / "whole")


def _record_met_at_step(step, n=1438, global_batch=100, seed=0):
    """The record the trainer reads in the middle of ``step`` (1-based) of epoch 0."""
    return int(np.random.default_rng([seed, 0]).permutation(n)[(step - 1) * global_batch + global_batch // 2])


def _damage_payload(path, offset):
    """Flip a payload byte of the record at ``offset``, keeping the size and the mtime (bit rot)."""
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[offset + 12 + 20] ^= 0x40
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_damaged_record_met_in_training_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, capsys, records):
    index = file_index(str(records))  # indexed (and cached) while the file was good
    assert os.path.exists(index_cache_paths(str(records))[0])
    bad = _record_met_at_step(6)
    offset = int(index.offsets[bad])
    _damage_payload(records, offset)
    logdir = tmp_path / "run"
    status, err = train(capsys, logdir, "--data", records, *FEATURES, "--steps", "10", "--checkpoint-every", "2")
    assert status == 1, err
    assert err[-1] == (f"towers.train: error: {records}: record {bad} at byte offset {offset}: payload CRC mismatch: "
                       "the record is corrupted; re-copy the file, or pass --on-error skip to drop such records")
    names = sorted(os.listdir(logdir))
    assert "ckpt-00000004.npz" in names and "final.npz" not in names and "ckpt-00000006.npz" not in names


def test_damage_found_when_indexing_stops_before_training_or_is_skipped(tmp_path, capsys, records):
    index = file_index(str(records))
    _damage_payload(records, int(index.offsets[7]))
    os.utime(records)  # a new mtime: the index is built again, and meets the damage
    status, err = train(capsys, tmp_path / "stop", "--data", records, *FEATURES, "--steps", "5")
    assert status == 2 and err[-1].endswith(f"{records}: record 7 at byte offset {int(index.offsets[7])}: "
                                            "payload CRC mismatch: the record is corrupted; re-copy the file, "
                                            "or pass --on-error skip to drop such records"), err
    assert not (tmp_path / "stop").exists()
    status, err = train(capsys, tmp_path / "skip", "--data", records, *FEATURES, "--steps", "5", "--on-error", "skip",
                        "--input-workers", "0")
    assert status == 0, err
    assert any("left out 1 record(s) whose payload CRC fails (--on-error skip)" in line for line in err), err
    assert len(file_index(str(records), "skip").offsets) == 1437


def test_index_is_rebuilt_when_the_file_changes(tmp_path, digits):
    path = write_examples(tmp_path / "a.tfrecords", digits[0][:10], digits[1][:10])
    assert len(file_index(str(path)).offsets) == 10
    write_examples(path, digits[0][:12], digits[1][:12])
    assert len(file_index(str(path)).offsets) == 12
    assert list(file_index(str(path)).scalars["label"]) == list(digits[1][:12])


def test_compressed_files_are_refused_with_how_to_convert(tmp_path, capsys, digits):
    path = write_examples(tmp_path / "d.tfrecords.gz", *digits, compression="gzip")
    status, err = train(capsys, tmp_path / "run", "--data", path, *FEATURES, "--steps", "5")
    assert status == 2 and "gzip-compressed" in err[-1] and "gzip -dc" in err[-1] and "tfrecord_to_npz" in err[-1]


@pytest.mark.parametrize("args, message", [
    ([], "no feature 'y' and 2 candidates (label, pixels) for the labels; pick one with --y-key"),
    (["--x-key", "image", "--y-key", "label"], "no feature 'image' for the examples; pick one with --x-key"),
    (["--y-key", "label", "--decode", "image_raw:uint8:9,9"], "needs one string of 81 bytes"),
    (["--y-key", "image_raw"], "'image_raw' (bytes, 1..1 values in 1438/1438 records, 64..64 bytes each) cannot be labels"),
])
def test_feature_choice_mistakes_are_one_line_listing_the_features(tmp_path, capsys, records, args, message):
    status, err = train(capsys, tmp_path / "run", "--data", records, *args, "--steps", "5")
    assert status == 2 and len(err) >= 1 and message in err[-1], err
    if "pick one" in message:
        assert "label (int64, 1..1 values in 1438/1438 records)" in err[-1]


def test_without_decode_the_bytes_feature_is_flat_pixels(tmp_path, capsys, records):
    status, err = train(capsys, tmp_path / "run", "--data", records, "--y-key", "label", "--steps", "5",
                        "--input-workers", "0", "--test-data", records)
    assert status == 0, err
    with np.load(tmp_path / "run" / "final.npz") as z:
        assert z["params/layer1/weights"].shape == (64, 500)


def test_eval_reads_the_runs_tfrecord_test_data_with_its_decode(tmp_path, capsys, records):
    from towers.eval import main as eval_main

    status, err = train(capsys, tmp_path / "run", "--data", records, *FEATURES, "--steps", "20",
                        "--test-data", records, "--input-workers", "1")
    assert status == 0, err
    with np.load(tmp_path / "run" / "final.npz") as z:
        assert z["params/layer1/weights"].shape == (64, 500)
    assert eval_main(["--logdir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "on 1438 test examples" in out, out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
def test_closing_records_read_in_process_closes_their_file(records):
    """``input_workers`` 0 reads in this process: close() must release the file it opened."""
    from towers.data.tfrecord.records import load_split

    def open_on_records():
        return [fd for fd in os.listdir("/proc/self/fd")
                if os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(records)]

    x, _ = load_split(str(records), "image_raw", "label", decode="image_raw:uint8:8,8", workers=0)
    assert x[:3].shape == (3, 8, 8) and len(open_on_records()) == 1  # the mapping's own descriptor
    x.close()
    assert open_on_records() == []
    assert x[3:5].shape == (2, 8, 8)  # a later read opens it again
    x.close()


def test_a_record_array_pickles_without_its_workers_and_reads_the_same(tmp_path):
    import pickle

    from towers.data.loading import load_dataset

    with np.load(DIGITS) as z:
        x, y = z["x"][:50], z["y"][:50]
    path = write_examples(tmp_path / "d.tfrecords", x, y)
    ds = load_dataset(str(path), "image_raw", "label", decode="image_raw:uint8:8,8", workers=1)
    try:
        first = ds.x[np.arange(10)]  # starts the worker pool and opens the file
        copy = pickle.loads(pickle.dumps(ds.x))
        assert copy._workers._pool is None  # no worker processes travel
        np.testing.assert_array_equal(copy[np.arange(10)], first)
        np.testing.assert_array_equal(first.reshape(10, -1), x[:10].reshape(10, -1))
        copy.close()
    finally:
        ds.x.close()


def test_a_npy_file_is_not_taken_for_tfrecord(tmp_path):
    data = tmp_path / "x.npy"
    np.save(data, np.zeros((4, 3), np.float32))
    p = run_cli("--data", str(data), "--devices", "cpu", "--quiet", "--logdir", str(tmp_path / "run"))
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert "is a .npy file (one array), not an npz" in p.stderr
    assert "TFRecord" not in p.stderr and not list(tmp_path.glob(".x.npy*"))  # no index cache written


def _photos(root, classes=("cat", "dog", "emu"), per=3):
    """An image folder of 6x6 grey PNGs, ``per`` a class."""
    from towers.data.image import codec

    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per):
            (root / name / f"{i}.png").write_bytes(codec.encode(np.full((6, 6, 1), 30 * i, np.uint8), "png"))
    return root


def _classes_of(path, test_path=None):
    from towers.data.loading import load_dataset

    ds = load_dataset(str(path), "image/encoded", "image/class/label", test_path=test_path and str(test_path),
                      decode="image/encoded:image:6,6,1", workers=0)
    try:
        return ds.class_names, ds.y, ds.y_test
    finally:
        ds.close()


def test_records_of_an_image_folder_keep_its_class_names(tmp_path, capsys):
    # Before: training from images_to_tfrecord's records of a folder had no class names (no classes.txt, no
    # data/classes, a test split matched by number), though every record holds its class in image/class/text.
    from tools import images_to_tfrecord

    assert images_to_tfrecord.main([str(_photos(tmp_path / "train")), "-o", str(tmp_path / "train.tfrecords")]) == 0
    names, y, _ = _classes_of(tmp_path / "train.tfrecords")
    assert names == ["cat", "dog", "emu"] and y.tolist() == [0] * 3 + [1] * 3 + [2] * 3
    _photos(tmp_path / "test", classes=("cat", "emu"))  # a test set without dog: emu must stay label 2
    assert images_to_tfrecord.main([str(tmp_path / "test"), "-o", str(tmp_path / "test.tfrecords")]) == 0
    names, _, y_test = _classes_of(tmp_path / "train.tfrecords", tmp_path / "test.tfrecords")
    assert names == ["cat", "dog", "emu"] and y_test.tolist() == [0] * 3 + [2] * 3
    # Labels that do not each have one name say nothing sure: no names (labels from 1; an npz's records).
    offset = tmp_path / "offset.tfrecords"
    assert images_to_tfrecord.main([str(tmp_path / "train"), "-o", str(offset), "--label-offset", "1"]) == 0
    assert _classes_of(offset)[0] is None
    np.savez(tmp_path / "pixels.npz", x=np.zeros((4, 6, 6), np.uint8), y=np.arange(4) % 2)
    assert images_to_tfrecord.main([str(tmp_path / "pixels.npz"), "-o", str(tmp_path / "pixels.tfrecords")]) == 0
    assert _classes_of(tmp_path / "pixels.tfrecords")[0] is None
    capsys.readouterr()
