"""Input from TFRecord against what the towers consume, side by side in one run.

    python -m tools.bench_input [--records 24000] [--steps 300] [--repeats 3]

MNIST-shaped records (``image_raw`` 784 bytes, ``label``; from
``../shared/datasets/mnist24k.npz`` when present, else random pixels) are
written to a temporary TFRecord file and its npz twin.  Then, round by round
(each row keeps its best, the machine may be shared):

* **pipeline**: global batches of 200 (``BatchSource`` + ``Prefetcher``, the
  trainer's own input path) read from the TFRecord file by the input thread
  (0 workers) and by 1, 2 and 4 worker processes, and nothing else:
  records/s delivered;
* **consumption**: ``Trainer.train_step`` of 2 CPU towers (MLP 784-500-10,
  batch 100 each) on batches drawn beforehand: records/s the towers eat;
* **training**: ``Trainer.fit`` (input, steps, log lines; no checkpoints or
  summaries) from the npz in memory and from the TFRecord file, with the
  default input workers (one per spare core: none on 2 cores with 2 CPU
  towers) and with 2, timed after the worker processes have started.

It prints the ratios the input work is judged by: pipeline (2 workers) /
consumption (target >= 3) and TFRecord training (default workers) / npz
training (target >= 0.9).

``--images [--reference-python PY]`` measures image input instead, in one run:

* **decode + augmentation**, images/s into global batches of 200 (the same
  ``pipeline_rate``), of synthetic photo-like JPEGs in a TFRecord file in the
  ImageNet layout: 4,000 32x32 ones with ``--augment cifar`` and 400 320x240
  ones with ``--augment imagenet`` to 224x224, with 1 and 2 workers (in
  turn, ``ROUNDS`` times a repeat, as each lasts only seconds); beside
  them ``tf.data`` (TFRecordDataset, parse, ``decode_jpeg``, pad + random
  crop or ``sample_distorted_bounding_box`` + resize, flip,
  ``num_parallel_calls`` = workers) and PyTorch's ``DataLoader`` (the same
  JPEG bytes read from the same file, ``torchvision.io.decode_jpeg``,
  ``RandomCrop(padding=4)`` or ``RandomResizedCrop``, flip; ``num_workers`` =
  workers), each in a subprocess of ``PY`` (an interpreter with TensorFlow,
  torch and torchvision: they are references, not dependencies; their rows
  are left out without it);
* **the machine's own scaling**: two independent processes running the same
  decode + ``cifar`` loop at once, over one alone (no workers, no hand-offs:
  what 2 workers could reach at best; a shared VM gives 1.7-2.0);
* **training** the MLP and LeNet-5 (``--steps`` / 20 steps) with 2 CPU
  towers from MNIST written as JPEG TFRecords (the default workers, and 1)
  against training from the decoded npz.

Ratios: 2 workers / 1 worker (target >= 1.7), towers / tf.data (>= 1.0),
towers / DataLoader (>= 1.5), JPEG training / npz training (>= 0.9).

``--jpeg-epochs [--rounds 3]`` measures the JPEG row instead: ``python -m
towers.train`` with default flags (MLP, 2 towers) for 50 epochs of the first
6,000 MNIST digits, written as a JPEG TFRecord by ``tools.images_to_tfrecord``,
against the same run from the npz of the same decoded pixels
(``tools.tfrecord_to_npz --decode``), and the JPEG run with
``--no-cache-images`` (every epoch decodes again), in alternating rounds; wall
time of the whole command, as a user sees it; the median round of each.  It
prints JPEG / npz (target >= 0.9) and whether the final weights are the same
bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from towers.config import Config
from towers.data.batches import BatchSource, Prefetcher, workers_of
from towers.data.dataset import Dataset
from towers.data.loading import load_dataset
from towers.data.tfrecord.from_npz import write_examples
from towers.devices.cpu_threads import input_workers
from towers.run.trainer import Trainer

MNIST = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "mnist24k.npz"
BATCH = 100  # per tower; 2 towers


def _data(n):
    if MNIST.exists():
        with np.load(MNIST) as z:
            reps = -(-n // len(z["y"]))
            return np.concatenate([z["x"]] * reps)[:n], np.concatenate([z["y"]] * reps)[:n]
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (n, 28, 28), np.uint8), rng.integers(0, 10, n)


def pipeline_rate(dataset, batches):
    source = BatchSource(dataset, 2 * BATCH, seed=0)
    dataset.x[np.arange(2)]  # start the workers outside the timing
    prefetch = Prefetcher(source, batches + 5, workers=workers_of(dataset.x))
    try:
        for _ in range(5):
            prefetch.get()
        t0 = time.perf_counter()
        for _ in range(batches):
            prefetch.get()
        return batches * 2 * BATCH / (time.perf_counter() - t0)
    finally:
        prefetch.close()


def _config(steps, logdir, model="mlp"):
    return Config(devices="cpu", n_gpu=2, batch_size=BATCH, steps=steps, quiet=True, checkpoint_every=0,
                  summary_every=0, log_every=10 ** 6, logdir=logdir, model=model)


def consumption_rate(dataset, steps, logdir):
    with Trainer(_config(steps, logdir), dataset=dataset) as t:
        batches = [t.source.next_batch() for _ in range(16)]
        for x, y in batches[:2]:
            t.train_step(x, y)
        t.synchronize()
        t0 = time.perf_counter()
        for k in range(steps):
            t.train_step(*batches[k % len(batches)])
        t.synchronize()
        return steps * 2 * BATCH / (time.perf_counter() - t0)


def training_rate(dataset, steps, logdir, model="mlp"):
    dataset.x[np.arange(2)]
    # The run's own lines (settings, done) would bury the table.
    with Trainer(_config(steps, logdir, model), dataset=dataset) as t, contextlib.redirect_stdout(io.StringIO()):
        t0 = time.perf_counter()
        t.fit()
        return steps * 2 * BATCH / (time.perf_counter() - t0)


def _pipeline_row(workers):
    return f"pipeline, {workers} worker{'s' * (workers != 1)}"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.bench_input", description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=24000)
    p.add_argument("--steps", type=int, default=300, help="steps per training and per consumption measurement")
    p.add_argument("--batches", type=int, default=300, help="global batches per pipeline measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--images", action="store_true", help="the image rows instead: decode + augmentation")
    p.add_argument("--reference-python", metavar="PYTHON",
                   help="an interpreter with TensorFlow and PyTorch/torchvision for the reference image rows")
    p.add_argument("--jpeg-epochs", action="store_true",
                   help="the JPEG row instead: MLP from a JPEG TFRecord of 6,000 digits, 50 epochs, against the npz")
    p.add_argument("--rounds", type=int, default=3, help="--jpeg-epochs: alternating rounds (median)")
    args = p.parse_args(argv)
    if args.jpeg_epochs:
        return jpeg_epochs_main(args)
    if args.images:
        return image_main(args)
    x, y = _data(args.records)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench_input-") as tmp:
        records = os.path.join(tmp, "mnist.tfrecords")
        write_examples(records, x, y)
        in_memory = Dataset.from_arrays(x, y)
        auto = input_workers(None, cpu_towers=2)
        tfrecord = {w: load_dataset(records, "image_raw", "label", decode="image_raw:uint8:28,28", workers=w)
                    for w in sorted({0, 1, 2, 4, auto})}
        try:
            for r in range(args.repeats):
                measured = {_pipeline_row(w): pipeline_rate(ds, args.batches) for w, ds in tfrecord.items()}
                measured["consumption, 2 CPU towers (MLP)"] = consumption_rate(in_memory, args.steps,
                                                                               os.path.join(tmp, f"c{r}"))
                measured["training from npz"] = training_rate(in_memory, args.steps, os.path.join(tmp, f"n{r}"))
                measured[f"training from TFRecord, {auto} workers"] = training_rate(
                    tfrecord[auto], args.steps, os.path.join(tmp, f"t{r}"))
                if auto != 2:
                    measured["training from TFRecord, 2 workers"] = training_rate(
                        tfrecord[2], args.steps, os.path.join(tmp, f"t2{r}"))
                for name, rate in measured.items():
                    rows[name] = max(rows.get(name, 0.0), rate)
        finally:
            for ds in tfrecord.values():
                ds.close()
    print(f"{args.records:,} records, global batch {2 * BATCH}, best of {args.repeats} ({os.cpu_count()} cores)")
    for name, rate in rows.items():
        print(f"  {name:34s} {rate:12,.0f} records/s")
    consume = rows["consumption, 2 CPU towers (MLP)"]
    for w in sorted({2, auto}):
        print(f"pipeline ({w} workers{', the default here' * (w == auto)}) / consumption: "
              f"{rows[_pipeline_row(w)] / consume:.2f}  (target >= 3)")
    tfr = rows[f"training from TFRecord, {auto} workers"]
    print(f"training TFRecord ({auto} workers) / npz: {tfr / rows['training from npz']:.2f}  (target >= 0.9)")




# -- image input: decode + augmentation against tf.data and PyTorch's DataLoader ---------------------------------

ROUNDS = 3  # rounds of the towers image rows per repeat
IMAGE_SETS = {"cifar": ((32, 32), 4000, 32), "imagenet": ((240, 320), 400, 224)}  # stored size, images, output side


def _photo(rng, h, w):
    """A smooth random RGB image (compresses like a photo, unlike noise)."""
    from PIL import Image

    small = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.BILINEAR))


def write_image_records(path, kind, seed=0):
    """A TFRecord file of JPEGs in the ImageNet layout; returns [(start, end)] of each JPEG in the file."""
    from towers.data.image import codec
    from towers.data.image.to_tfrecord import example
    from towers.data.tfrecord.framing import HEADER, TFRecordWriter

    (h, w), n, _ = IMAGE_SETS[kind]
    rng = np.random.default_rng(seed)
    spans, at = [], 0
    with open(path, "wb") as f, TFRecordWriter(f, "none") as writer:
        for i in range(n):
            jpeg = codec.encode(_photo(rng, h, w), "jpeg")
            payload = example(jpeg, i % 10, (h, w, 3))
            writer.write(payload)
            start = at + HEADER + payload.find(jpeg)
            spans.append((start, start + len(jpeg)))
            at += HEADER + len(payload) + 4
    return spans


def _image_dataset(path, kind, workers):
    side = IMAGE_SETS[kind][2]
    return load_dataset(path, "image/encoded", "image/class/label", decode=f"image/encoded:image:{side},{side},3",
                        workers=workers, augment=kind)


def towers_image_rate(path, kind, workers, batches):
    ds = _image_dataset(path, kind, workers)
    try:
        return pipeline_rate(ds, batches)
    finally:
        ds.close()


def _decode_alone(path, kind, start, seconds):
    """(images/s, wall-clock start and end) of decode + augmentation in this process alone (no workers, no
    hand-offs), for ``seconds`` from the wall-clock time ``start``."""
    ds = _image_dataset(path, kind, 0)
    try:
        rows, epochs = np.arange(2 * BATCH), np.zeros(2 * BATCH, np.int64)
        ds.x.submit(rows, epochs).examples()
        time.sleep(max(0.0, start - time.time()))
        n, began, t0 = 0, time.time(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            ds.x.submit((rows + n) % len(ds.x), epochs).examples()
            n += len(rows)
        return n / (time.perf_counter() - t0), began, time.time()
    finally:
        ds.close()


def machine_scaling(path, kind, seconds=2.0):
    """The machine's own 2-process scaling: images/s of 2 independent processes running the same decode and
    augmentation loop at once, over 1 alone (what 2 workers could reach with free hand-offs); None when the
    two loops could not be made to run at the same time."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(2, multiprocessing.get_context("spawn")) as pool:
        alone = pool.submit(_decode_alone, path, kind, time.time() + 3, seconds).result()[0]
        for lead in (3, 6, 12):  # time for the second process to start and load, on a busy machine too
            start = time.time() + lead
            both = [f.result() for f in [pool.submit(_decode_alone, path, kind, start, seconds) for _ in range(2)]]
            if min(end for _, _, end in both) - max(began for _, began, _ in both) >= 0.9 * seconds:
                return sum(rate for rate, _, _ in both) / alone
    return None


_REFERENCE = r'''
import json, sys, time
kind, framework, path, spans, workers, batches, side = sys.argv[1:8]
workers, batches, side, spans = int(workers), int(batches), int(side), json.loads(spans)
B = 200
if framework == "tf.data":
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(workers)
    tf.config.threading.set_intra_op_parallelism_threads(workers)
    feats = {"image/encoded": tf.io.FixedLenFeature([], tf.string), "image/class/label": tf.io.FixedLenFeature([], tf.int64)}
    def parse(record):
        f = tf.io.parse_single_example(record, feats)
        img = tf.io.decode_jpeg(f["image/encoded"], channels=3)
        if kind == "cifar":
            img = tf.image.random_crop(tf.image.pad_to_bounding_box(img, 4, 4, side + 8, side + 8), [side, side, 3])
        else:
            begin, size, _ = tf.image.sample_distorted_bounding_box(tf.shape(img), tf.zeros([1, 0, 4]),
                min_object_covered=0, aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1), max_attempts=10,
                use_image_if_no_bounding_boxes=True)
            img = tf.cast(tf.image.resize(tf.slice(img, begin, size), [side, side]), tf.uint8)
        return tf.image.random_flip_left_right(img), f["image/class/label"]
    ds = tf.data.TFRecordDataset(path).repeat().map(parse, num_parallel_calls=workers).batch(B).prefetch(2)
    it = iter(ds)
    for _ in range(3): next(it)
    t0 = time.perf_counter()
    for _ in range(batches): next(it)
else:
    import torch, torchvision
    from torchvision.transforms import v2
    torch.set_num_threads(1)
    aug = (v2.Compose([v2.RandomCrop(side, padding=4), v2.RandomHorizontalFlip()]) if kind == "cifar" else
           v2.Compose([v2.RandomResizedCrop(side, antialias=True), v2.RandomHorizontalFlip()]))
    class Records(torch.utils.data.Dataset):
        def __len__(self): return len(spans)
        def __getitem__(self, i):
            a, b = spans[i]
            with open(path, "rb") as f:
                f.seek(a); data = f.read(b - a)
            img = torchvision.io.decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return aug(img), i % 10
    loader = torch.utils.data.DataLoader(Records(), batch_size=B, shuffle=True, num_workers=workers,
                                         persistent_workers=True, drop_last=True)
    def batches_forever():
        while True:
            yield from loader
    it = batches_forever()
    for _ in range(3): next(it)
    t0 = time.perf_counter()
    for _ in range(batches): next(it)
print(batches * B / (time.perf_counter() - t0))
'''


def reference_rate(python, framework, kind, path, spans, workers, batches):
    """images/s of ``framework`` run by ``python`` (an interpreter with it installed), or None."""
    import json
    import subprocess

    side = IMAGE_SETS[kind][2]
    r = subprocess.run([python, "-c", _REFERENCE, kind, framework, path, json.dumps(spans), str(workers),
                        str(batches), str(side)], capture_output=True, text=True,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    return float(r.stdout.split()[-1]) if r.returncode == 0 and r.stdout.split() else None


def write_mnist_jpeg(path, x, y):
    """MNIST digits as grey JPEGs (quality 90) in the ImageNet layout."""
    from towers.data.image import codec
    from towers.data.image.to_tfrecord import example
    from towers.data.tfrecord.framing import TFRecordWriter

    with open(path, "wb") as f, TFRecordWriter(f, "none") as writer:
        for img, label in zip(x, y):
            writer.write(example(codec.encode(img[:, :, None], "jpeg"), int(label), img.shape + (1,)))


TRAINED = {"mlp": 1, "lenet5": 20}  # model -> steps divisor (a LeNet-5 step costs ~60 MLP steps)


def training_rows(tmp, args, r):
    """Training the MLP and LeNet-5 (2 CPU towers) from MNIST as JPEG TFRecords against from the decoded npz."""
    x, y = _data(args.records)
    jpeg = os.path.join(tmp, "mnist-jpeg.tfrecords")
    if not os.path.exists(jpeg):
        write_mnist_jpeg(jpeg, x, y)
    decoded = Dataset.from_arrays(x[:, :, :, None], y)
    auto = input_workers(None, cpu_towers=2)
    rows = {}
    for model, divisor in TRAINED.items():
        steps = max(10, args.steps // divisor)
        rows[f"{model}: training from decoded npz"] = training_rate(decoded, steps, os.path.join(tmp, f"n{r}{model}"),
                                                                    model)
        for w in sorted({auto, 1}):
            ds = load_dataset(jpeg, "image/encoded", "image/class/label", decode="image/encoded:image:28,28,1",
                              workers=w)
            try:
                rows[f"{model}: training from JPEG, {w} workers"] = training_rate(
                    ds, steps, os.path.join(tmp, f"j{w}{r}{model}"), model)
            finally:
                ds.close()
    return rows


def image_main(args):
    rows, scaling = {}, []
    with tempfile.TemporaryDirectory(prefix="bench_images-") as tmp:
        files = {kind: os.path.join(tmp, f"{kind}.tfrecords") for kind in IMAGE_SETS}
        spans = {kind: write_image_records(path, kind) for kind, path in files.items()}
        for r in range(args.repeats):
            for name, rate in training_rows(tmp, args, r).items():
                rows[name] = max(rows.get(name, 0.0), rate)
            for kind, path in files.items():
                batches = 100 if kind == "cifar" else 20  # a few seconds each: worker start-up and hand-offs even out
                # The towers rows take seconds (the references, with their imports, much longer): ROUNDS rounds
                # of 1 and 2 workers in turn, so that their ratio does not hang on one moment of a shared machine.
                measured = {}
                for _, w in itertools.product(range(ROUNDS), (1, 2)):
                    name = f"{kind}: towers, {w} worker{'s' * (w > 1)}"
                    measured[name] = max(measured.get(name, 0.0), towers_image_rate(path, kind, w, batches))
                for fw, w in itertools.product(("tf.data", "DataLoader") if args.reference_python else (), (1, 2)):
                    measured[f"{kind}: {fw}, {w} worker{'s' * (w > 1)}"] = reference_rate(
                        args.reference_python, fw, kind, path, spans[kind], w, batches)
                for name, rate in measured.items():
                    if rate is not None:
                        rows[name] = max(rows.get(name, 0.0), rate)
                if kind == "cifar":
                    scaling.append(machine_scaling(path, kind))
    print(f"decode + augmentation of JPEGs in TFRecord files, global batch 200, best of {args.repeats} "
          f"(towers' image rows: of {args.repeats * ROUNDS}) ({os.cpu_count()} cores); cifar: 32x32 -> 32x32, "
          "imagenet: 320x240 -> 224x224")
    for name, rate in rows.items():
        print(f"  {name:34s} {rate:12,.0f} images/s")
    auto = input_workers(None, cpu_towers=2)
    for model in TRAINED:
        for w in sorted({auto, 1}):
            print(f"{model}: training from JPEG ({w} workers) / decoded npz: "
                  f"{rows[f'{model}: training from JPEG, {w} workers'] / rows[f'{model}: training from decoded npz']:.2f}"
                  "  (target >= 0.9)")
    for kind in IMAGE_SETS:
        ours = rows.get(f"{kind}: towers, 2 workers")
        print(f"{kind}: 2 workers / 1 worker: {ours / rows[f'{kind}: towers, 1 worker']:.2f}  (target >= 1.7)")
        if kind == "cifar":
            print(f"cifar: this machine's own, 2 independent processes / 1, the same loop: "
                  f"{', '.join('-' if v is None else f'{v:.2f}' for v in scaling)} (each repeat)")
        for fw, target in (("tf.data", 1.0), ("DataLoader", 1.5)):
            theirs = rows.get(f"{kind}: {fw}, 2 workers")
            if theirs:
                print(f"{kind}: towers / {fw}, 2 workers: {ours / theirs:.2f}  (target >= {target})")



# -- the JPEG row: MLP from a JPEG TFRecord, 50 epochs, default flags, against the decoded npz -------------------

JPEG_DIGITS, JPEG_EPOCHS = 6000, 50
JPEG_FLAGS = ("--x-key", "image/encoded", "--y-key", "image/class/label", "--decode", "image/encoded:image:28,28,1")


def _tool(*args):
    subprocess.run([sys.executable, "-m", *args], check=True, cwd=Path(__file__).resolve().parents[1],
                   stdout=subprocess.DEVNULL)


def _timed_run(data, logdir, *flags):
    """Wall seconds of ``python -m towers.train`` (default flags but the data's and ``flags``), and its weights' md5."""
    steps = JPEG_DIGITS * JPEG_EPOCHS // 100  # the default global batch: 100 (one tower where no GPU is found)
    t0 = time.perf_counter()
    _tool("towers.train", "--data", data, "--steps", str(steps), "--quiet", "--logdir", logdir, *flags)
    seconds = time.perf_counter() - t0
    with open(os.path.join(logdir, "final.npz"), "rb") as f:
        return seconds, hashlib.md5(f.read()).hexdigest()


def jpeg_epochs_main(args):
    x, y = _data(JPEG_DIGITS)
    with tempfile.TemporaryDirectory(prefix="bench_jpeg-") as tmp:
        digits, jpeg, npz = (os.path.join(tmp, name) for name in ("digits.npz", "digits.tfrecords", "decoded.npz"))
        np.savez(digits, x=x, y=y)
        _tool("tools.images_to_tfrecord", digits, "-o", jpeg)
        _tool("tools.tfrecord_to_npz", jpeg, "-o", npz, "--decode", JPEG_FLAGS[-1], "--x", "image/encoded", "--y",
              "image/class/label")
        runs = {"npz": (npz,), "JPEG (cache)": (jpeg, *JPEG_FLAGS), "JPEG (--no-cache-images)": (jpeg, *JPEG_FLAGS,
                                                                                                 "--no-cache-images")}
        seconds, weights = {name: [] for name in runs}, {}
        for r in range(args.rounds):
            for k, (name, flags) in enumerate(runs.items()):
                t, weights[name] = _timed_run(flags[0], os.path.join(tmp, f"run{r}-{k}"), *flags[1:])
                seconds[name].append(t)
    median = {name: statistics.median(ts) for name, ts in seconds.items()}
    print(f"MLP from a JPEG TFRecord of {JPEG_DIGITS:,} MNIST digits, {JPEG_EPOCHS} epochs, default flags "
          f"({os.cpu_count()} cores), median of {args.rounds} alternating rounds, wall time of the command:")
    for name, t in median.items():
        print(f"  {name:26s} {t:8.2f} s  (rounds: {', '.join(f'{v:.2f}' for v in seconds[name])})")
    for name in ("JPEG (cache)", "JPEG (--no-cache-images)"):
        same = "same final weights" if weights[name] == weights["npz"] else "final weights DIFFER"
        print(f"{name} / npz: {median['npz'] / median[name]:.2f}  (target >= 0.9; {same})")


if __name__ == "__main__":
    main()
