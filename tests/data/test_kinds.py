"""A kind of data source added in one place (``towers.data.kinds.KINDS``): a folder of ``.npy`` files.

The fixture below is the whole addition: a source of rows (one ``.npy`` file
an example, ``DIR/<label>/*.npy``) and the kind that claims such folders.
Everything else (the description, the loader, the examples array, the input
workers, the batches, a checkpoint's data fingerprint) is the pipeline's own,
so the folder trains to the weights of the same arrays stored in an npz.
"""
import hashlib
import os

import numpy as np
import pytest

from tests.conftest import DIGITS
from towers import Config, Trainer
from towers.data.fingerprint import hash_rows
from towers.data.kinds import KINDS, Kind, Split
from towers.data.loading import load_dataset
from towers.data.pipeline import DataSpec, describe


class NpySource:
    """Row k: the array in ``paths[k]``, read as stored (a ``Gather`` job calls ``read_rows``), or one at a
    time as an H x W x C image for the ``Images`` op (``read``)."""

    encoded = False

    def __init__(self, paths, shape, dtype):
        self.paths, self.example_shape, self.dtype = list(paths), tuple(shape), np.dtype(dtype)

    def __len__(self):
        return len(self.paths)

    def refs(self, rows):
        return np.asarray(rows, np.int64)  # a worker has the paths: only row numbers travel

    def read_rows(self, refs, out):
        for k, row in enumerate(refs):
            out[k] = np.load(self.paths[row])

    def read(self, ref):
        image = np.load(self.paths[ref])
        return image if image.ndim == 3 else image[..., None]

    def where(self, ref):
        return self.paths[ref]

    def fingerprint(self, h):
        h.update("\n".join(os.path.relpath(p, os.path.dirname(os.path.dirname(p))) for p in self.paths).encode())
        hash_rows(h, np.stack([np.load(p) for p in self.paths]))

    def close(self):
        pass


class NpyFolder(Kind):
    name = "npy folder"

    def claims(self, path):
        return path is not None and os.path.isdir(path) and any(
            name.endswith(".npy") for _, _, names in os.walk(path) for name in names)

    def open(self, spec, path, say, test=False, own=False):
        classes = sorted(os.listdir(path), key=int)
        paths, labels = [], []
        for label in classes:
            names = sorted(os.listdir(os.path.join(path, label)))
            paths += [os.path.join(path, label, name) for name in names]
            labels += [int(label)] * len(names)
        first = np.load(paths[0])
        image = first.shape if first.ndim == 3 else first.shape + (1,)
        return Split(NpySource(paths, first.shape, first.dtype), np.asarray(labels, np.int32), size=image)


@pytest.fixture
def npy_folders():
    kind = NpyFolder()
    KINDS.insert(0, kind)
    yield kind
    KINDS.remove(kind)


def _folder_and_npz(tmp_path, n=120):
    """The first ``n`` digits as ``DIR/<label>/<k>.npy`` and, in the folder's row order, as an npz."""
    with np.load(DIGITS) as z:
        x, y = z["x"][:n], z["y"][:n]
    root = tmp_path / "npy"
    for k, (example, label) in enumerate(zip(x, y)):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        np.save(root / str(label) / f"{k:05d}.npy", example)
    order = np.argsort(y, kind="stable")  # labels, then file names: the folder's rows
    np.savez(tmp_path / "same.npz", x=x[order], y=y[order])
    return str(root), str(tmp_path / "same.npz")


def _weights(logdir, data, workers):
    cfg = Config(data=data, devices="cpu", n_gpu=2, batch_size=10, steps=6, logdir=str(logdir), quiet=True,
                 input_workers=workers, summary_every=0)
    with Trainer(cfg) as t:
        t.fit()
    with np.load(os.path.join(logdir, "final.npz")) as z:
        return hashlib.md5(b"".join(z[k].tobytes() for k in sorted(z.files) if k.startswith("params/"))).hexdigest()


def test_a_folder_of_npy_files_added_as_a_kind_trains_as_the_same_arrays_in_an_npz(tmp_path, npy_folders):
    folder, npz = _folder_and_npz(tmp_path)
    spec = describe(folder)
    assert spec == DataSpec(folder) and not spec.ops  # stored examples: no per-example operation
    ds = load_dataset(spec, workers=0)
    try:
        with np.load(npz) as z:
            np.testing.assert_array_equal(ds.x[np.arange(len(ds.x))], z["x"])
            np.testing.assert_array_equal(ds.y, z["y"])
    finally:
        ds.close()
    reference = _weights(tmp_path / "npz", npz, 0)
    assert _weights(tmp_path / "w0", folder, 0) == reference
    assert _weights(tmp_path / "w1", folder, 1) == reference  # made by an input worker process


def test_a_kind_s_folder_takes_the_image_operations_too(tmp_path, npy_folders):
    folder, npz = _folder_and_npz(tmp_path, 40)
    with np.load(npz) as z:
        pixels = z["x"][..., None]
    spec = describe(folder, augment="cifar", seed=3)
    ds, reference = load_dataset(spec, workers=0), load_dataset(npz, augment="cifar", seed=3, workers=0)
    try:
        rows, epochs = np.arange(40), np.ones(40, np.int64)
        np.testing.assert_array_equal(ds.x[rows], pixels)  # evaluation: fitted, not augmented
        np.testing.assert_array_equal(ds.x.submit(rows, epochs).examples(),
                                      reference.x.submit(rows, epochs).examples())
    finally:
        ds.close()
        reference.close()
