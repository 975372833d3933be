"""The cached TFRecord index never pairs a record's bytes with another record's label.

Every digits record of one label length has the same size, so a file rewritten in another order keeps
its size; its mtime is set back as ``cp -p`` or ``touch -d`` would.  The examples are checked against
their labels: each image is looked up in the digits data, and its label must be the one given.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.conftest import DIGITS
from towers import TrainingError, UserError
from towers.data.tfrecord import from_npz
from towers.data.tfrecord.framing import frame
from towers.data.tfrecord.records import file_index, index_cache_paths, load_split, record_examples

FEATURES = dict(x_key="image_raw", y_key="label", decode="image_raw:uint8:8,8", workers=0)


@pytest.fixture(scope="module")
def digits():
    with np.load(DIGITS) as z:
        x, y = z["x"], z["y"]
    # Distinct images only, so that an image names its label.
    _, first = np.unique(x.reshape(len(x), -1), axis=0, return_index=True)
    keep = np.sort(first)
    return x[keep], y[keep]


def rewrite_keeping_size_and_mtime(path, x, y):
    """Write ``x, y`` over ``path`` and give it back its old mtime (same size: same records, another order)."""
    before = os.stat(path)
    from_npz.write_examples(path, x, y, "none")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def labels_of(images, digits):
    """The label of each image, looked up in the digits data."""
    x, y = digits
    table = {row.tobytes(): label for row, label in zip(x.reshape(len(x), -1), y)}
    return np.array([table[row.tobytes()] for row in images.reshape(len(images), -1)])


def test_a_file_rewritten_in_another_order_with_the_same_size_and_mtime_is_indexed_again(tmp_path, digits):
    x, y = digits
    path = tmp_path / "digits.tfrecords"
    from_npz.write_examples(path, x, y, "none")
    xs, ys = load_split(str(path), **FEATURES)
    np.testing.assert_array_equal(labels_of(xs[:], digits), ys)
    order = np.random.default_rng(0).permutation(len(y))
    rewrite_keeping_size_and_mtime(path, x[order], y[order])
    said = []
    xs, ys = load_split(str(path), **FEATURES, say=said.append)
    # Before: the cached labels of the old order, with the new file's images (10% accuracy, exit 0).
    np.testing.assert_array_equal(labels_of(xs[:], digits), ys)
    np.testing.assert_array_equal(ys, y[order])
    assert said[0] == (f"{path} holds other records than when it was indexed (same size and modification time): "
                       "indexing it again")
    xs.close()


def test_a_record_replaced_after_indexing_stops_the_read_and_the_next_index_is_built_anew(tmp_path, digits):
    x, y = digits
    path = tmp_path / "digits.tfrecords"
    from_npz.write_examples(path, x, y, "none")
    index = file_index(str(path))
    i, j = next((i, j) for i in range(len(y)) for j in range(i + 1, len(y))  # two records of one length
                if y[i] != y[j] and index.lengths[i] == index.lengths[j])
    order = np.arange(len(y))
    order[[i, j]] = [j, i]
    rewrite_keeping_size_and_mtime(path, x[order], y[order])  # two records swap places, nothing else moves
    assert any(os.path.exists(c) for c in index_cache_paths(str(path)))
    array = record_examples(str(path), [index], "image_raw", index.columns["image_raw"].kind, np.uint8, (8, 8), 0)
    # Before: record i's bytes (now j's image) came back with record i's label, silently.
    with pytest.raises(TrainingError) as info:
        array[np.array([i])]
    assert str(info.value) == (
        f"{path}: record {i} at byte offset {int(index.offsets[i])}: the record is not the one indexed (its CRC "
        "differs): the file was rewritten since it was indexed (same size and modification time, other records); "
        "run again: the index is built anew")
    assert not any(os.path.exists(c) for c in index_cache_paths(str(path)))
    array.close()
    xs, ys = load_split(str(path), **FEATURES)
    np.testing.assert_array_equal(labels_of(xs[:], digits), ys)
    xs.close()


def test_a_file_appended_to_while_it_is_indexed_is_said_to_have_changed(tmp_path, digits):
    x, y = digits
    path = tmp_path / "growing.tfrecords"
    from_npz.write_examples(path, x[:100], y[:100], "none")
    size = os.path.getsize(path)

    def writer_appends(line):  # said when indexing begins: another program writes on meanwhile
        if line.startswith("indexing"):
            with open(path, "ab") as f:
                f.write(frame(bytes(50))[:30])  # the first bytes of a record still being written
    # Before: "record 100 at byte offset {size}: the file ends inside the record (50 byte payload needs 66
    # bytes, 30 left): the file is truncated; re-copy it", at an offset past the size said when indexing began.
    with pytest.raises(UserError) as info:
        file_index(str(path), say=writer_appends)
    assert str(info.value) == (f"{path} changed while it was being indexed ({size:,} bytes when indexing began, "
                               f"{size + 30:,} now): is it still being written? Run again once it is complete")
    assert not any(os.path.exists(c) for c in index_cache_paths(str(path)))
