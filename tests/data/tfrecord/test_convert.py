"""Tests for the TFRecord <-> npz converters (towers/data/tfrecord/, tools/tfrecord_to_npz.py, tools/npz_to_tfrecord.py).

Fixtures come from ../shared/tfrecord-samples (files written by TensorFlow and
the npz TensorFlow's decoding gives); tests that need them skip when the
folder is absent.  Damaged inputs are built from a good file in tmp_path.
The command-line tools run in process through their ``main(argv)``.
"""

import gzip
import logging
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from tools import npz_to_tfrecord, tfrecord_to_npz
from towers.data.tfrecord import convert as converter
from towers.data.tfrecord.framing import TFRecordReader, TFRecordWriter, detect_compression, frame, masked_crc
from towers.data.tfrecord.proto import Example, SequenceExample

SAMPLES = Path(__file__).resolve().parents[3].parent / "shared" / "tfrecord-samples"
NAMES = ["mnist_t10k_head1000", "mixed_features", "sequence_examples"]
MNIST_RECORD = 860  # bytes per record in the MNIST sample, so record 500 starts at 430000


def sample(name, suffix=".tfrecords"):
    path = SAMPLES / (name + suffix)
    if not path.is_file():
        pytest.skip(f"{path} is absent: the shared TFRecord samples are needed for this test")
    return path


def convert(capsys, *argv):
    """Run tfrecord_to_npz in process; return (exit status, stderr lines)."""
    status = tfrecord_to_npz.main([str(a) for a in argv])
    return status, capsys.readouterr().err.splitlines()


def assert_same_npz(got_path, want_path):
    with np.load(got_path) as got, np.load(want_path) as want:
        assert sorted(got.files) == sorted(want.files)
        for key in want.files:
            a, b = got[key], want[key]
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), key


def write_records(path, payloads, compression="none"):
    with open(path, "wb") as f, TFRecordWriter(f, compression) as writer:
        for payload in payloads:
            writer.write(payload)


def example(**features):
    """A serialized Example: int -> int64, float -> float, bytes -> bytes, float32 array -> float list."""
    record = Example()
    for name, value in features.items():
        if isinstance(value, np.ndarray):
            kind, items = "float_list", value.astype(np.float32).tolist()
        else:
            kind, items = {bytes: "bytes_list", float: "float_list", int: "int64_list"}[type(value)], [value]
        typed = getattr(record.features.feature[name], kind)
        typed.SetInParent()
        typed.value.extend(items)
    return record.SerializeToString()


# --- framing primitives -------------------------------------------------------------------

def test_masked_crc_of_the_standard_check_string():
    crc = 0xE3069283  # CRC32C("123456789"), the catalogued check value
    assert masked_crc(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_detect_compression_prefers_a_valid_header_over_a_zlib_lookalike():
    payload = b"\0" * 0x9C78  # length bytes 78 9c ... also form a valid zlib header
    record = frame(payload)
    assert record[:2] == b"\x78\x9c" and detect_compression(record[:12]) == "none"
    assert detect_compression(zlib.compress(record)[:12]) == "zlib"
    assert detect_compression(gzip.compress(record)[:12]) == "gzip"


# --- the shared samples ---------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_sample_matches_tensorflow_decoding(name, tmp_path, capsys):
    out = tmp_path / "out.npz"
    status, _ = convert(capsys, sample(name), "-o", out)
    assert status == 0
    assert_same_npz(out, sample(name, ".npz"))


def test_small_chunks_give_the_same_result(tmp_path, capsys):
    out = tmp_path / "out.npz"
    status, _ = convert(capsys, sample("mixed_features"), "-o", out, "--chunk-size", "900")
    assert status == 0
    assert_same_npz(out, sample("mixed_features", ".npz"))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_round_trip_is_identical(name, compression, tmp_path, capsys):
    first, records, second = tmp_path / "a.npz", tmp_path / "b.tfrecords", tmp_path / "b.npz"
    assert convert(capsys, sample(name), "-o", first)[0] == 0
    assert npz_to_tfrecord.main([str(first), "-o", str(records), "--compression", compression]) == 0
    assert convert(capsys, records, "-o", second)[0] == 0
    with np.load(first) as a, np.load(second) as b:
        assert a.files == b.files
        for key in a.files:
            assert a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes(), key


def test_globs_are_sorted_and_compression_detected_per_file(tmp_path, capsys):
    data = sample("mnist_t10k_head1000").read_bytes()
    cut = [0, 300 * MNIST_RECORD, 700 * MNIST_RECORD, len(data)]
    packers = [lambda b: b, gzip.compress, zlib.compress]
    for i in (2, 0, 1):  # written out of order; the glob must sort them
        (tmp_path / f"train-{i:05d}-of-00003").write_bytes(packers[i](data[cut[i]:cut[i + 1]]))
    out = tmp_path / "out.npz"
    status, err = convert(capsys, tmp_path / "train-*-of-*", "-o", out)
    assert status == 0
    assert any("auto -> gzip" in line for line in err) and any("auto -> zlib" in line for line in err)
    assert_same_npz(out, sample("mnist_t10k_head1000", ".npz"))


def test_empty_file_gives_zero_records_with_a_warning(tmp_path, capsys):
    empty, out = tmp_path / "empty.tfrecords", tmp_path / "out.npz"
    empty.write_bytes(b"")
    status, err = convert(capsys, empty, "-o", out)
    assert status == 0 and any("warning" in line and "empty" in line for line in err)
    with np.load(out) as npz:
        assert npz.files == []
    both = tmp_path / "both.npz"
    status, _ = convert(capsys, empty, sample("mnist_t10k_head1000"), "-o", both)
    assert status == 0
    assert_same_npz(both, sample("mnist_t10k_head1000", ".npz"))


def test_decode_and_x_y(tmp_path, capsys):
    out = tmp_path / "out.npz"
    status, _ = convert(capsys, sample("mnist_t10k_head1000"), "-o", out,
                        "--decode", "image_raw:uint8:28,28", "--x", "image_raw", "--y", "label")
    assert status == 0
    with np.load(out) as got, np.load(sample("mnist_t10k_head1000", ".npz")) as want:
        assert got["x"].dtype == np.uint8 and got["x"].shape == (1000, 28, 28)
        assert np.array_equal(got["x"].reshape(1000, -1), want["image_raw"])
        assert np.array_equal(got["image_raw"], got["x"])
        assert got["y"].dtype == np.int64 and np.array_equal(got["y"], want["label"])


def test_the_library_converts_and_reads_schemas_without_printing(tmp_path, capsys, caplog, notices):
    # The converter is a library call with plain arguments (its command line is towers.tfrecord_to_npz):
    # what it says goes to the towers logger, the schema comes back as lines.  Before: convert(args, say)
    # took the argparse namespace and printed the schema itself.
    caplog.set_level(logging.INFO, logger="towers")
    src, out = sample("mnist_t10k_head1000"), tmp_path / "lib.npz"
    done = converter.convert([str(src)], str(out), ["image_raw:uint8:28,28"], x="image_raw", y="label")
    found = converter.schema([str(src)])
    printed, err = capsys.readouterr()
    # Nothing printed: stderr holds at most the notices, where a command line run earlier in this process
    # (towers.cli.show_notices) has the logger print them.
    assert printed == "" and set(err.splitlines()) <= set(notices)
    assert (done.rows, done.kind, found.rows, found.kind, found.files) == (1000, "Example", 1000, "tf.train.Example", 1)
    assert sorted(line.split()[0] for line in found.lines) == ["image_raw", "label", "pixels"]
    assert f"{src}: compression auto -> none" in notices
    status, _ = convert(capsys, src, "-o", tmp_path / "cli.npz", "--decode", "image_raw:uint8:28,28",
                        "--x", "image_raw", "--y", "label")
    assert status == 0
    assert_same_npz(out, tmp_path / "cli.npz")


def test_decode_to_wider_dtype_is_little_endian(tmp_path, capsys):
    path, out = tmp_path / "f.tfrecords", tmp_path / "out.npz"
    floats = np.arange(12, dtype="<f4").reshape(3, 4)
    write_records(path, [example(v=row.tobytes()) for row in floats])
    assert convert(capsys, path, "-o", out, "--decode", "v:float32", "--x", "v")[0] == 0
    with np.load(out) as npz:
        assert npz["x"].dtype == np.float32 and np.array_equal(npz["x"], floats)


@pytest.mark.parametrize("argv, message", [
    (["--decode", "image_raw:uint8:27,27"], "needs one string of 729 bytes"),
    (["--decode", "nope:uint8"], "no feature 'nope'"),
    (["--decode", "image_raw:object"], "not a numeric dtype"),
    (["--x", "missing"], "no feature 'missing'"),
])
def test_flag_mistakes_exit_2_and_write_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "out.npz"
    status, err = convert(capsys, sample("mnist_t10k_head1000"), "-o", out, *argv)
    assert status == 2 and message in err[-1] and sum("error" in line for line in err) == 1
    assert os.listdir(tmp_path) == []


def test_x_needs_a_dense_feature(tmp_path, capsys):
    status, err = convert(capsys, sample("mixed_features"), "-o", tmp_path / "o.npz", "--x", "tags")
    assert status == 2 and "no dense form" in err[-1]
    assert os.listdir(tmp_path) == []


def test_schema_prints_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert tfrecord_to_npz.main([str(sample("mixed_features")), "--schema"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("500 records (tf.train.Example)")
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert sorted(by_name) == ["big_int", "embedding", "id", "keywords", "note", "tags", "text", "weight"]
    assert "0..5" in by_name["tags"] and "in 100/500" in by_name["note"] and "in 365/500" in by_name["weight"]
    assert by_name["embedding"].split()[1] == "float"
    assert os.listdir(tmp_path) == []


def test_sequence_example_detected_by_feature_lists_not_by_parse(tmp_path, capsys):
    records = []
    for i in range(4):
        record = SequenceExample()
        record.context.feature["id"].int64_list.value.append(i)
        if i >= 2:  # the first records look exactly like Examples
            record.feature_lists.feature_list["tok"].feature.add().int64_list.value.extend([i, i])
        records.append(record.SerializeToString())
    path, out = tmp_path / "s.tfrecords", tmp_path / "out.npz"
    write_records(path, records)
    assert convert(capsys, path, "-o", out)[0] == 0
    with np.load(out) as npz:
        assert np.array_equal(npz["context/id"], np.arange(4))
        assert npz["feature_lists/tok.present"].tolist() == [False, False, True, True]
        assert npz["feature_lists/tok.step_counts"].tolist() == [0, 0, 1, 1]
        assert npz["feature_lists/tok.values"].tolist() == [2, 2, 3, 3]


def test_features_appearing_late_and_missing_across_batches(tmp_path, capsys):
    records = [example(a=i, **({"late": np.full(i % 3, i)} if i >= 150 else {})) for i in range(200)]
    path, out = tmp_path / "f.tfrecords", tmp_path / "out.npz"
    write_records(path, records)
    assert convert(capsys, path, "-o", out, "--chunk-size", "256")[0] == 0
    with np.load(out) as npz:
        expected = [i % 3 if i >= 150 else 0 for i in range(200)]
        assert npz["late.present"].tolist() == [i >= 150 for i in range(200)]
        assert npz["late.row_lengths"].tolist() == expected
        assert npz["late.values"].dtype == np.float32 and npz["late.values"].size == sum(expected)
        assert "late" not in npz.files and np.array_equal(npz["a"], np.arange(200))


def test_a_feature_changing_kind_is_an_error(tmp_path, capsys):
    path, out = tmp_path / "f.tfrecords", tmp_path / "out.npz"
    write_records(path, [example(a=1), example(a=2), example(a=3.0)])
    status, err = convert(capsys, path, "-o", out)
    assert status == 1 and len(err) == 2  # the compression line, then the error
    assert f"{path}: record 2 at byte offset {2 * len(frame(example(a=1)))}" in err[-1]
    assert "'a' is float here but int64" in err[-1]
    assert not out.exists()


# --- damaged input -----------------------------------------------------------------------------

def _flip(at):
    return lambda data: data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]


_START = 500 * MNIST_RECORD


def _huge_length(length):
    """Record 500's length field set to ``length``, with the length CRC that matches it."""
    def make(data):
        field = struct.pack("<Q", length)
        return data[:_START] + field + struct.pack("<I", masked_crc(field)) + data[_START + 12:]
    return make
_PNG = b"\x89PNG\r\n\x1a\n" + b"\0\0\0\rIHDR" + bytes(range(64))
_CSV = b"label,pixel0,pixel1\n" + b"7,0,0\n" * 20

DAMAGE = {  # case: (make the file from the good bytes, extra flags, record, offset, words in the message)
    "payload byte flipped": (_flip(_START + 12 + 400), [], 500, _START, "payload CRC mismatch"),
    "data-CRC field flipped": (_flip(_START + MNIST_RECORD - 2), [], 500, _START, "payload CRC mismatch"),
    "length field flipped": (_flip(_START + 1), [], 500, _START, "length CRC mismatch"),
    "length-CRC field flipped": (_flip(_START + 9), [], 500, _START, "length CRC mismatch"),
    "truncated payload": (lambda d: d[:_START + 300], [], 500, _START, "ends inside the record"),
    "truncated in the data CRC": (lambda d: d[:_START + MNIST_RECORD - 2], [], 500, _START, "ends inside the record"),
    "truncated header": (lambda d: d[:_START + 5], [], 500, _START, "ends 5 bytes into a 12-byte record header"),
    "PNG image": (lambda d: _PNG, [], 0, 0, "not a TFRecord file"),
    "CSV text": (lambda d: _CSV, [], 0, 0, "not a TFRecord file"),
    "short non-TFRecord": (lambda d: b"hello\n", [], 0, 0, "only 6 bytes"),
    "gzip read as none": (gzip.compress, ["--compression", "none"], 0, 0, "looks gzip-compressed"),
    "zlib read as none": (zlib.compress, ["--compression", "none"], 0, 0, "looks zlib-compressed"),
    "none read as gzip": (lambda d: d, ["--compression", "gzip"], 0, 0, "incorrect header check"),
    "none read as zlib": (lambda d: d, ["--compression", "zlib"], 0, 0, "incorrect header check"),
    "gzip read as zlib": (gzip.compress, ["--compression", "zlib"], 0, 0, "incorrect header check"),
    "zlib read as gzip": (zlib.compress, ["--compression", "gzip"], 0, 0, "incorrect header check"),
    "truncated gzip": (lambda d: gzip.compress(d)[:-5000], [], None, None, "ends before its end marker"),
    "damaged gzip": (lambda d: _flip(len(gzip.compress(d)) // 2)(gzip.compress(d)), [], None, None, ""),
    "payload CRC under gzip": (lambda d: gzip.compress(_flip(_START + 20)(d)), [], 500, _START, "payload CRC"),
    # A length far beyond the file whose CRC holds: read as the length it says, it was a MemoryError (2**40) or
    # an OverflowError (2**63) traceback; the gzip copy said the file ends inside the record.
    "length beyond the file, its CRC valid": (_huge_length(1 << 40), [], 500, _START, "ends inside the record"),
    "length beyond 2**63, its CRC valid": (_huge_length((1 << 63) + 5), [], 500, _START, "ends inside the record"),
    "length beyond the file under gzip": (lambda d: gzip.compress(_huge_length(1 << 40)(d)), [], 500, _START,
                                          "ends inside the record"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_input_gives_one_line_and_no_output(case, tmp_path, capsys):
    make, flags, index, offset, words = DAMAGE[case]
    bad = tmp_path / "bad.tfrecords"
    bad.write_bytes(make(sample("mnist_t10k_head1000").read_bytes()))
    out = tmp_path / "out" / "OUT.npz"
    out.parent.mkdir()
    status, err = convert(capsys, bad, "-o", out, *flags)
    assert status == 1
    errors = [line for line in err if "error" in line]
    assert len(errors) == 1 and errors[0] == err[-1] and "Traceback" not in "".join(err)
    assert f"{bad}: record " in errors[0] and words in errors[0]
    if index is not None:
        assert f"record {index} at byte offset" in errors[0] and f" {offset}: " in errors[0]
    else:  # damage deep inside a compressed stream: the good records before it are read first
        index = int(errors[0].split(": record ")[1].split()[0])
        assert index > 100 and f"byte offset (decompressed) {index * MNIST_RECORD}: " in errors[0]
    assert os.listdir(out.parent) == []  # neither OUT.npz nor temporary files


def test_on_error_skip_drops_payload_crc_failures_and_counts_them(tmp_path, capsys):
    data = sample("mnist_t10k_head1000").read_bytes()
    for record in (10, 500):
        data = _flip(record * MNIST_RECORD + 12 + 100)(data)
    data = _flip(700 * MNIST_RECORD + MNIST_RECORD - 1)(data)  # the CRC field itself
    bad, out = tmp_path / "bad.tfrecords", tmp_path / "out.npz"
    bad.write_bytes(data)
    status, err = convert(capsys, bad, "-o", out, "--on-error", "skip")
    assert status == 0 and any("dropped 3 record" in line for line in err)
    keep = np.setdiff1d(np.arange(1000), [10, 500, 700])
    with np.load(out) as got, np.load(sample("mnist_t10k_head1000", ".npz")) as want:
        assert np.array_equal(got["label"], want["label"][keep])
        assert np.array_equal(got["image_raw"], want["image_raw"][keep])


def test_payload_crc_advice_names_the_flag(tmp_path, capsys):
    # Before: "... or pass `on_error` skip to drop such records" (the setting's name, backticks and all).
    bad, out = tmp_path / "bad.tfrecords", tmp_path / "out.npz"
    bad.write_bytes(_flip(_START + 20)(sample("mnist_t10k_head1000").read_bytes()))
    status, err = convert(capsys, bad, "-o", out)
    assert status == 1 and err[-1].endswith("payload CRC mismatch: the record is corrupted; re-copy the file, or "
                                            "pass --on-error skip to drop such records"), err


def test_two_decodes_of_one_feature_are_refused(tmp_path, capsys):
    # Before: the last --decode won silently.
    out = tmp_path / "out.npz"
    status, err = convert(capsys, sample("mnist_t10k_head1000"), "-o", out, "--decode", "image_raw:uint8:28,28",
                          "--decode", "image_raw:uint8:784")
    assert status == 2 and err[-1] == ("tfrecord_to_npz: error: --decode image_raw:uint8:28,28 and --decode "
                                       "image_raw:uint8:784 both decode 'image_raw': give one --decode for each "
                                       "feature"), err
    assert os.listdir(tmp_path) == []


def test_a_path_that_exists_is_read_as_itself_not_as_a_pattern(tmp_path, capsys):
    # Before: 'a[1].tfrecords' was a pattern: with a1.tfrecords beside it, that file was read instead (and alone,
    # "no file matches").
    data = sample("mnist_t10k_head1000").read_bytes()
    (tmp_path / "a[1].tfrecords").write_bytes(data)
    write_records(tmp_path / "a1.tfrecords", [example(other=1)])
    out = tmp_path / "out.npz"
    status, err = convert(capsys, tmp_path / "a[1].tfrecords", "-o", out)
    assert status == 0, err
    assert_same_npz(out, sample("mnist_t10k_head1000", ".npz"))
    status, err = convert(capsys, tmp_path / "a[1]*.tfrecords", "-o", tmp_path / "glob.npz")  # still a pattern
    assert status == 0 and any("1 Example records" in line for line in err), err


def test_the_npz_of_an_empty_file_converts_back_to_no_records(tmp_path, capsys):
    # Before: npz_to_tfrecord called the npz tfrecord_to_npz writes for an empty file "damaged or not an npz
    # (no zip header)", exit 1.
    empty = tmp_path / "empty.tfrecords"
    empty.write_bytes(b"")
    assert convert(capsys, empty, "-o", tmp_path / "empty.npz")[0] == 0
    status = npz_to_tfrecord.main([str(tmp_path / "empty.npz"), "-o", str(tmp_path / "again.tfrecords")])
    err = capsys.readouterr().err
    assert status == 0 and "0 records" in err, err
    assert (tmp_path / "again.tfrecords").read_bytes() == b""


def test_on_error_skip_still_stops_on_framing_damage(tmp_path, capsys):
    bad, out = tmp_path / "bad.tfrecords", tmp_path / "out.npz"
    bad.write_bytes(_flip(_START + 3)(sample("mnist_t10k_head1000").read_bytes()))
    status, err = convert(capsys, bad, "-o", out, "--on-error", "skip")
    assert status == 1 and "record 500" in err[-1] and "length CRC" in err[-1]
    assert not out.exists()


def test_interrupt_while_writing_leaves_no_output(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(converter, "write_npz", interrupted)
    status, err = convert(capsys, sample("mixed_features"), "-o", tmp_path / "out.npz")
    assert status == 130 and "interrupted" in err[-1]
    assert os.listdir(tmp_path) == []


def test_reader_counts_records_and_reports_compression(tmp_path):
    path = tmp_path / "z.tfrecords"
    write_records(path, [example(a=i) for i in range(7)], "zlib")
    reader = TFRecordReader(str(path))
    assert reader.compression == "zlib"
    assert [i for batch in reader for i in batch.indices] == list(range(7))
    assert reader.records == 7 and reader.skipped == 0
    assert struct.unpack("<Q", zlib.decompress(path.read_bytes())[:8])[0] == len(example(a=0))
