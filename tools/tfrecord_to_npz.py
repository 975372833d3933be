"""``python -m tools.tfrecord_to_npz``: TFRecord files -> one .npz (``towers.data.tfrecord.convert``).

The converter lives in the package (installed as ``towers-tfrecord-to-npz``);
this keeps the command line of a checkout.  See tools/README.md.
"""
import sys

from towers.data.tfrecord.convert import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tools.tfrecord_to_npz"))
