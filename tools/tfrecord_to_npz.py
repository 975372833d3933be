"""``python -m tools.tfrecord_to_npz``: TFRecord files -> one .npz (``towers.tfrecord_to_npz``).

The command line lives in the package (installed as ``towers-tfrecord-to-npz``);
this keeps the command line of a checkout.  See tools/README.md.
"""
import sys

from towers.tfrecord_to_npz import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tools.tfrecord_to_npz"))
