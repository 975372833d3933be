"""Regenerate data/digits.npz, the embedded default dataset.

Source: the UCI "Optical Recognition of Handwritten Digits" test set as shipped
inside scikit-learn (``sklearn.datasets.load_digits``: 1,797 images of 8x8
pixels with values 0..16).  Values are rescaled to uint8 0..255 (x * 255 / 16,
rounded) so that the file has the same format as MNIST-style data, then split
80/20 into train and test with a fixed, class-stratified shuffle.

scikit-learn is needed only here: ``pip install scikit-learn`` then
``python -m tools.make_digits [--out data/digits.npz]``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "data" / "digits.npz"


def build(seed: int = 0, test_fraction: float = 0.2) -> dict[str, numpy.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit("make_digits: scikit-learn is needed to regenerate the data: pip install scikit-learn")
    digits = load_digits()
    x = numpy.rint(digits.images * (255.0 / 16.0)).astype(numpy.uint8)
    y = digits.target.astype(numpy.int64)
    rng = numpy.random.default_rng(seed)
    test = numpy.zeros(len(y), dtype=bool)
    for c in numpy.unique(y):  # stratified: each class split in the same proportion
        idx = rng.permutation(numpy.flatnonzero(y == c))
        test[idx[: int(round(len(idx) * test_fraction))]] = True
    train_idx = rng.permutation(numpy.flatnonzero(~test))
    test_idx = numpy.flatnonzero(test)
    return {"x": x[train_idx], "y": y[train_idx], "x_test": x[test_idx], "y_test": y[test_idx]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    arrays = build(args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npz")
    numpy.savez_compressed(tmp, **arrays)
    tmp.replace(out)
    print(f"wrote {out}: {len(arrays['x'])} train, {len(arrays['x_test'])} test, images {arrays['x'].shape[1:]} uint8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
