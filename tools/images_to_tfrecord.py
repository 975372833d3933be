"""``python -m tools.images_to_tfrecord``: an npz or an image folder -> TFRecord shards in TensorFlow's ImageNet layout.

The writer lives in the package (``towers.data.image.to_tfrecord``); this keeps
the command line of a checkout.  See tools/README.md.
"""
import sys

from towers.data.image.to_tfrecord import main

if __name__ == "__main__":
    sys.exit(main())
