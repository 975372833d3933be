"""The decoded-image cache (towers.data.image.cache): the same results as decoding every epoch, and the same
answers to bad input.

Each test compares a run with the cache against the same run without it (``cache_images`` False) or from an
npz of the same decoded pixels, on this machine, so float32 rounding is the same on both sides.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from tests.conftest import run_cli
from tests.data.test_pipeline import _rewrite_in_place, _stale, _swappable
from tests.data.image.test_images import DECODE, FLAGS, _folder, _images, _md5, _records
from towers import Config, Trainer
from towers.data.image.cache import CachedSource
from towers.data.loading import load_dataset
from towers.data.sources import RecordSource
from towers.data.tfrecord.index import file_index
from towers.errors import TrainingError

KEYS = dict(x_key="image/encoded", y_key="image/class/label", decode=DECODE)


def _train(logdir, data, steps=7, resume=False, **settings):
    cfg = Config(data=str(data), devices="cpu", n_gpu=2, batch_size=20, steps=steps, logdir=str(logdir), quiet=True,
                 checkpoint_every=3, summary_every=0, resume=resume, **settings)
    with Trainer(cfg) as t:
        cached = isinstance(getattr(getattr(t.dataset.x, "job", None), "source", None), CachedSource)
        t.fit()
    return _md5(os.path.join(logdir, "final.npz")), cached


@pytest.mark.parametrize("images", [{}, {"augment": "cifar"}, {"augment": "cifar", "normalize": "0.5,0.25"}],
                         ids=["gathered", "cropped in the input thread", "normalized in the workers"])
def test_the_cache_trains_the_weights_of_decoding_every_epoch_and_of_the_decoded_npz(tmp_path, images):
    x, y = _images()
    path = _records(tmp_path / "d.tfrecords", x, y)
    streamed, cached = _train(tmp_path / "stream", path, input_workers=2, cache_images=False, **images, **KEYS)
    assert not cached
    for workers in (0, 2):
        assert _train(tmp_path / f"cache{workers}", path, input_workers=workers, **images, **KEYS) == (streamed, True)
    # An npz of the same decoded pixels (what tools.tfrecord_to_npz --decode writes) trains the same weights.
    ds = load_dataset(path, **KEYS, workers=0)
    try:
        np.savez(tmp_path / "decoded.npz", x=ds.x[:], y=ds.y)
    finally:
        ds.close()
    assert _train(tmp_path / "npz", tmp_path / "decoded.npz", input_workers=0, **images)[0] == streamed
    # Across a resume: a checkpoint written without the cache goes on with it to the same bytes (given: a resume
    # takes the settings it is not given from the checkpoint).
    _train(tmp_path / "resumed", path, steps=3, input_workers=1, cache_images=False, **images, **KEYS)
    assert _train(tmp_path / "resumed", path, resume=True, input_workers=2, cache_images=True, **images,
                  **KEYS) == (streamed, True)


def test_an_image_folder_is_cached_to_the_same_weights(tmp_path):
    x, y = _images(45, size=14)  # fitted to 12 x 12 as it is decoded
    root = _folder(tmp_path / "imgs", x, y)
    settings = dict(input_workers=1, augment="cifar", image_size="12,12,1")
    streamed, cached = _train(tmp_path / "s", root, cache_images=False, **settings)
    assert not cached and _train(tmp_path / "c", root, **settings) == (streamed, True)


def test_a_set_over_the_budget_streams_with_a_notice_of_the_size_it_needs(tmp_path, notices):
    x, y = _images(1100, size=32)  # 1,126,400 decoded bytes: over 1 MiB, under 2
    path = _records(tmp_path / "d.tfrecords", x, y)
    decode = dict(KEYS, decode="image/encoded:image:32,32,1")
    over = load_dataset(path, **decode, workers=0, cache_mib=1)
    under = load_dataset(path, **decode, workers=0, cache_mib=2)
    try:
        assert isinstance(over.x.job.source, RecordSource) and isinstance(under.x.job.source, CachedSource)
        lines = list(notices)
        assert sum("need 1.1 MiB, over cache_images_mib 1:" in line and "set cache_images_mib 2 or more" in line
                   for line in lines) == 1, lines
        assert any("decoded-image cache: 1100 images of 32x32x1, 1.1 MiB" in line for line in lines), lines
        rows = np.array([5, 1099, 0, 5])
        assert np.array_equal(over.x[rows], under.x[rows])
    finally:
        over.close()
        under.close()


def test_the_budget_is_checked_against_the_memory_this_process_may_take(tmp_path):
    """cache.memory_room reads ulimit, cgroup (v2 and v1, a parent's limit too) and available memory; a cache
    that would take more than its share of the tightest streams (a cgroup would OOM-kill the fill instead)."""
    from towers.data.image import cache

    mib = cache.MIB

    def write(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    v2 = tmp_path / "v2"
    write(v2 / "proc/self/cgroup", "0::/jobs/run\n")
    write(v2 / "proc/meminfo", f"MemTotal: {64 * 1024 * 1024} kB\nMemAvailable: {8 * 1024 * 1024} kB\n")
    write(v2 / "sys/fs/cgroup/jobs/run/memory.max", "max\n")  # no limit of its own: its parent's binds
    write(v2 / "sys/fs/cgroup/jobs/run/memory.current", f"{600 * mib}\n")
    write(v2 / "sys/fs/cgroup/jobs/memory.max", f"{1024 * mib}\n")
    write(v2 / "sys/fs/cgroup/jobs/memory.current", f"{700 * mib}\n")
    write(v2 / "sys/fs/cgroup/jobs/memory.stat", f"anon {500 * mib}\ninactive_file {100 * mib}\n")
    room = dict(cache.memory_room(str(v2)))
    assert room["the cgroup memory limit"] == (1024 - (700 - 100)) * mib  # page cache it may reclaim is room
    assert room["the machine's available memory"] == 8 * 1024 * mib
    v1 = tmp_path / "v1"
    write(v1 / "proc/self/cgroup", "5:cpu:/x\n4:memory:/docker/abc\n")
    write(v1 / "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", f"{(1 << 63) - 4096}\n")  # none
    write(v1 / "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", f"{300 * mib}\n")
    write(v1 / "sys/fs/cgroup/memory/docker/memory.limit_in_bytes", f"{512 * mib}\n")
    write(v1 / "sys/fs/cgroup/memory/docker/memory.usage_in_bytes", f"{312 * mib}\n")
    assert cache.memory_room(str(v1)) == [("the cgroup memory limit", 200 * mib)]
    assert cache.memory_room(str(tmp_path / "elsewhere")) == []  # nothing known: nothing refused
    fits = int(cache.SHARE * 200 * mib)
    assert cache.not_cached(fits, 2048, cache.memory_room(str(v1))) is None
    why = cache.not_cached(fits + 1, 2048, cache.memory_room(str(v1)) + [("the machine's available memory", 9e9)])
    assert why.startswith("more than this process may take under the cgroup memory limit (200.0 MiB left, of "
                          f"which the cache may take {cache.SHARE:.0%}): they are decoded every epoch"), why
    assert cache.not_cached(3000 * mib, 2048, []).startswith("over `cache_images_mib` 2048")


_UNDER_A_LIMIT = """
import resource, sys
import numpy
from towers.data.image import cache
from towers.train import main

numpy.ones((64, 64), numpy.float32) @ numpy.ones((64, 64), numpy.float32)  # BLAS takes its buffers before the limit

if sys.argv[1] == "unknown":  # limits this process cannot read (no /proc): only the allocation can fail
    cache.memory_room = lambda root="/": []
status = {l.split(":")[0]: int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("Vm")}
room = int(sys.argv[2]) << 20  # what the run may map besides what it maps now: less than the cache needs
resource.setrlimit(resource.RLIMIT_AS, (status["VmSize"] * 1024 + room, resource.RLIM_INFINITY))
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("limits", ["read", "unknown"])
def test_a_cache_the_process_has_no_memory_for_streams_with_a_notice(tmp_path, limits):
    """Before: ulimit -v under the cache's size gave an _ArrayMemoryError traceback, exit 1, where
    --no-cache-images trained.  The check, or (limits unknown) the failed allocation, streams instead."""
    import subprocess
    import sys

    from tests.conftest import REPO

    x, y = _images(300)
    root = _folder(tmp_path / "imgs", x, y)  # decoded at 768 x 768 x 3: 506 MiB, under the 2048 MiB budget
    args = ["--data", root, "--image-size", "768,768,3", "--hidden", "2", "--batch-size", "4", "--steps", "2",
            "--devices", "cpu", "--input-workers", "0", "--cpu-kernels", "numpy", "--blas-threads", "1", "--quiet",
            "--summary-every", "0",
            "--checkpoint-every", "0", "--logdir", str(tmp_path / "run")]
    p = subprocess.run([sys.executable, "-c", _UNDER_A_LIMIT, limits, "450", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    why = ("more than this process may take under the address-space limit (ulimit -v)" if limits == "read" else
           "and allocating them failed (out of memory): they are decoded every epoch")
    assert f"the 300 decoded training images need 506.2 MiB, {why}" in p.stderr, p.stderr
    assert (tmp_path / "run" / "final.npz").exists()


@pytest.mark.slow
def test_a_corrupt_image_stops_or_is_counted_the_same_with_the_cache(tmp_path):
    x, y = _images()
    path = _records(tmp_path / "bad.tfrecords", x, y, bad={17})
    args = ("--data", path, *FLAGS, "--augment", "cifar", "--devices", "cpu", "--n-gpu", "2", "--batch-size", "10",
            "--steps", "13", "--checkpoint-every", "0", "--input-workers", "1", "--quiet")
    runs = {}
    for name, extra in (("cache", ()), ("stream", ("--no-cache-images",))):
        stop = run_cli(*args, *extra, "--logdir", str(tmp_path / f"stop-{name}"))
        assert stop.returncode == 1 and not (tmp_path / f"stop-{name}" / "final.npz").exists()
        skip = run_cli(*args, *extra, "--on-error", "skip", "--logdir", str(tmp_path / f"skip-{name}"))
        assert skip.returncode == 0, skip.stderr
        runs[name] = (stop.stderr.strip().splitlines()[-1],
                      [line for line in skip.stderr.splitlines() if "skipped" in line],
                      _md5(tmp_path / f"skip-{name}" / "final.npz"))
    line, skipped, _ = runs["cache"]
    assert "record 17" in line and "not a decodable image" in line and "--on-error skip" in line
    assert len(skipped) > 1 and f"({len(skipped)} so far" in skipped[-1]  # 260 examples: read in each epoch
    assert runs["cache"] == runs["stream"]


def test_a_file_rewritten_before_the_cache_reads_it_is_noticed_and_one_rewritten_after_is_not_read(tmp_path):
    x, y = _images(200)
    path = _records(tmp_path / "d.tfrecords", x, y)
    index = file_index(path)  # the cached index the next load starts from
    i, j = _swappable(index, y)
    order = np.arange(len(y))
    order[[i, j]] = [j, i]
    _rewrite_in_place(path, x, y, order)
    ds = load_dataset(path, **KEYS, workers=2, augment="cifar", cache_mib=64)
    try:
        assert isinstance(ds.x.job.source, CachedSource)
        others = np.setdiff1d(np.arange(len(y)), [i, j])[:40]
        ds.x.submit(others, np.zeros(40, np.int64)).examples()  # the rows that were checked are served
        with pytest.raises(TrainingError) as info:  # as without the cache: when the moved record is read
            ds.x.submit(np.array([0, i, 1]), np.zeros(3, np.int64)).examples()
        assert str(info.value) == _stale(path, index, i)
    finally:
        ds.close()

    # After the cache is full the file is not read again: the run keeps the copy it checked.
    _records(path, x, y)
    ds = load_dataset(path, **KEYS, workers=0, cache_mib=64)
    try:
        before = ds.x[:]
        _rewrite_in_place(path, x, y, order)
        assert np.array_equal(ds.x[:], before)
    finally:
        ds.close()


def test_the_decoding_bar_stays_out_of_redirected_stderr(tmp_path, capsys):
    # The README: bars appear only on a terminal; the cache's "decoding images" bar was written into a
    # redirected stderr (a log file, a pipe) anyway.
    x, y = _images(30)
    path = _records(tmp_path / "d.tfrecords", x, y)
    ds = load_dataset(path, KEYS["x_key"], KEYS["y_key"], decode=DECODE, workers=0, cache_mib=64, progress=True)
    try:
        assert isinstance(ds.x.job.source, CachedSource)  # decoded into the cache: the bar's place
    finally:
        ds.close()
    err = capsys.readouterr().err
    assert "decoding images" not in err and "\r" not in err, err
