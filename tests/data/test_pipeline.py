"""One data pipeline: every TFRecord path gets the same record checks, and one worker pool serves every source.

The drift this guards against: the image reader (encoded images in TFRecord
files) never compared a record with the CRC its index holds, while the raw
reader did, so a file rewritten in place with the same size and mtime trained
(exit 0) on images paired with the labels of other records.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.data.image.test_images import DECODE, FLAGS, _images, _records
from towers.data.loading import load_dataset
from towers.data.tfrecord.index import SPOT_CHECKS, file_index, index_cache_paths
from towers.errors import TrainingError


def _stale(path, index, i):
    return (f"{path}: record {i} at byte offset {int(index.offsets[i])}: the record is not the one indexed (its CRC "
            "differs): the file was rewritten since it was indexed (same size and modification time, other records); "
            "run again: the index is built anew")


def _swappable(index, y):
    """Two records of one length with different labels, neither among those the cached index's spot check reads
    (so that only the per-record check can notice them moved)."""
    n = len(index.offsets)
    checked = set(np.unique(np.linspace(0, n - 1, min(n, SPOT_CHECKS)).astype(np.int64)).tolist())
    return next((i, j) for i in range(n) for j in range(i + 1, n)
                if i not in checked and j not in checked and y[i] != y[j] and index.lengths[i] == index.lengths[j])


def _rewrite_in_place(path, x, y, order):
    """The records in ``order`` written over ``path``, its mtime set back: the same size, the same mtime."""
    before = os.stat(path)
    _records(path, x[order], y[order])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_an_image_tfrecord_rewritten_in_place_mid_run_is_noticed_as_the_raw_reader_does(tmp_path):
    x, y = _images(200)
    path = _records(tmp_path / "d.tfrecords", x, y)
    index = file_index(path)
    i, j = _swappable(index, y)
    order = np.arange(len(y))
    order[[i, j]] = [j, i]

    # Mid-run in the library: the workers have read batches, then the file changes under them.
    ds = load_dataset(path, "image/encoded", "image/class/label", decode=DECODE, workers=2, augment="cifar")
    try:
        others = np.setdiff1d(np.arange(len(y)), [i, j])[:40]
        ds.x.submit(others, np.zeros(40, np.int64)).examples()
        _rewrite_in_place(path, x, y, order)
        # Before: record i's bytes (record j's image) came back for record i's label, silently.
        with pytest.raises(TrainingError) as info:
            ds.x.submit(np.array([0, i, 1]), np.zeros(3, np.int64)).examples()
        assert str(info.value) == _stale(path, index, i)
    finally:
        ds.close()
    assert not any(os.path.exists(c) for c in index_cache_paths(path))  # the next run indexes the file anew

    # On the command line: a run that starts from the cached index meets the moved record mid-run.
    _records(path, x, y)
    index = file_index(path)
    _rewrite_in_place(path, x, y, order)
    r = run_cli("--data", path, *FLAGS, "--augment", "cifar", "--devices", "cpu", "--n-gpu", "2", "--batch-size",
                "10", "--steps", "10", "--checkpoint-every", "0", "--quiet", "--input-workers", "1", "--logdir",
                str(tmp_path / "run"))
    # Before: exit 0, trained on images paired with other records' labels.
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1] in {f"towers.train: error: {_stale(path, index, k)}" for k in (i, j)}, r.stderr
    assert not (tmp_path / "run" / "final.npz").exists()


def test_the_sampler_draws_and_counts_one_position_and_a_resumed_sampler_goes_on_where_it_stopped():
    from towers.data.batches import BatchSource, InputPosition, Sampler
    from towers.data.dataset import Dataset

    n, batch = 37, 10  # batches cross epoch boundaries at different indices
    ds = Dataset.from_arrays(np.zeros((n, 2), np.float32), np.arange(n) % 3)
    cursor, counter = BatchSource(ds, batch, seed=5), InputPosition(n, batch)
    drawn = [cursor.next_indices() for _ in range(12)]
    assert cursor.position == counter.at(12) == divmod(12 * batch, n)
    for epoch in range(3):  # every epoch is seen whole, in its own permutation
        seen = np.concatenate(drawn)[epoch * n:(epoch + 1) * n]
        assert sorted(seen.tolist()) == list(range(n))
    for step in (0, 3, 7):  # a checkpoint after `step` steps resumes to the same next batches
        state = counter.state_dict(step)
        assert set(state) == {"data/epoch", "data/index"}
        resumed = BatchSource(ds, batch, 5, *counter.read_state(state, "ckpt"))
        for k in range(step, 12):
            assert np.array_equal(resumed.next_indices(), drawn[k]), (step, k)
        idx, epochs = Sampler(n, batch, 5, counter.at(step), step).batch(step)
        assert np.array_equal(idx, drawn[step]) and epochs[0] == counter.at(step)[0]


def test_raw_records_run_on_the_image_workers_pool_and_a_dead_worker_is_its_one_line(tmp_path):
    import multiprocessing
    import signal

    from tests.conftest import shared_file
    from towers.data.workers import Workers
    from towers.data.tfrecord.records import load_split

    path = str(shared_file("tfrecord-samples", "mnist_t10k_head1000.tfrecords"))
    x, _ = load_split(path, "image_raw", "label", decode="image_raw:uint8:28,28", workers=1)
    reference, _ = load_split(path, "image_raw", "label", decode="image_raw:uint8:28,28", workers=0)
    try:
        assert isinstance(x._workers, Workers)  # the one pool, not a second one
        rows = np.arange(0, 1000, 7)
        assert np.array_equal(x[rows], reference[rows])
        (worker,) = multiprocessing.active_children()
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        with pytest.raises(TrainingError) as info:
            x[rows]
        assert str(info.value).startswith("an input worker process died (out of memory? killed?); resume from the "
                                          "last checkpoint with")  # the images' line, written once
    finally:
        x.close()
        reference.close()
    assert not multiprocessing.active_children()


@pytest.mark.filterwarnings("ignore:.*encountered in cast:RuntimeWarning")  # pixels read as float64: garbage
@pytest.mark.parametrize("decode", ["image_raw:uint8:28,28", "image_raw:float64:98"])
def test_raw_examples_made_in_a_worker_equal_those_made_in_the_input_thread(decode):
    from tests.conftest import shared_file
    from towers.data.tfrecord.records import load_split

    path = str(shared_file("tfrecord-samples", "mnist_t10k_head1000.tfrecords"))
    here, _ = load_split(path, "image_raw", "label", decode=decode, workers=0)
    there, _ = load_split(path, "image_raw", "label", decode=decode, workers=1)
    try:
        rows = np.random.default_rng(1).permutation(1000)[:300]
        a, b = here[rows], there[rows]
        # float64 bytes become float32 examples: converted on the way into the batch's shared memory
        assert a.dtype == b.dtype == (np.uint8 if "uint8" in decode else np.float32)
        assert a.tobytes() == b.tobytes() and a.shape == b.shape == (300,) + here.shape[1:]
    finally:
        here.close()
        there.close()
