"""Download MNIST, Fashion-MNIST or CIFAR-10 and write it as one towers ``.npz`` (the library half of
``towers-fetch-data``; its command line is :mod:`towers.fetch_data`).

Downloading is pooch's (``pooch.create(...).fetch``).  For each raw file in the dataset's table
(``DATASETS``: file name -> the sum its publisher lists, and where):

1. ``DIR/raw/FILE`` exists and its sum matches: use it, download nothing.  It exists but does not
   match: delete it (say so) and download it again.
2. pooch downloads ``BASE/FILE`` into a temporary file in ``DIR/raw``, checks the whole file's sum and
   only then renames it to ``FILE``, so ``DIR/raw`` only ever holds complete, verified files.  A
   download that fails (the connection drops, the sum does not match) is tried ``RETRIES`` more times
   from the start (pooch waits 1 s, then 2 s, ... between tries); then one line names the URL and what
   failed, and the temporary file is gone.

Then the raw files are parsed (gzip'd idx files for MNIST and Fashion-MNIST; the *binary* CIFAR-10
tar, whose records are 1 label byte + 3072 pixel bytes in CHW order, never its pickles) and written to
``DIR/<name>.npz`` through a temporary file and a rename: keys ``x``, ``y``, ``x_test``, ``y_test``;
images uint8 (N, 28, 28) or (N, 32, 32, 3) NHWC; labels int64.

Limits: one file at a time; an interrupted download starts again from its first byte (pooch does not
resume); a SIGKILL mid-download leaves pooch's temporary file (``DIR/raw/tmp*``) behind.  Parsing holds
one dataset in memory (CIFAR-10: about 180 MB of images plus the 162 MB tar's members, read one at a
time).  MD5 is what the publishers list: it detects damaged or wrong files, not a deliberate forgery.
Tests pass their own file table and base URL to :func:`fetch`; the command line is a thin layer over it.
"""

import contextlib
import gzip
import logging
import os
import sys
import tarfile
import zlib

import numpy as np

from towers.errors import info
from towers.files import ArrayBytes, atomic_path, write_npz

RETRIES = 1  # more tries of a failed download; pooch waits 1 s before the first
TIMEOUT_S = 60  # seconds without a byte from the server before a download fails
_IDX_FILES = {"x": "train-images-idx3-ubyte.gz", "y": "train-labels-idx1-ubyte.gz",
              "x_test": "t10k-images-idx3-ubyte.gz", "y_test": "t10k-labels-idx1-ubyte.gz"}
_CIFAR_TAR = "cifar-10-binary.tar.gz"
_CIFAR_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
_CIFAR_TEST = "test_batch.bin"
_CIFAR_RECORD = 1 + 3 * 32 * 32
_CLASSES = 10  # all three datasets label 0..9


class FetchError(Exception):
    """A download or a file that cannot be used: network, HTTP, checksum, format.  Exit status 1."""


def _idx_dataset(paths):
    arrays = {key: read_idx(paths[name], ndim=3 if key.startswith("x") else 1) for key, name in _IDX_FILES.items()}
    for x, y in (("x", "y"), ("x_test", "y_test")):
        if len(arrays[x]) != len(arrays[y]):
            raise FetchError(f"{paths[_IDX_FILES[x]]} has {len(arrays[x]):,} images but {paths[_IDX_FILES[y]]} "
                             f"has {len(arrays[y]):,} labels; the files do not belong together")
    return arrays


def _cifar_dataset(paths):
    return read_cifar_tar(paths[_CIFAR_TAR])


# Each dataset: its default server, its files with the sums their publishers list, and its parser.
DATASETS = {
    # yann.lecun.com, MNIST's original host, often refuses downloads; this is the mirror
    # torchvision uses (PyTorch's own S3 bucket).  The MD5s are those published in torchvision's
    # torchvision/datasets/mnist.py (MNIST.resources), the list most MNIST downloaders check against.
    "mnist": {
        "base_url": "https://ossci-datasets.s3.amazonaws.com/mnist",
        "files": {
            "train-images-idx3-ubyte.gz": ("md5", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
            "train-labels-idx1-ubyte.gz": ("md5", "d53e105ee54ea40749a09fcbcd1e9432"),
            "t10k-images-idx3-ubyte.gz": ("md5", "9fb629c4189551a2d022fa330f9573f3"),
            "t10k-labels-idx1-ubyte.gz": ("md5", "ec29112dd5afa0611ce80d1b7f02629c"),
        },
        "read": _idx_dataset,
    },
    # The download links and "MD5 Checksum" column of the "Get the Data" table in the README of
    # github.com/zalandoresearch/fashion-mnist.  The same files are in that repository's
    # data/fashion/ folder (--mirror https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion).
    "fashion-mnist": {
        "base_url": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com",
        "files": {
            "train-images-idx3-ubyte.gz": ("md5", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
            "train-labels-idx1-ubyte.gz": ("md5", "25c81989df183df01b3e8a0aad5dffbe"),
            "t10k-images-idx3-ubyte.gz": ("md5", "bef4ecab320f06d8554ea6380940ec79"),
            "t10k-labels-idx1-ubyte.gz": ("md5", "bb300cfdad3c16e7a12a480ee83cd310"),
        },
        "read": _idx_dataset,
    },
    # https://www.cs.toronto.edu/~kriz/cifar.html, the "md5sum" column for
    # "CIFAR-10 binary version (suitable for C programs)".
    "cifar10": {
        "base_url": "https://www.cs.toronto.edu/~kriz",
        "files": {_CIFAR_TAR: ("md5", "c32a1d4ab5d03f1284b67883e8d87530")},
        "read": _cifar_dataset,
    },
}


# ---------------------------------------------------------------------------------------------------
# Parsing


def _check_labels(labels, path):
    if labels.size and int(labels.max()) >= _CLASSES:
        raise FetchError(f"{path}: label {int(labels.max())} is out of range 0..{_CLASSES - 1}: the file is damaged; "
                         f"delete it and run again")


def read_idx(path, ndim):
    """Parse a gzip'd idx file of unsigned bytes with ``ndim`` dimensions (the format on MNIST's page).

    Header: two zero bytes, the type byte 0x08 (unsigned byte), the dimension count, then one
    big-endian uint32 per dimension; the data follows, exactly prod(dims) bytes.  Labels (ndim 1) come
    back int64, images uint8.
    """
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise FetchError(f"{path}: not a readable gzip file ({exc}); delete it and run again") from None
    if len(data) < 4 or data[:2] != b"\0\0":
        raise FetchError(f"{path}: not an idx file (its first bytes are {data[:4].hex() or 'missing'}, "
                         f"an idx file starts with 0000); delete it and run again")
    if data[2] != 0x08:
        raise FetchError(f"{path}: idx data type 0x{data[2]:02x} is not unsigned byte (0x08); "
                         f"this is not an MNIST-style file")
    if data[3] != ndim:
        raise FetchError(f"{path}: the idx header has {data[3]} dimension(s), expected {ndim}; "
                         f"the images and labels files may be swapped")
    start = 4 + 4 * ndim
    if len(data) < start:
        raise FetchError(f"{path}: the idx header is cut short ({len(data)} bytes); delete it and run again")
    dims = tuple(int(d) for d in np.frombuffer(data, ">u4", ndim, 4))
    expected = int(np.prod(dims, dtype=np.int64))
    if len(data) - start != expected:
        raise FetchError(f"{path}: the idx header promises {expected:,} data bytes {dims} but the file has "
                         f"{len(data) - start:,}; delete it and run again")
    array = np.frombuffer(data, np.uint8, expected, start).reshape(dims)
    if ndim == 1:
        _check_labels(array, path)
        return array.astype(np.int64)
    return array


def _cifar_records(blob, where):
    if not blob or len(blob) % _CIFAR_RECORD:
        raise FetchError(f"{where}: {len(blob):,} bytes is not a whole number of {_CIFAR_RECORD}-byte CIFAR-10 "
                         f"records; delete the tar and run again")
    records = np.frombuffer(blob, np.uint8).reshape(-1, _CIFAR_RECORD)
    labels = records[:, 0].astype(np.int64)
    _check_labels(labels, where)
    # Each record stores the red, green and blue planes in turn (CHW); towers wants NHWC.
    images = np.ascontiguousarray(records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return images, labels


def read_cifar_tar(path):
    """Read the binary CIFAR-10 tar: ``data_batch_1..5.bin`` (train) and ``test_batch.bin``.

    Members are found by base name (the tar puts them in ``cifar-10-batches-bin/``) and read
    one at a time from the gzip stream, never extracted to disk.
    """
    wanted = set(_CIFAR_TRAIN) | {_CIFAR_TEST}
    parts = {}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                base = os.path.basename(member.name)
                if member.isfile() and base in wanted:
                    parts[base] = _cifar_records(tar.extractfile(member).read(), f"{path}: {member.name}")
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise FetchError(f"{path}: not a readable tar.gz file ({exc}); delete it and run again") from None
    missing = sorted(wanted - set(parts))
    if missing:
        raise FetchError(f"{path}: the tar lacks {', '.join(missing)}; this is not the binary CIFAR-10 "
                         f"({_CIFAR_TAR})")
    x = np.concatenate([parts[name][0] for name in _CIFAR_TRAIN])
    y = np.concatenate([parts[name][1] for name in _CIFAR_TRAIN])
    return {"x": x, "y": y, "x_test": parts[_CIFAR_TEST][0], "y_test": parts[_CIFAR_TEST][1]}


# ---------------------------------------------------------------------------------------------------
# Downloading


def _reason(exc):
    """What failed under a requests exception, as the OS says it ("Connection refused"), else its first line."""
    import requests

    if isinstance(exc, requests.exceptions.ChunkedEncodingError):
        return "the connection broke before the end of the file"
    if isinstance(exc, requests.exceptions.Timeout):
        return f"no answer within {TIMEOUT_S} s"
    todo, seen = [exc], set()
    while todo:  # breadth-first through requests' and urllib3's wrappers, down to the socket error
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
        todo += [a for a in (getattr(e, "reason", None), e.__cause__, e.__context__, *e.args)
                 if isinstance(a, BaseException)]
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def ensure_file(store, filename, say=info, progress=True):
    """``store.abspath/filename`` as a verified copy: a file whose sum matches is kept, else pooch downloads it.

    ``store`` is a ``pooch.Pooch`` whose registry holds ``filename``'s sum; every failure is a FetchError.
    """
    import pooch
    import requests

    path = os.path.join(store.abspath, filename)
    algorithm, _, digest = store.registry[filename].partition(":")
    if os.path.exists(path):
        if pooch.file_hash(path, algorithm) == digest:
            say(f"{path}: already downloaded, {algorithm} matches")
            return path
        os.unlink(path)  # gone even if the download below fails: a wrong file is never used
        say(f"{path}: {algorithm} does not match the published sum; deleted it, downloading again")
    url = store.get_url(filename)
    downloader = pooch.HTTPDownloader(progressbar=progress and sys.stderr.isatty(), chunk_size=1 << 16,
                                      timeout=TIMEOUT_S)
    try:
        store.fetch(filename, downloader=downloader)
    except ValueError:  # pooch: the sum of the download does not match (it deleted the download)
        raise FetchError(f"{url}: the {algorithm} of the download is not the published sum {digest}; deleted the "
                         f"bad download (it would have been {path}): run again, or pass --mirror URL to fetch it "
                         "from another server") from None
    except requests.exceptions.HTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "error"
        why = exc.response.reason if exc.response is not None else _reason(exc)
        raise FetchError(f"cannot download {url}: HTTP {status} {why}; the server does not serve this file: pass "
                         "--mirror URL to fetch it from another server") from None
    except requests.exceptions.RequestException as exc:
        raise FetchError(f"cannot download {url}: {_reason(exc)}; check the network connection, or pass "
                         "--mirror URL to fetch the same files from another server") from None
    say(f"downloaded {url}: {algorithm} matches the published sum")
    return path


def fetch(name, out_dir, base_url=None, files=None, say=info, progress=True, retries=RETRIES):
    """Download dataset ``name`` into ``out_dir/raw`` and write ``out_dir/<name>.npz``; return its path.

    ``base_url`` replaces the dataset's server (files are fetched from base_url + "/" + file name);
    ``files`` replaces its table of ``{file name: (hashlib algorithm, hex digest)}`` (the file names
    must be the ones the dataset's parser reads).  ``retries``: more tries of a failed download.
    A failure leaves none of the folders it made that hold nothing (``out_dir``, ``raw/``); the files
    already verified stay, with their folders.
    """
    import pooch

    pooch.get_logger().setLevel(logging.WARNING)  # its "Downloading ..." lines: ours are said through ``say``
    spec = DATASETS[name]
    table = spec["files"] if files is None else files
    store = pooch.create(path=os.path.join(out_dir, "raw"), base_url=(base_url or spec["base_url"]).rstrip("/") + "/",
                         registry={f: f"{algorithm}:{digest.lower()}" for f, (algorithm, digest) in table.items()},
                         retry_if_failed=retries)
    made, folder = [], os.path.abspath(store.abspath)  # the folders a failure must not leave: those made here
    while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
        made.append(folder)
        folder = os.path.dirname(folder)
    try:
        paths = {filename: ensure_file(store, filename, say, progress) for filename in table}
        arrays = spec["read"](paths)
        out = os.path.join(out_dir, f"{name}.npz")
        with atomic_path(out) as tmp:
            write_npz(tmp, [(key, ArrayBytes.of(array)) for key, array in arrays.items()])
    except BaseException:
        for folder in made:  # deepest first, each if still empty (verified files are kept, and their folders)
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise
    say(f"wrote {out}: {len(arrays['y']):,} train and {len(arrays['y_test']):,} test images "
        f"{arrays['x'].shape[1:]} uint8")
    return out

