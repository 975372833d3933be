"""``python -m tools.images_to_tfrecord``: an npz or an image folder -> TFRecord shards in TensorFlow's ImageNet layout.

The command line lives in the package (``towers.images_to_tfrecord``); this keeps
the command line of a checkout.  See tools/README.md.
"""
import sys

from towers.images_to_tfrecord import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tools.images_to_tfrecord"))
