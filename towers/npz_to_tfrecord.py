"""The command line of the npz -> TFRecord converter: ``towers-npz-to-tfrecord`` when installed,
``python -m towers.npz_to_tfrecord`` or ``python -m tools.npz_to_tfrecord`` in a checkout.

Usage::

    python -m tools.npz_to_tfrecord IN.npz -o OUT.tfrecords [--compression none|gzip|zlib]

A thin layer over :func:`towers.data.tfrecord.from_npz.write` (the npz layout it
reads, the records it writes).  Exit status: 0, 1 for unreadable input or a full
disk, 2 for a layout or usage mistake, 130 on Ctrl-C, 143 on SIGTERM; no output
and no temporary files unless the status is 0.
"""
import sys

from towers.cli import Parser, run_writer, say_as
from towers.data.tfrecord.from_npz import LayoutError, NpzError, write

PROG = "npz_to_tfrecord"


def main(argv=None, prog="towers-npz-to-tfrecord"):
    """The command line (``towers-npz-to-tfrecord``, ``python -m tools.npz_to_tfrecord``: ``prog``, the command its usage line names); returns the exit status."""
    p = Parser(prog=prog, name=PROG, description="Write tf.train.Example (or SequenceExample) records from an npz in the "
                                                 "converter's layout.")
    p.add_argument("input", metavar="IN.npz")
    p.add_argument("-o", "--output", required=True, metavar="OUT.tfrecords")
    p.add_argument("--compression", choices=("none", "gzip", "zlib"), default="none")
    args = p.parse_args(argv)
    say, stale = say_as(PROG), []

    def report(n):
        for path in stale:
            say(f"removed {path}: temporary files of a conversion that was killed")
        say(f"wrote {args.output}: {n} records ({args.compression})")

    return run_writer(PROG, lambda: write(args.input, args.output, args.compression, stale), report,
                      more={LayoutError: 2, NpzError: 1})


if __name__ == "__main__":
    sys.exit(main(prog="python -m towers.npz_to_tfrecord"))
