"""Reading batches of TFRecord records (towers/data/tfrecord/gather.py): the unparsed copy must equal a full parse.

Records are built here with a controlled byte layout (the order of features
on the wire), so that the cases where copying a value without a parse would
be wrong exist in the files: the value's bytes present twice, records of
several lengths, files whose records do not start at multiples of one
length, damage after the layout was learned, a file that shrank while mapped.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from towers.data.tfrecord import gather as gather_module
from towers.data.tfrecord.framing import TFRecordError, TFRecordWriter, check_record, frame, framed_intact
from towers.data.tfrecord.gather import Gatherer, Layouts
from towers.data.tfrecord.proto import KIND_BYTES, KIND_FLOAT, BytesList, Feature, Features, FloatList, Int64List
from towers.data.tfrecord.index import file_index
from towers.data.tfrecord.index import positions as index_positions


def _varint(n):
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def example(*features):
    """An Example's bytes with its features on the wire in the order given: (name, Feature) pairs."""
    body = b"".join(Features(feature={name: value}).SerializeToString() for name, value in features)
    return b"\x0a" + _varint(len(body)) + body  # Example.features is field 1, length-delimited


def image(v):
    return Feature(bytes_list=BytesList(value=[bytes(v)]))


def label(k):
    return Feature(int64_list=Int64List(value=[int(k)]))


def write(path, payloads):
    with open(path, "wb") as f, TFRecordWriter(f) as w:
        for p in payloads:
            w.write(p)
    return str(path)


def gatherer(paths, kind=KIND_BYTES, dtype="u1", shape=(16,)):
    return Gatherer([str(p) for p in paths], "image_raw", kind, dtype, shape)


def positions(paths, records):
    """(files, offsets, lengths, numbers, crcs) of global record numbers ``records`` over the files' indexes."""
    r = np.asarray(records)
    return tuple(a[r] for a in index_positions([file_index(str(p)) for p in paths]))


class CountingParses(Gatherer):
    """A Gatherer that counts its full protobuf parses, to see the copy taken."""

    parses = 0

    def _value_of(self, payload):
        self.parses += 1
        return super()._value_of(payload)


def test_copies_equal_a_full_parse_across_lengths_layouts_and_shards(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (300, 16), np.uint8)
    labels = np.array([0, 1, 2, 3, 4, 200, 201, 202, 203, 204])[rng.integers(0, 10, 300)]  # 1- and 2-byte
    # varints: two payload lengths, so offsets that are no multiple of one, and two frames (layouts) a label
    payloads = []
    for k, (v, y) in enumerate(zip(images, labels)):
        if k % 7 == 0:  # another layout: an extra feature first
            payloads.append(example(("extra", label(5)), ("image_raw", image(v)), ("label", label(y))))
        else:
            payloads.append(example(("label", label(y)), ("image_raw", image(v))))
    paths = [write(tmp_path / "a.tfrecords", payloads[:120]), write(tmp_path / "b.tfrecords", payloads[120:])]
    g = CountingParses(paths, "image_raw", KIND_BYTES, "u1", (4, 4))
    for batch in rng.permutation(300).reshape(3, 100):  # ~50 records a length: gathered once frames are known
        np.testing.assert_array_equal(g.read(*positions(paths, batch)), images[batch].reshape(-1, 4, 4))
    first = g.parses
    for batch in rng.permutation(300).reshape(3, 100):
        np.testing.assert_array_equal(g.read(*positions(paths, batch)), images[batch].reshape(-1, 4, 4))
    assert 0 < first < 300 and g.parses == first, (first, g.parses)  # the second epoch is copied, not parsed
    g.close()


def test_float_examples_are_copied_as_stored(tmp_path):
    values = np.random.default_rng(1).standard_normal((40, 6)).astype(np.float32)
    payloads = [example(("image_raw", Feature(float_list=FloatList(value=v))), ("label", label(k % 3)))
                for k, v in enumerate(values)]
    path = write(tmp_path / "f.tfrecords", payloads)
    g = CountingParses([path], "image_raw", KIND_FLOAT, "<f4", (6,))
    counts = []
    for _ in range(2):
        got = g.read(*positions([path], np.arange(40)[::-1]))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, values[::-1])
        counts.append(g.parses)
    assert 0 < counts[0] < 40 and counts[1] == counts[0]  # one parse (and its check) a frame, then copies


def test_a_value_present_twice_is_never_copied_from_the_wrong_place(tmp_path):
    """T holds its image twice (in a decoy feature first); S differs from T only in the decoy.

    Taking the first copy of T's image as the field would make S's frame look
    known and hand out S's decoy bytes as its image.
    """
    v, u = bytes(range(16)), bytes(range(100, 116))
    t = example(("a_decoy", image(v)), ("image_raw", image(v)), ("label", label(1)))
    s = example(("a_decoy", image(u)), ("image_raw", image(v)), ("label", label(1)))
    assert len(t) == len(s) and t.find(v) < t.rfind(v)
    path = write(tmp_path / "d.tfrecords", [t, s, s, t])
    g = gatherer([path])
    for _ in range(3):
        np.testing.assert_array_equal(g.read(*positions([path], [0, 1, 2, 3])), np.frombuffer(v * 4, np.uint8)
                                      .reshape(4, 16))


def _flip_byte(path, at):
    st = os.stat(path)
    with open(path, "r+b") as f:  # in place: the mapping sees it, as bit rot would be seen
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("where, message", [(12 + 30, "payload CRC mismatch"), (3, "length CRC mismatch")])
def test_damage_after_the_layout_is_known_is_still_reported(tmp_path, where, message):
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (40, 16), np.uint8)  # one frame, and enough records for a gather
    path = write(tmp_path / "r.tfrecords", [example(("image_raw", image(v)), ("label", label(0))) for v in images])
    g = CountingParses([path], "image_raw", KIND_BYTES, "u1", (16,))
    pos = positions([path], np.arange(40))
    g.read(*pos)  # learned: every record's frame is known
    parses = g.parses
    g.read(*pos)
    assert g.parses == parses  # copied
    _flip_byte(path, int(pos[1][9]) + where)  # record 9: inside its image bytes, or in its header
    with pytest.raises(TFRecordError, match=f"record 9 at byte offset {int(pos[1][9])}: {message}"):
        g.read(*pos)


_SHRINK = """
import os, sys
import numpy as np
sys.path[:0] = [sys.argv[3]]
from tests.data.tfrecord.test_gather import gatherer, positions
from towers.data.tfrecord.framing import TFRecordError
paths = sys.argv[1:3]
images = np.load(paths[0] + ".npy")
g = gatherer(paths)
pos = positions(paths, np.arange(400))
g.read(*pos)  # maps both files whole and learns the frame
os.truncate(paths[1], int(pos[1][300]) + 5)  # the second file's pages past its new end raise SIGBUS if touched
keep = np.r_[0:200, 200:300]
np.testing.assert_array_equal(g.read(*(a[keep] for a in pos)), images[keep])
for batch in (np.r_[0:40, 350], [5, 350]):  # gathered from both files, and read one by one
    try:
        g.read(*(a[batch] for a in pos))
    except TFRecordError as e:
        print(e)
"""


def test_a_file_that_shrank_while_mapped_is_an_error_not_a_crash(tmp_path):
    """In a child process: touching the mapping past the file's end would kill it with SIGBUS."""
    images = np.random.default_rng(3).integers(0, 256, (400, 16), np.uint8)
    payloads = [example(("image_raw", image(v)), ("label", label(0))) for v in images]
    paths = [write(tmp_path / "t0.tfrecords", payloads[:200]), write(tmp_path / "t1.tfrecords", payloads[200:])]
    np.save(paths[0] + ".npy", images)
    p = subprocess.run([sys.executable, "-c", _SHRINK, *paths, str(REPO)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    lines = p.stdout.splitlines()
    assert len(lines) == 2 and all(f"{paths[1]}: record 150 " in line and "the file ends inside the record" in line
                                   for line in lines), p.stdout


def test_a_frame_is_learned_only_where_the_length_puts_the_value():
    """Two layouts of one length, the value at two places: frames are cut at the first place only."""
    a = example(("label", label(1)), ("image_raw", image(range(16))))
    b = example(("image_raw", image(range(16, 32))), ("label", label(1)))
    assert len(a) == len(b) and a.find(bytes(range(16))) != b.find(bytes(range(16, 32)))
    layouts = Layouts(16, gatherer([])._value_of)
    for record in (1, 1, 2):  # a frame is proved when a second record has it
        layouts.learn(a, bytes(range(16)), record)
    assert layouts.start(len(a)) == a.find(bytes(range(16)))
    for record in (3, 4):
        layouts.learn(b, bytes(range(16, 32)), record)
    rows = np.frombuffer(a + b, np.uint8).reshape(2, -1)
    assert layouts.known(len(a), rows).tolist() == [True, False]
    assert layouts.start(len(a)) == a.find(bytes(range(16)))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="lists the process's mappings through /proc")
def test_files_beyond_the_window_are_read_not_mapped_and_read_the_same(tmp_path, monkeypatch):
    """Mapped pages stay resident once read: the files mapped must fit the window, the rest are read."""
    images = np.random.default_rng(4).integers(0, 256, (3000, 784), np.uint8)
    payloads = [example(("image_raw", image(v)), ("label", label(0))) for v in images]
    paths = [write(tmp_path / f"s{k}.tfrecords", payloads[k * 1000:(k + 1) * 1000]) for k in range(3)]
    monkeypatch.setattr(gather_module, "WINDOW", 2 * os.path.getsize(paths[0]) + 1)  # two of the three
    g = Gatherer(paths, "image_raw", KIND_BYTES, "u1", (784,))
    for batch in np.random.default_rng(5).permutation(3000).reshape(15, 200):
        np.testing.assert_array_equal(g.read(*positions(paths, batch)), images[batch])
    maps = open("/proc/self/maps").read()
    assert sorted(p in maps for p in map(os.path.realpath, paths)) == [False, True, True], maps
    g.close()
    assert not any(p in open("/proc/self/maps").read() for p in map(os.path.realpath, paths))


def test_framed_intact_agrees_with_check_record_on_every_damaged_byte():
    payloads = [bytes([k]) * 24 for k in range(8)]
    clean = b"".join(frame(p) for p in payloads)
    n = len(clean) // 8
    for at in range(0, n, 3):  # every third byte of record 5, header to footer
        raw = bytearray(clean)
        raw[5 * n + at] ^= 0x01
        raw = bytes(raw)
        want = [not isinstance(check_record(raw[k * n:(k + 1) * n], 24), str) for k in range(8)]
        got = framed_intact(np.frombuffer(raw, np.uint8).reshape(8, n), 24).tolist()
        assert got == want and want[5] is False, at


def test_parse_check_rejects_records_unlike_the_index(tmp_path):
    """A record whose feature is not one string of the width asked: the index's one-line error, not garbage."""
    path = write(tmp_path / "m.tfrecords", [example(("image_raw", image(range(16)))),
                                            example(("image_raw", image(range(8))), ("pad", image(range(8))))])
    g = gatherer([path])
    with pytest.raises(TFRecordError, match="record 1 .*feature 'image_raw' is not what the index says"):
        g.read(*positions([path], [0, 1]))


def _length_delimited(tag, body):
    return tag + _varint(len(body)) + body


def test_a_float_list_sent_in_pieces_is_not_copied_from_a_feature_that_happens_to_hold_its_bytes(tmp_path):
    """A float list may come in several runs (packed or not) that the parser joins: its bytes then lie nowhere in
    one piece, and another feature holding them once (here the bytes feature ``z``) is not the list's place.

    R's ``image_raw`` is [1, 2] in two packed runs, and ``z`` holds the bytes of [1, 2]; S is R with ``z`` holding
    [3, 4].  Taking ``z``'s place for the value's would make S's frame look known and hand out [3, 4].
    """
    def record(z):
        runs = b"".join(_length_delimited(b"\x0a", np.float32(v).tobytes()) for v in (1.0, 2.0))  # FloatList.value
        entries = [("image_raw", _length_delimited(b"\x12", runs)),  # Feature.float_list
                   ("z", _length_delimited(b"\x0a", _length_delimited(b"\x0a", np.asarray(z, "<f4").tobytes())))]
        body = b"".join(_length_delimited(b"\x0a", _length_delimited(b"\x0a", name.encode())
                                          + _length_delimited(b"\x12", feature)) for name, feature in entries)
        return _length_delimited(b"\x0a", body)  # Example.features

    r, s = record([1.0, 2.0]), record([3.0, 4.0])
    path = write(tmp_path / "p.tfrecords", [r, r, s])  # two records with R's frame: it would be proved
    g = CountingParses([path], "image_raw", KIND_FLOAT, "<f4", (2,))
    for batch in ([0], [1], [2], [0, 1, 2], [2, 1, 0]):
        np.testing.assert_array_equal(g.read(*positions([path], batch)), np.ones((len(batch), 1)) * [1.0, 2.0])
    parses = g.parses
    g.read(*positions([path], [1]))
    assert g.parses == parses + 1  # the failed proof is not tried again: one parse, no second one


def test_a_feature_with_two_values_is_rejected_even_when_the_first_fits(tmp_path):
    two = Feature(bytes_list=BytesList(value=[bytes(16), bytes(range(16))]))
    path = write(tmp_path / "v.tfrecords", [example(("image_raw", image(range(16)))), example(("image_raw", two))])
    with pytest.raises(TFRecordError, match="record 1 .*feature 'image_raw' is not what the index says"):
        gatherer([path]).read(*positions([path], [0, 1]))


def test_many_lengths_and_unique_frames_read_the_same_with_a_small_frame_budget(tmp_path, monkeypatch):
    """Records of many lengths (a variable-length feature) and all-different frames (an id), past the budget."""
    monkeypatch.setattr(gather_module, "FRAME_BYTES", 20_000)
    rng = np.random.default_rng(6)
    images = rng.integers(0, 256, (600, 16), np.uint8)
    payloads = [example(("id", label(k)), ("image_raw", image(v)), ("name", image(bytes(k % 90))))
                for k, v in enumerate(images)]
    path = write(tmp_path / "u.tfrecords", payloads)
    g = gatherer([path])
    for _ in range(2):
        for batch in rng.permutation(600).reshape(3, 200):
            np.testing.assert_array_equal(g.read(*positions([path], batch)), images[batch])
    assert 0 < g._layouts.bytes <= 20_000


def test_gathers_stop_for_a_length_whose_frames_mostly_do_not_repeat(tmp_path, monkeypatch):
    monkeypatch.setattr(gather_module, "OFF_AFTER", 200)
    images = np.random.default_rng(7).integers(0, 256, (500, 16), np.uint8)
    ids = [1000] * 100 + list(range(1100, 1500))  # one frame for 100 records, then none repeats
    payloads = [example(("id", label(k)), ("image_raw", image(v))) for k, v in zip(ids, images)]
    assert len(set(map(len, payloads))) == 1
    path = write(tmp_path / "i.tfrecords", payloads)
    g = gatherer([path])
    for batch in np.arange(500).reshape(5, 100):
        np.testing.assert_array_equal(g.read(*positions([path], batch)), images[batch])
        if batch[0] == 0:
            assert g._layouts.start(len(payloads[0])) is not None  # the shared frame is proved
    assert g._layouts.start(len(payloads[0])) is None  # read one by one from now on
    np.testing.assert_array_equal(g.read(*positions([path], np.arange(500))), images)


def test_a_record_read_again_is_no_repeat_of_its_frame(tmp_path):
    """Unique frames (an id a record) are never proved, so a later epoch costs one parse a record, no more."""
    images = np.random.default_rng(8).integers(0, 256, (100, 16), np.uint8)
    path = write(tmp_path / "n.tfrecords", [example(("id", label(1000 + k)), ("image_raw", image(v)))
                                            for k, v in enumerate(images)])
    g = CountingParses([path], "image_raw", KIND_BYTES, "u1", (16,))
    counts = []
    for _ in range(3):
        np.testing.assert_array_equal(g.read(*positions([path], np.arange(100))), images)
        counts.append(g.parses)
    assert counts == [100, 200, 300]


def test_a_candidate_already_kept_is_proved_when_the_frame_budget_is_full(tmp_path, monkeypatch):
    """Proving a candidate moves its frame, it adds no bytes: a full budget must not stop it.

    A's frame is kept as a candidate, then records with all-different frames
    (an id) fill the budget; A's frame is then seen in a second record.  Held
    already, it must be proved, and a third record with it copied unparsed.
    """
    monkeypatch.setattr(gather_module, "FRAME_BYTES", 3_000)
    rng = np.random.default_rng(9)
    a = rng.integers(0, 256, (3, 16), np.uint8)
    u = rng.integers(0, 256, (100, 16), np.uint8)
    payloads = ([example(("image_raw", image(v)), ("label", label(7))) for v in a]
                + [example(("image_raw", image(v)), ("label", label(7)), ("id", label(1000 + k)))
                   for k, v in enumerate(u)])
    path = write(tmp_path / "b.tfrecords", payloads)
    images = np.concatenate((a, u))
    g = CountingParses([path], "image_raw", KIND_BYTES, "u1", (16,))
    for batch in ([0], np.arange(3, 103), [1]):  # A's first record, the ids (past the budget), A's second
        np.testing.assert_array_equal(g.read(*positions([path], batch)), images[batch])
    assert g._layouts.bytes + len(payloads[0]) + gather_module._CANDIDATE_OVERHEAD > 3_000  # the budget is full
    parses = g.parses
    np.testing.assert_array_equal(g.read(*positions([path], [2, 0, 1])), images[[2, 0, 1]])
    assert g.parses == parses  # A's frame was proved on its second record: copied, not parsed


def test_the_frames_and_candidates_kept_stay_within_the_frame_budget(monkeypatch):
    """FRAME_BYTES counts Python's overhead too (the docstring, and the README's "frames are kept within
    16 MiB"): the memory the frames and candidates really take, traced, must stay within it."""
    import tracemalloc

    budget = 400_000
    monkeypatch.setattr(gather_module, "FRAME_BYTES", budget)
    monkeypatch.setattr(gather_module, "TRIES", 10 ** 6)  # the budget, not the tries, must stop the candidates
    v = bytes(range(16))
    layouts = Layouts(16, gatherer([])._value_of)
    same = example(("image_raw", image(v)), ("id", label(10 ** 6)))
    for record in ((0, 0), (0, 1)):  # the start of this length is proved ...
        layouts.learn(same, v, record)
    assert layouts.start(len(same)) is not None
    ids = range(10 ** 6 + 1, 10 ** 6 + 10 ** 4)  # ... then every record has a frame of its own: candidates
    payloads = [p for p in (example(("image_raw", image(v)), ("id", label(k))) for k in ids) if len(p) == len(same)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k, p in enumerate(payloads):
            layouts.learn(p, v, (0, 10 ** 6 + k))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert layouts.bytes + len(same) + gather_module._CANDIDATE_OVERHEAD > budget  # filled
    assert grown <= 1.25 * budget, (grown, layouts.bytes)


def test_a_large_batch_is_gathered_in_chunks_the_same(tmp_path, monkeypatch):
    images = np.random.default_rng(10).integers(0, 256, (300, 16), np.uint8)
    payloads = [example(("image_raw", image(v)), ("label", label(k % 3))) for k, v in enumerate(images)]
    monkeypatch.setattr(gather_module, "CHUNK_BYTES", 40 * (len(payloads[0]) + 16) + 7)  # 40 records a chunk
    path = write(tmp_path / "c.tfrecords", payloads)
    g = CountingParses([path], "image_raw", KIND_BYTES, "u1", (16,))
    batch = np.random.default_rng(11).permutation(300)[:230]
    np.testing.assert_array_equal(g.read(*positions([path], batch)), images[batch])
    parses = g.parses
    np.testing.assert_array_equal(g.read(*positions([path], batch[::-1])), images[batch[::-1]])
    assert g.parses == parses  # six gathers of 40 or fewer, all copied


def test_learning_stops_and_frees_its_candidates_when_frames_do_not_repeat(tmp_path, monkeypatch):
    monkeypatch.setattr(gather_module, "TRIES", 50)
    images = np.random.default_rng(12).integers(0, 256, (120, 16), np.uint8)
    path = write(tmp_path / "s.tfrecords", [example(("id", label(1000 + k)), ("image_raw", image(v)))
                                            for k, v in enumerate(images)])
    g = gatherer([path])
    np.testing.assert_array_equal(g.read(*positions([path], np.arange(120))), images)
    assert g._layouts.bytes == 0 and not g._layouts._seen
    np.testing.assert_array_equal(g.read(*positions([path], np.arange(120))), images)
    assert g._layouts.bytes == 0
