"""``python -m tools.npz_to_tfrecord``: an npz in the converter's layout -> TFRecord (``towers.data.tfrecord.from_npz``).

See tools/README.md.
"""
import sys

from towers.data.tfrecord.from_npz import main

if __name__ == "__main__":
    sys.exit(main())
