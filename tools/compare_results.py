"""Run a fixed set of training jobs from a checkout and record what they wrote, to compare two checkouts.

A change that must not change results runs this on the commit before and on
its own, then compares:

    python tools/compare_results.py run /path/to/base base.json [--jobs NAME,...] [--modes auto,numpy]
    python tools/compare_results.py run . mine.json [same options]
    python tools/compare_results.py compare base.json mine.json

Each job is ``python -m towers.train`` run in the checkout (``PYTHONPATH`` set
to it: its own ``towers``, whatever is installed), with ``--quiet
--summary-every 0`` and a fresh ``--logdir``; the record is the md5 of its
``final.npz``, one per ``--cpu-kernels`` value of ``--modes`` (default
``auto``; ``auto,numpy,numba`` checks the CPU ops' NumPy passes and numba's
loops alike, for models whose ``auto`` leaves numba out).  The jobs: the
default job with each optimizer, weights mode, 2 hosts in grads and ps,
LeNet-5, the digits as images with ``--normalize``, ResNet-20 on the digits
and on 32x32x3 synthetic images (made here, seeded), the JPEG TFRecord with ``--augment cifar`` at 0 and 2 input workers
with the decoded-image cache on and off (``../shared/image-samples``; skipped
without it), and an image folder of PNGs (made here, seeded).  Jobs on 2 hosts
need Ray (skipped without it) and start a local Ray each (10-20 s on 2
cores).

``--ignore ema/`` records instead the md5 of final.npz's other arrays (``digest``), for a change meant to
move one part only (the EMA's convention): the weights must still match byte for byte.

Deterministic jobs must match byte for byte.  ``--sync async`` is
nondeterministic by design (the server applies whichever host's gradient
arrives first), so it runs in the first mode only: its one-step job runs
``ASYNC_TRIES`` times and records the set of md5s seen (each is one host's
first gradient applied to the common initial weights, so the sets of two
checkouts must overlap and hold at most one md5 per host); its 300-step job
records the staleness the summary line reports, compared as ranges (printed,
not judged).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy

SAMPLES = Path(__file__).resolve().parents[1] / ".." / "shared" / "image-samples"
BASE = ["--n-gpu", "2", "--steps", "300", "--quiet", "--summary-every", "0"]
HOSTS = ["--hosts", "2", "--n-gpu", "1", "--steps", "300", "--quiet", "--summary-every", "0"]
JPEG = ["--data", str(SAMPLES / "mnist_jpeg_head500.tfrecords"), "--test-data",
        str(SAMPLES / "mnist_png_head500.tfrecords"), "--x-key", "image/encoded", "--y-key", "image/class/label",
        "--decode", "image/encoded:image:28,28,3", "--augment", "cifar", "--steps", "60"]
JOBS = {
    "default": BASE,
    "adam": BASE + ["--optimizer", "adam"],
    "adamw": BASE + ["--optimizer", "adamw"],
    "rmsprop": BASE + ["--optimizer", "rmsprop"],
    "weights": BASE + ["--sync", "weights"],
    "weights K=4 momentum 0.9": BASE + ["--sync", "weights", "--average-every", "4", "--momentum", "0.9"],
    "2 hosts grads": HOSTS,
    "2 hosts ps": HOSTS + ["--sync", "ps"],
    "lenet5": BASE + ["--model", "lenet5", "--steps", "40"],
    "normalize": BASE + ["--normalize", "0.5,0.25", "--steps", "100"],
    "resnet20 digits": BASE + ["--model", "resnet20", "--steps", "12", "--batch-size", "16"],
    "resnet20 32x32x3": BASE + ["--model", "resnet20", "--steps", "8", "--batch-size", "16", "--data", "{cifar}"],
    "jpeg augment, 0 input workers": BASE + JPEG + ["--input-workers", "0"],
    "jpeg augment, 2 input workers": BASE + JPEG + ["--input-workers", "2"],
    "jpeg augment, no image cache, 0 input workers": BASE + JPEG + ["--input-workers", "0", "--no-cache-images"],
    "jpeg augment, no image cache, 2 input workers": BASE + JPEG + ["--input-workers", "2", "--no-cache-images"],
    "image folder, 2 input workers": BASE + ["--data", "{folder}", "--steps", "60", "--input-workers", "2"],
    "image folder, augment, no image cache, 0 input workers": BASE + [
        "--data", "{folder}", "--steps", "60", "--augment", "cifar", "--input-workers", "0", "--no-cache-images"],
}
ASYNC_ONE = HOSTS + ["--sync", "async", "--steps", "1"]
ASYNC_LONG = HOSTS + ["--sync", "async"]
ASYNC_TRIES = 3


def synthetic_cifar(path: Path) -> None:
    """512 training and 128 test images 32x32x3 uint8, labels from a fixed projection (learnable), seeded."""
    rng = numpy.random.default_rng(20)
    x = rng.integers(0, 256, (640, 32, 32, 3), dtype=numpy.uint8)
    proj = rng.standard_normal((32 * 32 * 3, 10)).astype(numpy.float32)
    y = (x.reshape(640, -1).astype(numpy.float32) @ proj).argmax(1).astype(numpy.int64)
    numpy.savez(path, x=x[:512], y=y[:512], x_test=x[512:], y_test=y[512:])


def synthetic_folder(path: Path) -> None:
    """An image folder: 10 class folders of 24 PNGs each, 28x28 grey, seeded (a class is a brighter band)."""
    from PIL import Image

    rng = numpy.random.default_rng(21)
    for k in range(10):
        (path / f"class{k}").mkdir(parents=True)
        for j in range(24):
            a = rng.integers(0, 120, (28, 28), dtype=numpy.uint8)
            a[2 * k + 4: 2 * k + 8] += 120
            Image.fromarray(a).save(path / f"class{k}" / f"{j:03d}.png")


def digest(path: str, ignore: tuple = ()) -> str:
    """md5 of the file ``path``; with ``ignore`` (key prefixes, e.g. ``ema/``), md5 of its other arrays instead
    (each key, dtype, shape and bytes, in key order): what stays the same where a change moved only those."""
    if not ignore:
        with open(path, "rb") as f:
            return hashlib.md5(f.read()).hexdigest()
    h = hashlib.md5()
    with numpy.load(path) as z:
        for key in sorted(k for k in z.files if not k.startswith(ignore)):
            a = z[key]
            h.update(f"{key} {a.dtype.str} {a.shape}".encode())
            h.update(numpy.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def train(checkout: str, args: list[str], ignore: tuple = ()) -> tuple[str, str]:
    """(md5 of final.npz, or of its arrays but those ``ignore`` names: ``digest``; stdout) of one job run from
    ``checkout``."""
    with tempfile.TemporaryDirectory() as logdir:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
        p = subprocess.run([sys.executable, "-m", "towers.train", *args, "--logdir", logdir], cwd=checkout,
                           env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(args)}: exit {p.returncode}\n{p.stderr}")
        return digest(os.path.join(logdir, "final.npz"), ignore), p.stdout


def runnable(name: str) -> bool:
    """Whether this machine can run job ``name``: Ray for 2 hosts, the shared samples for the JPEG jobs."""
    if "hosts" in name or name.startswith("async"):
        try:
            import ray  # noqa: F401
        except ImportError:
            return False
    return not name.startswith("jpeg") or SAMPLES.exists()


def run(checkout: str, out: str, names: list[str], modes: list[str], ignore: tuple = ()) -> None:
    record = {}
    with tempfile.TemporaryDirectory(prefix="compare-results-") as tmp:
        cifar, folder = Path(tmp) / "cifar32.npz", Path(tmp) / "folder"
        synthetic_cifar(cifar)
        synthetic_folder(folder)
        for name in (n for n in names if n != "async"):
            if not runnable(name):
                print(f"{name:34s} skipped (needs Ray or ../shared/image-samples)", flush=True)
                continue
            for mode in modes:
                key = name if len(modes) == 1 else f"{name} / {mode}"
                args = [a.format(cifar=cifar, folder=folder) for a in JOBS[name]] + ["--cpu-kernels", mode]
                record[key] = train(checkout, args, ignore)[0]
                print(f"{key:34s} {record[key]}", flush=True)
    if "async" in names and runnable("async"):
        kernels = ["--cpu-kernels", modes[0]]
        record["async 1 step"] = sorted({train(checkout, ASYNC_ONE + kernels)[0] for _ in range(ASYNC_TRIES)})
        print(f"{'async 1 step':34s} {' '.join(record['async 1 step'])}", flush=True)
        stale = []
        for _ in range(2):
            m = re.search(r"gradient staleness mean ([0-9.]+), max (\d+)", train(checkout, ASYNC_LONG + kernels)[1])
            stale.append([float(m.group(1)), int(m.group(2))] if m else None)
        record["async 300 steps staleness (mean, max)"] = stale
        print(f"{'async 300 steps staleness':34s} {stale}", flush=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    bad = 0
    print(f"| job | {os.path.basename(a_path)} | {os.path.basename(b_path)} | same |\n| --- | --- | --- | --- |")
    for name in a:
        x, y = a[name], b.get(name)
        if name.startswith("async 300"):
            same = "(ranges, not judged)"
        elif isinstance(x, list):
            ok = bool(set(x) & set(y or [])) and len(set(x) | set(y or [])) <= 2  # one outcome per host
            same, bad = ("yes" if ok else "NO"), bad + (not ok)
        else:
            same, bad = ("yes" if x == y else "NO"), bad + (x != y)
        show = (lambda v: " ".join(v) if isinstance(v, list) and v and isinstance(v[0], str) else str(v))
        print(f"| {name} | {show(x)} | {show(y)} | {same} |")
    return 1 if bad else 0


def job_names(text: str) -> list[str]:
    """The jobs of a comma-separated list, where a job's own name may hold commas ("jpeg augment, 0 input
    workers"): pieces are joined until they make a known name (an unknown one is left as it is, for the error)."""
    names, part = [], None
    for piece in text.split(","):
        part = piece.strip() if part is None else f"{part}, {piece.strip()}"
        if part in JOBS or part == "async" or not any(k.startswith(part + ",") for k in JOBS):
            names.append(part)
            part = None
    return names + ([part] if part is not None else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the jobs from CHECKOUT and write their md5s to OUT")
    r.add_argument("checkout")
    r.add_argument("out")
    r.add_argument("--jobs", help=f"comma-separated, of: {', '.join([*JOBS, 'async'])} (default: all)")
    r.add_argument("--modes", default="auto", help="--cpu-kernels values to run each job with (default: auto)")
    r.add_argument("--ignore", default="", help="comma-separated key prefixes of final.npz left out of the record "
                   "(e.g. ema/: the md5 of the other arrays, for a change meant to move the EMA only)")
    c = sub.add_parser("compare", help="print two records side by side; exit 1 where they differ")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    if args.command == "compare":
        return compare(args.a, args.b)
    names = job_names(args.jobs) if args.jobs else [*JOBS, "async"]
    unknown = [n for n in names if n not in JOBS and n != "async"]
    if unknown:
        ap.error(f"unknown jobs {unknown}: use names of {', '.join([*JOBS, 'async'])}")
    run(args.checkout, args.out, names, args.modes.split(","), tuple(p for p in args.ignore.split(",") if p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
