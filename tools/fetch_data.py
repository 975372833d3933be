"""Download MNIST, Fashion-MNIST or CIFAR-10 and write it as one towers ``.npz``.

    python -m tools.fetch_data mnist|fashion-mnist|cifar10 -o DIR [--mirror URL]

Algorithm, for each raw file in the dataset's table (``DATASETS``: file name -> published sum):

1. ``DIR/raw/FILE`` exists and its sum matches: use it, download nothing.  It exists but does not
   match: delete it (say so) and download it again.
2. Download ``BASE/FILE`` into ``DIR/raw/FILE.part``.  A ``.part`` left by an earlier run is resumed
   with an HTTP ``Range: bytes=SIZE-`` request; a server that answers 200 instead of 206 ignored the
   range, so the ``.part`` is restarted from byte 0.  A body cut short of its Content-Length is
   resumed the same way, up to ``attempts`` times in one run; after that the ``.part`` is kept for
   the next run.
3. Check the whole file's sum.  A mismatch deletes the ``.part`` and stops (exit 1); a match renames
   it to ``FILE``, so ``DIR/raw`` only ever holds complete, verified files.

Then the raw files are parsed (gzip'd idx files for MNIST and Fashion-MNIST; the *binary* CIFAR-10
tar, whose records are 1 label byte + 3072 pixel bytes in CHW order, never its pickles) and written to
``DIR/<name>.npz`` through a temporary file and a rename: keys ``x``, ``y``, ``x_test``, ``y_test``;
images uint8 (N, 28, 28) or (N, 32, 32, 3) NHWC; labels int64.

Limits: one file at a time; parsing holds one dataset in memory (CIFAR-10: about 180 MB of images plus
the 162 MB tar's members, read one at a time).  MD5 is what the publishers list: it detects damaged
or wrong files, not a deliberate forgery.  Tests inject their own file table and base URL through
:func:`fetch`; the CLI is a thin layer over it.
"""

import gzip
import hashlib
import http.client
import os
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zlib

import numpy as np

from towers.cli import Parser, run_main
from towers.output.files import ArraySource, atomic_path, write_npz

PROG = "fetch_data"
USER_AGENT = "towers-fetch_data/1 (+python urllib)"
_BLOCK = 1 << 16
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


def _say(message):
    print(f"{PROG}: {message}", file=sys.stderr)


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


def file_digest(path, algorithm):
    with open(path, "rb") as f:
        # usedforsecurity=False: MD5 here detects damage, and FIPS builds refuse it otherwise.
        return hashlib.file_digest(f, lambda: hashlib.new(algorithm, usedforsecurity=False)).hexdigest()


def _unreachable(url, reason):
    return FetchError(f"cannot download {url}: {reason}; check the network connection, "
                      f"or pass --mirror URL to fetch the same files from another server")


def _open(url, offset, timeout):
    """Send the request (with a Range header when resuming); return (response, offset it starts at).

    The offset comes back 0 when the .part cannot be resumed: HTTP 416 (the .part is already as
    long as the file, or longer), a 200 instead of 206 (Range ignored), or a 206 for another range.
    """
    headers = {"User-Agent": USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:
            return _open(url, 0, timeout)
        raise FetchError(f"cannot download {url}: HTTP {exc.code} {exc.reason}; the server does not serve "
                         f"this file: pass --mirror URL to fetch it from another server") from None
    except urllib.error.URLError as exc:
        raise _unreachable(url, exc.reason) from None
    except (OSError, http.client.HTTPException) as exc:
        raise _unreachable(url, str(exc) or type(exc).__name__) from None
    if offset and response.status == 206:
        start = response.headers.get("Content-Range", "").removeprefix("bytes ").split("-")[0]
        if start == str(offset):
            return response, offset
        response.close()
        return _open(url, 0, timeout)
    return response, 0


def _progress(total, initial, desc, enabled):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                dynamic_ncols=True, file=sys.stderr, disable=not (enabled and sys.stderr.isatty()))


def download(url, part, attempts=3, timeout=60, progress=True, say=_say):
    """Download ``url`` into ``part``, resuming what is there; return once the body is complete.

    A body that ends before its Content-Length (dropped connection, reset, timeout) is resumed
    from the bytes received, ``attempts`` times in all; then FetchError, with the .part kept.
    """
    for attempt in range(1, attempts + 1):
        had = os.path.getsize(part) if os.path.exists(part) else 0
        response, offset = _open(url, had, timeout)
        with response:
            if had and not offset:
                say(f"{url}: the server did not resume at byte {had:,}; downloading it from the start")
            else:
                say(f"resuming {url} at byte {offset:,}" if offset else f"downloading {url}")
            length = response.headers.get("Content-Length")
            total = offset + int(length) if length and length.isdigit() else None
            got, cut = offset, None
            os.makedirs(os.path.dirname(part), exist_ok=True)
            with open(part, "ab" if offset else "wb") as f, \
                    _progress(total, offset, os.path.basename(part)[:-5], progress) as bar:
                while True:
                    try:
                        block = response.read(_BLOCK)
                    except (OSError, http.client.HTTPException) as exc:
                        cut = str(exc) or type(exc).__name__
                        break
                    if not block:
                        break
                    f.write(block)
                    got += len(block)
                    bar.update(len(block))
        if cut is None and (total is None or got >= total):
            return
        why = cut if cut is not None else "the connection closed early"
        of = f"{got:,} of {total:,}" if total is not None else f"{got:,}"
        if attempt < attempts:
            say(f"{url}: stopped after {of} bytes ({why}); resuming")
            continue
        raise FetchError(f"{url}: the download stopped after {of} bytes ({why}); "
                         f"{part} is kept: run the same command again to resume, or pass --mirror URL")


def ensure_file(url, path, algorithm, digest, say=_say, **download_options):
    """Make ``path`` a verified copy of ``url``: keep a matching file, else download and check it."""
    if os.path.exists(path):
        if file_digest(path, algorithm) == digest:
            say(f"{path}: already downloaded, {algorithm} matches")
            return path
        os.unlink(path)
        say(f"{path}: {algorithm} does not match the published sum; deleted it, downloading again")
    part = path + ".part"
    download(url, part, say=say, **download_options)
    actual = file_digest(part, algorithm)
    if actual != digest:
        os.unlink(part)
        raise FetchError(f"{url}: {algorithm} of the download is {actual}, the published sum is {digest}; "
                         f"deleted the bad download {part}: run again, or pass --mirror URL to fetch it "
                         f"from another server")
    os.replace(part, path)
    return path


def fetch(name, out_dir, base_url=None, files=None, say=_say, **download_options):
    """Download dataset ``name`` into ``out_dir/raw`` and write ``out_dir/<name>.npz``; return its path.

    ``base_url`` replaces the dataset's server (files are fetched from base_url + "/" + file name);
    ``files`` replaces its table of ``{file name: (hashlib algorithm, hex digest)}`` (the file names
    must be the ones the dataset's parser reads).  ``download_options``: ``attempts``, ``timeout``,
    ``progress`` of :func:`download`.
    """
    spec = DATASETS[name]
    base = (base_url or spec["base_url"]).rstrip("/")
    raw = os.path.join(out_dir, "raw")
    paths = {}
    for filename, (algorithm, digest) in (spec["files"] if files is None else files).items():
        paths[filename] = ensure_file(f"{base}/{filename}", os.path.join(raw, filename), algorithm,
                                      digest.lower(), say=say, **download_options)
    arrays = spec["read"](paths)
    out = os.path.join(out_dir, f"{name}.npz")
    with atomic_path(out) as tmp:
        write_npz(tmp, [(key, ArraySource.of(array)) for key, array in arrays.items()])
    say(f"wrote {out}: {len(arrays['y']):,} train and {len(arrays['y_test']):,} test images "
        f"{arrays['x'].shape[1:]} uint8")
    return out


# ---------------------------------------------------------------------------------------------------
# Command line


def _parser():
    p = Parser(prog=f"python -m tools.{PROG}", description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", choices=sorted(DATASETS), help="which dataset to download")
    p.add_argument("-o", "--out-dir", required=True, metavar="DIR",
                   help="writes DIR/<dataset>.npz; keeps the downloaded files in DIR/raw/")
    p.add_argument("--mirror", metavar="URL",
                   help="fetch the same file names from URL/<file> instead of the default server")
    return p


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    if args.mirror is not None and urllib.parse.urlsplit(args.mirror).scheme not in ("http", "https", "file"):
        parser.error(f"--mirror {args.mirror}: give an http://, https:// or file:// URL")
    if not args.out_dir:  # '' would write raw/ and the npz into the current folder
        parser.error("-o must name a folder (it is empty); for example -o data")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        parser.error(f"-o {args.out_dir}: this is a file, not a folder; give a folder for the output")
    return run_main(PROG, lambda: fetch(args.dataset, args.out_dir, base_url=args.mirror) and 0,
                    more={FetchError: 1},
                    interrupted=f"interrupted: no output written; a partial download is kept in "
                                f"{os.path.join(args.out_dir, 'raw')} and resumes when you run the same command again")


if __name__ == "__main__":
    sys.exit(main())
