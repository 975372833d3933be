"""Benchmark the TFRecord -> npz converter on an MNIST-schema file.

Usage::

    python -m tools.bench_tfrecord [--records 50000] [--input FILE.tfrecords]

Builds a file of at least ``--records`` records in a temporary folder by
repeating ``--input`` (default: ``../shared/tfrecord-samples/
mnist_t10k_head1000.tfrecords`` beside the repository), then:

1. times the whole conversion (``python -m tools.tfrecord_to_npz``, in
   process, CRC checks on as always) and prints records/s;
2. times each part alone to show where the time goes: framing + both CRCs
   (:class:`~tools.tfrecord.TFRecordReader`), the protobuf parse alone,
   column assembly (parse + extraction + spill, minus the parse), and the
   npz write.  Parts are timed in separate passes (this pass holds the
   whole input in memory, unlike the converter), so they add up only
   roughly to the whole.
"""

import argparse
import contextlib
import io
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

from tools import tfrecord_to_npz
from towers.files import write_npz
from towers.data.tfrecord.framing import TFRecordReader
from towers.data.tfrecord.columns import ColumnStore
from towers.data.tfrecord.proto import SequenceExample

DEFAULT_INPUT = Path(__file__).resolve().parents[1].parent / "shared" / "tfrecord-samples" / "mnist_t10k_head1000.tfrecords"


def build(source, records, path):
    """Write ``source`` repeated until the file has at least ``records`` records; return the count."""
    per_copy = sum(len(b.payloads) for b in TFRecordReader(str(source)))
    copies = math.ceil(records / per_copy)
    with open(source, "rb") as src, open(path, "wb") as out:
        data = src.read()
        for _ in range(copies):
            out.write(data)
    return per_copy * copies


def _timed(function):
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def _parse_only(batches):
    parse = SequenceExample.FromString
    for batch in batches:
        for payload in batch.payloads:
            parse(payload)  # discarded at once, as in the converter


def parts(path, spill_dir):
    """Seconds spent in framing+CRC, parse, column assembly and npz write."""
    batches = []
    t_frame, _ = _timed(lambda: batches.extend(TFRecordReader(path)))
    t_parse, _ = _timed(lambda: _parse_only(batches))
    store = ColumnStore(spill_dir)
    t_columns, _ = _timed(lambda: [store.add(b, path) for b in batches])
    t_write, _ = _timed(lambda: write_npz(os.path.join(spill_dir, "part.npz"), store.entries()))
    return {"framing + CRC": t_frame, "protobuf parse": t_parse,
            "column assembly (extract + spill)": t_columns - t_parse, "npz write": t_write}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.bench_tfrecord", description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=50_000)
    p.add_argument("--input", type=Path, default=DEFAULT_INPUT)
    p.add_argument("--repeat", type=int, default=3, help="timed conversions; the best is reported")
    args = p.parse_args(argv)
    if not args.input.is_file():
        raise SystemExit(f"bench_tfrecord: {args.input} not found; pass --input FILE.tfrecords")
    work = tempfile.mkdtemp(prefix="bench_tfrecord-")
    try:
        data = os.path.join(work, "bench.tfrecords")
        n = build(args.input, args.records, data)
        size_mb = os.path.getsize(data) / 1e6
        print(f"input: {n} records, {size_mb:.1f} MB ({args.input.name} repeated), {os.cpu_count()} CPU cores")
        out = os.path.join(work, "out.npz")
        with contextlib.redirect_stderr(io.StringIO()):  # the converter's own summary lines
            best = min(_timed(lambda: tfrecord_to_npz.main([data, "-o", out]))[0] for _ in range(args.repeat))
        print(f"end to end: {best:.3f} s = {n / best:,.0f} records/s, {size_mb / best:.0f} MB/s "
              f"(best of {args.repeat})")
        timed = parts(data, work)
        total = sum(timed.values())
        for name, seconds in timed.items():
            print(f"  {name:34s} {seconds:6.3f} s  {100 * seconds / total:4.0f}%  "
                  f"{seconds / n * 1e6:5.2f} us/record")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
