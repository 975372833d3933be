"""towers.data.fetch (``python -m tools.fetch_data``) against a local HTTP server on 127.0.0.1 serving tiny
files made here.

Never the internet: the library tests pass their own file table (sums of the tiny files) and base
URL to ``fetch``; the CLI tests use ``--mirror`` with the real table, whose sums cannot match.
Library tests that need no second try pass ``retries=0``: pooch waits a second before one.
"""
from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import os
import socket
import struct
import tarfile
import threading

import numpy as np
import pytest

from tests import commands
from towers.data.fetch import FetchError, fetch, read_idx

IDX_NAMES = {"x": "train-images-idx3-ubyte.gz", "y": "train-labels-idx1-ubyte.gz",
             "x_test": "t10k-images-idx3-ubyte.gz", "y_test": "t10k-labels-idx1-ubyte.gz"}
CIFAR_TAR = "cifar-10-binary.tar.gz"


def idx_bytes(array, type_byte=0x08):
    header = bytes([0, 0, type_byte, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


def mnist_like(seed=0):
    rng = np.random.default_rng(seed)
    arrays = {"x": rng.integers(0, 256, (5, 28, 28), dtype=np.uint8), "y": rng.integers(0, 10, 5),
              "x_test": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8), "y_test": rng.integers(0, 10, 3)}
    return arrays, {IDX_NAMES[key]: idx_bytes(a) for key, a in arrays.items()}


def cifar_batch(x, y):
    """Binary CIFAR records: label byte + R, G, B planes (CHW) of each NHWC image."""
    return b"".join(bytes([int(label)]) + image.transpose(2, 0, 1).tobytes() for image, label in zip(x, y))


def cifar_tar(batches):
    """A gzip'd tar with cifar-10-batches-bin/<name> members, as the real one is laid out."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, blob in {"batches.meta.txt": b"airplane\n", **batches}.items():
            info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return buffer.getvalue()


def cifar_like(seed=1):
    rng = np.random.default_rng(seed)
    counts = {f"data_batch_{i}.bin": 2 for i in range(1, 6)} | {"test_batch.bin": 3}
    parts = {name: (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n))
             for name, n in counts.items()}
    train = [parts[f"data_batch_{i}.bin"] for i in range(1, 6)]
    arrays = {"x": np.concatenate([p[0] for p in train]), "y": np.concatenate([p[1] for p in train]),
              "x_test": parts["test_batch.bin"][0], "y_test": parts["test_batch.bin"][1]}
    return arrays, {CIFAR_TAR: cifar_tar({name: cifar_batch(*p) for name, p in parts.items()})}


def table(files, algorithm="md5"):
    return {name: (algorithm, hashlib.new(algorithm, blob).hexdigest()) for name, blob in files.items()}


class Server:
    """Serves ``files``; records (name, Range header) per request.

    ``drop``: {name: K}: the first request for that name announces the full length, sends K bytes and
    closes the connection.  ``honor_range``: answer a Range request with 206 (else a full 200).
    """

    def __init__(self, files, drop=None, honor_range=True):
        self.files, self.drop, self.honor_range, self.requests = files, dict(drop or {}), honor_range, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name, wanted = self.path.lstrip("/"), self.headers.get("Range")
                server.requests.append((name, wanted))
                if name not in server.files:
                    self.send_error(404)
                    return
                data, status, start = server.files[name], 200, 0
                if name in server.drop:
                    cut = server.drop.pop(name)
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[:cut])
                    self.close_connection = True
                    return
                if wanted and server.honor_range:
                    start = int(wanted.removeprefix("bytes=").rstrip("-"))
                    if start >= len(data):
                        self.send_error(416)
                        return
                    status = 206
                self.send_response(status)
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                self.wfile.write(data[start:])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # A short poll interval: shutdown() waits up to one interval.
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(files, **options):
        servers.append(Server(files, **options))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def run_fetch(name, out, server, files, messages=None, **options):
    say = (messages.append if messages is not None else lambda m: None)
    return fetch(name, str(out), base_url=server.url, files=files, say=say, progress=False, **options)


def assert_npz(path, arrays):
    with np.load(path) as got:
        assert sorted(got.files) == ["x", "x_test", "y", "y_test"]
        for key, want in arrays.items():
            assert got[key].dtype == (np.uint8 if key.startswith("x") else np.int64), key
            np.testing.assert_array_equal(got[key], want, err_msg=key)


def cli(*args):
    return commands.run("tools.fetch_data", *args, timeout=60)


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------


def test_mnist_format_round_trip_and_second_run_downloads_nothing(tmp_path, serve):
    arrays, files = mnist_like()
    server = serve(files)
    out = run_fetch("mnist", tmp_path / "data", server, table(files, "sha256"))
    assert out == str(tmp_path / "data" / "mnist.npz")
    assert_npz(out, arrays)
    for name, blob in files.items():
        assert (tmp_path / "data" / "raw" / name).read_bytes() == blob
    assert len(server.requests) == 4
    messages = []
    run_fetch("mnist", tmp_path / "data", server, table(files, "sha256"), messages)
    assert len(server.requests) == 4  # every sum matched: nothing downloaded again
    assert sum("already downloaded" in m for m in messages) == 4
    assert_npz(out, arrays)


def test_cifar_binary_round_trip_nhwc(tmp_path, serve):
    arrays, files = cifar_like()
    out = run_fetch("cifar10", tmp_path, serve(files), table(files))
    assert_npz(out, arrays)
    with np.load(out) as got:
        assert got["x"].shape == (10, 32, 32, 3) and got["x_test"].shape == (3, 32, 32, 3)


def files_in(folder):
    """The files under ``folder`` (none if it does not exist): pooch's temporary downloads would show here."""
    return sorted(p.name for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def test_dropped_connection_is_downloaded_again(tmp_path, serve):
    arrays, files = mnist_like()
    name = IDX_NAMES["x"]
    server = serve(files, drop={name: 700})
    run_fetch("mnist", tmp_path, server, table(files), retries=1)
    assert [r for n, r in server.requests if n == name] == [None, None]  # from the start: pooch does not resume
    assert (tmp_path / "raw" / name).read_bytes() == files[name]
    assert files_in(tmp_path / "raw") == sorted(files)
    assert_npz(tmp_path / "mnist.npz", arrays)


def test_a_download_that_keeps_failing_is_one_line_and_leaves_no_partial_file(tmp_path, serve):
    _, files = cifar_like()
    server = serve(files, drop={CIFAR_TAR: 1000})
    with pytest.raises(FetchError) as info:
        run_fetch("cifar10", tmp_path, server, table(files), retries=0)
    message = str(info.value)
    assert message == (f"cannot download {server.url}/{CIFAR_TAR}: the connection broke before the end of the file; "
                       "check the network connection, or pass --mirror URL to fetch the same files from another server")
    assert files_in(tmp_path) == []


def test_damaged_raw_file_is_replaced(tmp_path, serve):
    arrays, files = mnist_like()
    server = serve(files)
    run_fetch("mnist", tmp_path, server, table(files))
    (tmp_path / "raw" / IDX_NAMES["y"]).write_bytes(b"damaged")
    messages = []
    run_fetch("mnist", tmp_path, server, table(files), messages)
    assert any(IDX_NAMES["y"] in m and "does not match" in m for m in messages)
    assert len(server.requests) == 5
    assert_npz(tmp_path / "mnist.npz", arrays)


def test_checksum_mismatch_in_library_deletes_the_download(tmp_path, serve):
    _, files = mnist_like()
    sums = table(files) | {IDX_NAMES["y"]: ("md5", "0" * 32)}
    with pytest.raises(FetchError) as info:
        run_fetch("mnist", tmp_path, serve(files), sums, retries=0)
    message = str(info.value)
    assert f"deleted the bad download (it would have been {tmp_path / 'raw' / IDX_NAMES['y']})" in message
    assert "md5" in message and "0" * 32 in message
    assert files_in(tmp_path / "raw") == [IDX_NAMES["x"]]  # the good one before it is kept, no temporary file
    assert not (tmp_path / "mnist.npz").exists()


def test_cli_checksum_mismatch_with_mirror(tmp_path, serve):
    _, files = mnist_like()  # the real table's published sums cannot match these tiny files
    server = serve(files)
    out = tmp_path / "data"
    result = cli("mnist", "-o", str(out), "--mirror", server.url + "/")
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    first = "train-images-idx3-ubyte.gz"
    assert f"{server.url}/{first}" in errors[0]
    assert f"deleted the bad download (it would have been {out / 'raw' / first})" in errors[0]
    assert "f68b3c2dcbeaaa9fbdd348bbdeb94873" in errors[0]
    assert files_in(out) == []
    assert server.requests == [(first, None)] * 2  # tried again once, then stopped before the next file


def test_cli_connection_refused_is_one_line_and_writes_nothing(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    result = cli("fashion-mnist", "-o", str(tmp_path / "data"), "--mirror", url)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{url}/train-images-idx3-ubyte.gz" in lines[0] and "--mirror" in lines[0]
    assert "refused" in lines[0].lower()
    assert files_in(tmp_path / "data") == []


def test_http_error_names_the_url(tmp_path, serve):
    _, files = mnist_like()
    server = serve({})
    with pytest.raises(FetchError, match=r"cannot download http://127\.0\.0\.1:\d+/train-images-idx3-ubyte\.gz: "
                                         r"HTTP 404 .*--mirror"):
        run_fetch("mnist", tmp_path, server, table(files), retries=0)
    assert files_in(tmp_path) == []


@pytest.mark.parametrize("args", [["svhn", "-o", "x"], ["mnist"], ["mnist", "-o", "x", "--mirror", "ftp://host/m"],
                                  ["mnist", "-o", "x", "--mirror", "file:///tmp/m"]])
def test_cli_flag_mistakes_exit_2(tmp_path, args):
    result = cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "error" in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr  # one line, as towers.train gives, not usage + line


def test_cli_empty_out_dir_exits_2_before_the_network(tmp_path):
    result = cli("mnist", "-o", "", "--mirror", f"http://127.0.0.1:{closed_port()}")
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1 and "-o must name a folder" in result.stderr, result.stderr


def test_cli_out_dir_that_is_a_file_exits_2(tmp_path):
    target = tmp_path / "file"
    target.write_bytes(b"keep me")
    result = cli("mnist", "-o", str(target), "--mirror", "http://127.0.0.1:9")
    assert result.returncode == 2 and "not a folder" in result.stderr
    assert target.read_bytes() == b"keep me"


MALFORMED = [
    (b"not gzip", "not a readable gzip file"),
    (gzip.compress(b"\x01\x00\x08\x01\x00\x00\x00\x02ab"), "not an idx file"),
    (idx_bytes(np.zeros(4, np.uint8), type_byte=0x0D), "data type 0x0d is not unsigned byte"),
    (idx_bytes(np.zeros((2, 2, 2), np.uint8)), "has 3 dimension(s), expected 1"),
    (gzip.compress(b"\x00\x00\x08\x01\x00\x00"), "header is cut short"),
    (gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x05abc"), "promises 5 data bytes"),
    (idx_bytes(np.array([1, 10], np.uint8)), "label 10 is out of range"),
]


# Named by the message: gzip's bytes hold the time of compression, and pytest-xdist's workers must collect the
# same test names.
@pytest.mark.parametrize("blob, expected", MALFORMED, ids=[expected for _, expected in MALFORMED])
def test_malformed_idx_is_one_line(tmp_path, blob, expected):
    path = tmp_path / "f.gz"
    path.write_bytes(blob)
    with pytest.raises(FetchError) as info:
        read_idx(str(path), ndim=1)
    assert expected in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


def test_malformed_files_stop_before_writing(tmp_path, serve):
    _, files = mnist_like()
    files[IDX_NAMES["y_test"]] = idx_bytes(np.zeros(2, np.uint8))  # 3 test images, 2 labels
    with pytest.raises(FetchError, match="has 3 images but .* has 2 labels"):
        run_fetch("mnist", tmp_path / "m", serve(files), table(files))
    assert not (tmp_path / "m" / "mnist.npz").exists()

    batches = {f"data_batch_{i}.bin": bytes(3073) for i in range(1, 6)} | {"test_batch.bin": bytes(3072)}
    files = {CIFAR_TAR: cifar_tar(batches)}
    with pytest.raises(FetchError, match=r"test_batch\.bin: 3,072 bytes is not a whole number of 3073-byte"):
        run_fetch("cifar10", tmp_path / "c", serve(files), table(files))
    files = {CIFAR_TAR: cifar_tar({"data_batch_1.bin": bytes(3073)})}
    with pytest.raises(FetchError, match=r"lacks data_batch_2\.bin, .*test_batch\.bin"):
        run_fetch("cifar10", tmp_path / "d", serve(files), table(files))
    assert not (tmp_path / "c" / "cifar10.npz").exists() and not (tmp_path / "d" / "cifar10.npz").exists()


def test_a_refused_download_leaves_no_folder_it_made(tmp_path):
    # Before: towers-fetch-data refused offline left an empty data/raw/ (and data/) behind.
    url = f"http://127.0.0.1:{closed_port()}"
    result = cli("mnist", "-o", str(tmp_path / "data" / "sets"), "--mirror", url)
    assert result.returncode == 1 and "refused" in result.stderr.lower(), result.stderr
    assert os.listdir(tmp_path) == []
    (tmp_path / "mine").mkdir()  # a folder that was there stays, with what it holds
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert cli("mnist", "-o", str(tmp_path / "mine"), "--mirror", url).returncode == 1
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


def test_verified_files_keep_their_folder_when_a_later_file_fails(tmp_path, serve):
    arrays, files = mnist_like()
    first = next(iter(files))  # fetched first
    server = serve({first: files[first]})  # the others: 404
    with pytest.raises(FetchError):
        run_fetch("mnist", tmp_path / "data", server, table(files), retries=0)
    assert sorted(os.listdir(tmp_path / "data" / "raw")) == [first]
