"""Input pipeline: loading and validation, the global batch, prefetching, staging."""
import time

import numpy as np
import pytest

from towers.errors import UserError
from towers.data.batches import BatchSource, Prefetcher
from towers.data.dataset import Dataset
from towers.data.loading import load_dataset
from towers.data.staging import Stager
from towers.devices.placement import CPU


def save(tmp_path, name="d.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return str(path)


def small(n=10):
    return dict(x=np.arange(n * 4, dtype=np.uint8).reshape(n, 2, 2), y=np.arange(n) % 3)


@pytest.mark.parametrize(
    "arrays, pattern",
    [
        (dict(x=np.zeros((3, 2), np.uint8)), "no key 'y'"),
        (dict(x=np.zeros((3, 2), np.uint8), y=np.zeros(4, int)), "3 examples but 'y' has 4 labels"),
        (dict(x=np.zeros((0, 2), np.uint8), y=np.zeros(0, int)), "empty"),
        (dict(x=np.zeros((3, 2), np.uint8), y=np.array([0, -1, 2])), "negative label"),
        (dict(x=np.zeros((3, 2), np.uint8), y=np.zeros(3, np.float32)), "integer labels"),
        (dict(x=np.zeros((3, 2), np.int16), y=np.zeros(3, int)), "uint8 pixels or float32"),
        (dict(x=np.zeros(3, np.uint8), y=np.zeros(3, int)), "expected \\(N, features"),
        (dict(x=np.zeros((3, 2), np.uint8), y=np.zeros(3, int), x_test=np.zeros((2, 2), np.uint8),
              y_test=np.array([0, 5])), "test label 5 is out of range"),
        (dict(x=np.zeros((3, 2), np.uint8), y=np.zeros(3, int), x_test=np.zeros((2, 3), np.uint8),
              y_test=np.array([0, 0])), "test examples have shape"),
    ],
)
def test_bad_datasets_are_user_errors(tmp_path, arrays, pattern):
    with pytest.raises(UserError, match=pattern):
        load_dataset(save(tmp_path, **arrays))


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_dataset(str(tmp_path / "nope.npz"))
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file")
    with pytest.raises(UserError, match="is not an npz \\(zip\\) file"):
        load_dataset(str(bad))


def test_other_keys_and_separate_test_file(tmp_path):
    d = small()
    path = save(tmp_path, images=d["x"], labels=d["y"])
    test = save(tmp_path, "t.npz", x_test=d["x"][:4], y_test=d["y"][:4])
    ds = load_dataset(path, "images", "labels", test_path=test)
    assert ds.x.shape == (10, 2, 2) and ds.y.dtype == np.int32 and ds.num_classes == 3
    assert len(ds.x_test) == 4


def test_global_batch_larger_than_dataset():
    ds = Dataset(**small(10), num_classes=3)
    with pytest.raises(UserError, match="larger than the dataset"):
        BatchSource(ds, 11, seed=0)


def test_batches_depend_on_the_global_batch_only_and_cover_each_epoch():
    ds = Dataset(**small(10), num_classes=3)
    src = BatchSource(ds, 4, seed=3)
    idx = np.concatenate([src.next_indices() for _ in range(5)])  # 20 = two epochs exactly
    assert sorted(idx[:10]) == list(range(10)) and sorted(idx[10:]) == list(range(10))
    assert src.position == (2, 0)
    # A batch crossing an epoch boundary continues in the next permutation.
    src2 = BatchSource(ds, 4, seed=3)
    for _ in range(2):
        src2.next_indices()
    assert src2.position == (0, 8)
    assert list(src2.next_indices()) == list(idx[8:12]) and src2.position == (1, 2)
    # Resuming at a position continues the same sequence; another seed differs.
    src3 = BatchSource(ds, 4, seed=3, epoch=1, index=2)
    assert list(src3.next_indices()) == list(idx[12:16])
    assert list(BatchSource(ds, 4, seed=4).next_indices()) != list(idx[:4])


def test_prefetcher_delivers_in_order_and_surfaces_errors():
    ds = Dataset(**small(10), num_classes=3)
    ref = BatchSource(ds, 5, seed=1)
    pf = Prefetcher(BatchSource(ds, 5, seed=1), steps=6, depth=2)
    for _ in range(6):
        x, y = pf.get()
        rx, ry = ref.next_batch()
        assert np.array_equal(x, rx) and np.array_equal(y, ry)
    pf.close()

    class Broken:
        def submit_batch(self):
            raise OSError("disk gone")

    pf = Prefetcher(Broken(), steps=3)
    with pytest.raises(OSError, match="disk gone"):
        pf.get()
    pf.close()


def test_prefetcher_closes_when_its_queue_is_full_and_the_input_then_fails():
    """The loop stopped reading (an error of its own) while the input thread hit one: close() ends the thread."""
    ds = Dataset(**small(10), num_classes=3)
    good = BatchSource(ds, 5, seed=1)

    class FailsLater:
        def __init__(self):
            self.calls = 0

        def submit_batch(self):
            self.calls += 1
            if self.calls > 2:
                raise OSError("disk gone")
            return good.submit_batch()

    source = FailsLater()
    pf = Prefetcher(source, steps=10, depth=2)
    while source.calls < 3:
        time.sleep(0.01)  # two batches fill the queue; the third call's error waits for room
    pf.close()
    assert not pf._thread.is_alive()


def test_stager_scales_uint8_on_the_device():
    st = Stager(CPU, None, 2, (2, 2), np.uint8)
    x, y = st.stage(np.full((2, 2, 2), 255, np.uint8), np.array([1, 2], np.int32))
    assert x.dtype == np.float32 and np.all(x == 1.0) and list(y) == [1, 2]
    st = Stager(CPU, None, 2, (3,), np.float32)
    x, _ = st.stage(np.full((2, 3), 0.5, np.float32), np.zeros(2, np.int32))
    assert np.all(x == 0.5)
