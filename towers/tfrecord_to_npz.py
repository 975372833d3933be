"""The command line of the TFRecord -> npz converter: ``towers-tfrecord-to-npz`` when installed,
``python -m towers.tfrecord_to_npz`` or ``python -m tools.tfrecord_to_npz`` in a checkout.

Usage::

    python -m tools.tfrecord_to_npz INPUT [INPUT ...] -o OUT.npz [options]
    python -m tools.tfrecord_to_npz output.tfrecords -o mnist.npz \\
        --decode image_raw:uint8:28,28 --x image_raw --y label

A thin layer over :mod:`towers.data.tfrecord.convert`, which reads and writes
(INPUT globs, the pipeline, atomic output).  ``--schema`` prints what the
records hold and writes nothing.

Exit status: 0 on success, 1 for damaged or unreadable input (one line naming
file, record index and byte offset) or a full disk, 2 for a usage mistake
(including OUT being an input), 130 on Ctrl-C, 143 on SIGTERM.  No OUT and no
temporary files are left behind unless the status is 0; what a SIGKILL leaves
is removed by the next run writing to the same folder.  See tools/README.md.
"""
import sys
import time

from towers.cli import Parser, run_writer, say_as
from towers.errors import flags_in_messages, render
from towers.data.image.convert import UndecodableImage
from towers.data.tfrecord.convert import CHUNK_SIZE, Reading, convert, schema
from towers.data.tfrecord.framing import COMPRESSIONS, TFRecordError
from towers.data.tfrecord.schema import UsageError

PROG = "tfrecord_to_npz"


def _parser(prog):
    p = Parser(prog=prog, name=PROG,
               description="Convert TFRecord files of tf.train.Example / SequenceExample records to one .npz.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="TFRecord file or glob (matches read sorted)")
    p.add_argument("-o", "--output", metavar="OUT.npz", help="output file (required unless --schema)")
    p.add_argument("--compression", choices=COMPRESSIONS, default="auto",
                   help="input compression; auto detects gzip/zlib per file (default: auto)")
    p.add_argument("--decode", action="append", default=[], metavar="NAME:DTYPE[:SHAPE]",
                   help="turn a fixed-length bytes feature into a dense array, e.g. image_raw:uint8:28,28")
    p.add_argument("--x", metavar="NAME", help="also write this feature's dense array as 'x'")
    p.add_argument("--y", metavar="NAME", help="also write this feature's dense array as 'y'")
    p.add_argument("--schema", action="store_true", help="print the inferred schema and write nothing")
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="skip: drop records whose payload CRC fails (framing intact) and count them")
    p.add_argument("--compress", action="store_true", help="deflate the npz members (smaller, slower)")
    p.add_argument("--chunk-size", type=int, default=CHUNK_SIZE, metavar="BYTES",
                   help="bytes read and converted per batch, > 0 (default 8 MiB)")
    p.add_argument("--input-workers", type=int, default=None, metavar="N",
                   help="processes that decode images for --decode NAME:image:H,W,C (default: one per core)")
    return p


def _print_schema(found):
    print(f"{found.rows} records ({found.kind}) in {found.files} file(s)")
    for line in found.lines:
        print(line)
    if found.proposal:
        with flags_in_messages():
            print("proposed: " + render(found.proposal).replace("--x-key", "--x").replace("--y-key", "--y"))


def main(argv=None, prog="towers-tfrecord-to-npz"):
    """The command line (``towers-tfrecord-to-npz``, ``python -m tools.tfrecord_to_npz``); the exit status."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.input_workers is not None and args.input_workers < 0:
        parser.error(f"--input-workers must be >= 0, got {args.input_workers}")
    if args.chunk_size <= 0:  # 0 would read nothing and write an empty npz
        parser.error(f"--chunk-size must be > 0 (bytes read per batch), got {args.chunk_size}")
    say = say_as(PROG)
    reading = Reading(args.compression, args.on_error, args.chunk_size, progress=True)
    start = time.perf_counter()

    def write():
        if args.schema:
            return schema(args.inputs, reading, say, args.decode)
        return convert(args.inputs, args.output, args.decode, args.x, args.y, args.compress, args.input_workers,
                       reading, say)

    def report(done):
        if args.schema:
            return _print_schema(done)
        seconds = time.perf_counter() - start
        say(f"wrote {args.output}: {done.rows} {done.kind} records, {done.features} features, {done.arrays} arrays "
            f"in {seconds:.1f} s ({done.rows / max(seconds, 1e-9):,.0f} records/s)")

    return run_writer(PROG, write, report, more={TFRecordError: 1, UndecodableImage: 1, UsageError: 2})


if __name__ == "__main__":
    sys.exit(main(prog="python -m towers.tfrecord_to_npz"))
