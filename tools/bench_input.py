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
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from towers.config import Config
from towers.data.batches import BatchSource, Prefetcher
from towers.data.dataset import Dataset
from towers.data.loading import load_dataset
from towers.data.tfrecord.from_npz import write_examples
from towers.data.tfrecord.records import close_dataset
from towers.devices.cpu_threads import input_workers
from towers.trainer import Trainer

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
    prefetch = Prefetcher(source, batches + 5)
    try:
        for _ in range(5):
            prefetch.get()
        t0 = time.perf_counter()
        for _ in range(batches):
            prefetch.get()
        return batches * 2 * BATCH / (time.perf_counter() - t0)
    finally:
        prefetch.close()


def _config(steps, logdir):
    return Config(devices="cpu", n_gpu=2, batch_size=BATCH, steps=steps, quiet=True, checkpoint_every=0,
                  summary_every=0, log_every=10 ** 6, logdir=logdir)


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


def training_rate(dataset, steps, logdir):
    dataset.x[np.arange(2)]
    with Trainer(_config(steps, logdir), dataset=dataset) as t:
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
    args = p.parse_args(argv)
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
                close_dataset(ds)
    print(f"{args.records:,} records, global batch {2 * BATCH}, best of {args.repeats} ({os.cpu_count()} cores)")
    for name, rate in rows.items():
        print(f"  {name:34s} {rate:12,.0f} records/s")
    consume = rows["consumption, 2 CPU towers (MLP)"]
    for w in sorted({2, auto}):
        print(f"pipeline ({w} workers{', the default here' * (w == auto)}) / consumption: "
              f"{rows[_pipeline_row(w)] / consume:.2f}  (target >= 3)")
    tfr = rows[f"training from TFRecord, {auto} workers"]
    print(f"training TFRecord ({auto} workers) / npz: {tfr / rows['training from npz']:.2f}  (target >= 0.9)")


if __name__ == "__main__":
    main()
