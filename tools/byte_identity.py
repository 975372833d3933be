"""The md5 of ``final.npz`` for a fixed set of training jobs, run from a given towers checkout.

    python -m tools.byte_identity CHECKOUT [--jobs NAME,...] [--modes auto,numpy] [--json OUT]

A change that must keep results byte-identical runs this on the checkout
before it and on the one after, and compares the two tables.  Each job runs
``python -m towers.train`` in a fresh process with ``PYTHONPATH`` set to
CHECKOUT (the code under test, whatever towers is installed), once with
``--cpu-kernels auto`` and once with ``numpy``.  The jobs: the quick start's
two-tower MLP with each optimizer, ``--sync weights``, ``--hosts 2`` (Ray, when
it is installed), LeNet-5, ResNet-20 on the digits and on 32x32x3 synthetic
images (made here, seeded), and the JPEG TFRecord with ``--augment cifar``
(``../shared/image-samples``, skipped without it).  Synthetic data is written to
a temporary folder; nothing is downloaded.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy

SAMPLES = Path(__file__).resolve().parents[1] / ".." / "shared" / "image-samples"

JOBS = {
    "default": [],
    "adam": ["--optimizer", "adam"],
    "adamw": ["--optimizer", "adamw"],
    "rmsprop": ["--optimizer", "rmsprop"],
    "sync-weights": ["--sync", "weights"],
    "hosts-2": ["--hosts", "2", "--n-gpu", "1", "--steps", "200"],
    "lenet5": ["--model", "lenet5", "--steps", "40"],
    "resnet20-digits": ["--model", "resnet20", "--steps", "12", "--batch-size", "16"],
    "resnet20-32x32x3": ["--model", "resnet20", "--steps", "8", "--batch-size", "16", "--data", "{cifar}"],
    "jpeg-augment": ["--data", str(SAMPLES / "mnist_jpeg_head500.tfrecords"),
                     "--test-data", str(SAMPLES / "mnist_png_head500.tfrecords"), "--x-key", "image/encoded",
                     "--y-key", "image/class/label", "--decode", "image/encoded:image:28,28,3", "--augment", "cifar",
                     "--steps", "60", "--input-workers", "0"],
    "jpeg-augment-w2": ["--data", str(SAMPLES / "mnist_jpeg_head500.tfrecords"),
                        "--test-data", str(SAMPLES / "mnist_png_head500.tfrecords"), "--x-key", "image/encoded",
                        "--y-key", "image/class/label", "--decode", "image/encoded:image:28,28,3", "--augment",
                        "cifar", "--steps", "60", "--input-workers", "2"],
    "jpeg-nocache-w0": ["--data", str(SAMPLES / "mnist_jpeg_head500.tfrecords"), "--x-key", "image/encoded",
                        "--y-key", "image/class/label", "--decode", "image/encoded:image:28,28,3", "--augment",
                        "cifar", "--steps", "60", "--input-workers", "0", "--no-cache-images"],
    "jpeg-nocache-w2": ["--data", str(SAMPLES / "mnist_jpeg_head500.tfrecords"), "--x-key", "image/encoded",
                        "--y-key", "image/class/label", "--decode", "image/encoded:image:28,28,3", "--augment",
                        "cifar", "--steps", "60", "--input-workers", "2", "--no-cache-images"],
}


def synthetic_cifar(path: Path) -> None:
    """512 training and 128 test images 32x32x3 uint8, labels from a fixed projection (learnable), seeded."""
    rng = numpy.random.default_rng(20)
    x = rng.integers(0, 256, (640, 32, 32, 3), dtype=numpy.uint8)
    proj = rng.standard_normal((32 * 32 * 3, 10)).astype(numpy.float32)
    y = (x.reshape(640, -1).astype(numpy.float32) @ proj).argmax(1).astype(numpy.int64)
    numpy.savez(path, x=x[:512], y=y[:512], x_test=x[512:], y_test=y[512:])


def run_job(root: Path, args: list, logdir: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-m", "towers.train", "--n-gpu", "2", *args, "--quiet", "--logdir",
                        str(logdir)], cwd=root, env=env, capture_output=True, text=True)
    final = logdir / "final.npz"
    if p.returncode != 0 or not final.exists():
        return "FAILED: " + (p.stderr or p.stdout).strip().splitlines()[-1] if (p.stderr or p.stdout) else "FAILED"
    return hashlib.md5(final.read_bytes()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", help="the towers checkout whose code runs the jobs")
    ap.add_argument("--jobs", help="comma-separated job names (default: all)")
    ap.add_argument("--modes", default="auto,numpy", help="--cpu-kernels values to run each job with")
    ap.add_argument("--json", help="also write {job/mode: md5} here")
    a = ap.parse_args(argv)
    root = Path(a.checkout).resolve()
    names = a.jobs.split(",") if a.jobs else list(JOBS)
    out = {}
    with tempfile.TemporaryDirectory(prefix="byte-identity-") as tmp:
        tmp = Path(tmp)
        cifar = tmp / "cifar32.npz"
        synthetic_cifar(cifar)
        for name in names:
            args = [s.format(cifar=cifar) for s in JOBS[name]]
            if name == "jpeg-augment" and not SAMPLES.exists():
                continue
            if name == "hosts-2":
                try:
                    import ray  # noqa: F401
                except ImportError:
                    continue
            for mode in a.modes.split(","):
                md5 = run_job(root, [*args, "--cpu-kernels", mode], tmp / f"{name}-{mode}")
                out[f"{name}/{mode}"] = md5
                print(f"{name:18s} {mode:6s} {md5}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
