"""``python -m tools.fetch_data``: download MNIST, Fashion-MNIST or CIFAR-10 (``towers.fetch_data``).

The command line lives in the package (installed as ``towers-fetch-data``); this keeps the command
line of a checkout.  See tools/README.md.
"""
import sys

from towers.fetch_data import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tools.fetch_data"))
