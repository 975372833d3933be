"""The command line of the dataset downloader: ``towers-fetch-data`` when installed,
``python -m towers.fetch_data`` or ``python -m tools.fetch_data`` in a checkout.

    python -m tools.fetch_data mnist|fashion-mnist|cifar10 -o DIR [--mirror URL]

A thin layer over :func:`towers.data.fetch.fetch` (where the files come from, their
sums, the parsing).  Exit status: 0, 1 for network, HTTP, checksum and format
errors, 2 for flag mistakes, 130 on Ctrl-C (the files already verified are kept).
"""
import os
import sys
import urllib.parse

from towers.cli import Parser, run_main, say_as
from towers.data.fetch import DATASETS, FetchError, fetch


def _parser(prog):
    p = Parser(prog=prog, description="Download MNIST, Fashion-MNIST or CIFAR-10 and write it as one towers ``.npz``.")
    p.add_argument("dataset", choices=sorted(DATASETS), help="which dataset to download")
    p.add_argument("-o", "--out-dir", required=True, metavar="DIR",
                   help="writes DIR/<dataset>.npz; keeps the downloaded files in DIR/raw/")
    p.add_argument("--mirror", metavar="URL",
                   help="fetch the same file names from URL/<file> instead of the default server")
    return p


def main(argv=None, prog="towers-fetch-data"):
    """The command line; returns the exit status."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.mirror is not None and urllib.parse.urlsplit(args.mirror).scheme not in ("http", "https"):
        parser.error(f"--mirror {args.mirror}: give an http:// or https:// URL (files you already have go in "
                     "DIR/raw/, where their sums are checked)")
    if not args.out_dir:  # '' would write raw/ and the npz into the current folder
        parser.error("-o must name a folder (it is empty); for example -o data")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        parser.error(f"-o {args.out_dir}: this is a file, not a folder; give a folder for the output")

    return run_main(prog, lambda: fetch(args.dataset, args.out_dir, base_url=args.mirror, say=say_as(prog)) and 0,
                    more={FetchError: 1},
                    interrupted=f"interrupted: no output written; the files already verified in "
                                f"{os.path.join(args.out_dir, 'raw')} are kept and not downloaded again")


if __name__ == "__main__":
    sys.exit(main(prog="python -m towers.fetch_data"))
