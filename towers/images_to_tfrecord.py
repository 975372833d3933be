"""The command line that writes an npz or an image folder as TFRecord shards in TensorFlow's ImageNet layout:
``towers-images-to-tfrecord`` when installed, ``python -m towers.images_to_tfrecord`` or
``python -m tools.images_to_tfrecord`` in a checkout.

Usage::

    python -m tools.images_to_tfrecord mnist.npz -o mnist-train --encode jpeg --shards 4
    python -m tools.images_to_tfrecord mnist.npz -o mnist-test --test --encode png
    python -m tools.images_to_tfrecord photos/ -o photos.tfrecords

A thin layer over :func:`towers.data.image.to_tfrecord.convert` (the records'
layout, sharding, atomic output).  Exit status: 0, 1 for unreadable input or a
full disk, 2 for a usage mistake, 130 on Ctrl-C, 143 on SIGTERM; an error,
Ctrl-C or SIGTERM leaves no shard.
"""
import sys

from towers.cli import Parser, run_writer, say_as
from towers.data.image import codec
from towers.data.image.to_tfrecord import convert

PROG = "images_to_tfrecord"


def main(argv=None, prog="towers-images-to-tfrecord"):
    """The command line (``towers-images-to-tfrecord``, ``python -m tools.images_to_tfrecord``: ``prog``, the command its usage line names); returns the exit status."""
    p = Parser(prog=prog, name=PROG, description="Write an npz or an image folder as TFRecord shards in TensorFlow's "
                                      "ImageNet layout.")
    p.add_argument("input", metavar="IN", help="an npz (x, y) or an image folder DIR/<class>/*.jpg|jpeg|png")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="output file (or shard prefix)")
    p.add_argument("--encode", choices=codec.FORMATS, help="encode as (npz: default jpeg; folder: keep the files)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality 1..100 (default 90)")
    p.add_argument("--shards", type=int, default=1, help="number of output files (default 1)")
    p.add_argument("--test", action="store_true", help="npz: write x_test/y_test instead of x/y")
    p.add_argument("--label-offset", type=int, default=0,
                   help="added to every label (1: the ImageNet files' numbering, 0 unused)")
    args = p.parse_args(argv)

    def report(done):
        n, outputs = done
        say_as(PROG)(f"wrote {n} records to {len(outputs)} file(s): {outputs[0]}"
                     + (f" ... {outputs[-1]}" if len(outputs) > 1 else ""))

    return run_writer(PROG, lambda: convert(args.input, args.output, args.encode, args.quality, args.shards,
                                            args.test, args.label_offset), report)


if __name__ == "__main__":
    sys.exit(main(prog="python -m towers.images_to_tfrecord"))
