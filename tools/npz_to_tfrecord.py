"""``python -m tools.npz_to_tfrecord``: an npz in the converter's layout -> TFRecord (``towers.npz_to_tfrecord``).

See tools/README.md.
"""
import sys

from towers.npz_to_tfrecord import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tools.npz_to_tfrecord"))
