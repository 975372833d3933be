"""Data that used to train or evaluate silently wrong: an empty test set, test pixels on another scale,
one class, labels from 1 or with a gap, and a missing --test-data named as --data.

The command lines run in this process (``main(argv)``) on the embedded digits data.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import DIGITS
from towers import Dataset, UserError
from towers.data.tfrecord import from_npz
from towers.eval import main as eval_main
from towers.train import main as train_main

RUN = ["--devices", "cpu", "--n-gpu", "2", "--batch-size", "50", "--hidden", "16", "--quiet",
       "--summary-every", "0", "--checkpoint-every", "0"]


@pytest.fixture(scope="module")
def digits():
    with np.load(DIGITS) as z:
        return {k: z[k] for k in z.files}


def cli(main, capsys, *args):
    status = main([str(a) for a in args])
    return status, capsys.readouterr().err.strip().splitlines()


def save(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, digits):
    """A finished run on the digits (its checkpoint is what towers.eval reads)."""
    logdir = tmp_path_factory.mktemp("run")
    assert train_main([*RUN, "--logdir", str(logdir), "--steps", "5"]) == 0
    return logdir


# -- an empty test set ---------------------------------------------------------------------------


def test_an_empty_test_set_is_refused_at_load_not_reported_as_accuracy_0(tmp_path, capsys, digits, run_dir):
    x, y = digits["x"], digits["y"]
    with pytest.raises(UserError, match=r"the test set is empty \('x_test' has 0 examples\)"):
        Dataset.from_arrays(x, y, x[:0], y[:0])
    data = save(tmp_path / "empty_test.npz", x=x, y=y, x_test=x[:0], y_test=y[:0])
    # Before: "test accuracy: 0.0000 (raw weights), 0.0000 (EMA weights)", exit 0, and 0.0 in metrics.jsonl.
    status, err = cli(train_main, capsys, *RUN, "--logdir", tmp_path / "run", "--steps", "5", "--data", data)
    assert status == 2 and len(err) == 1, err
    assert err[0] == (f"towers.train: error: {data}: the test set is empty ('x_test' has 0 examples): give test "
                      "examples, or none at all (no x_test/y_test) to train without a test accuracy")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # Before: "... accuracy = 0.0000 on 0 test examples (EMA weights)".
    status, err = cli(eval_main, capsys, "--logdir", run_dir, "--data", data)
    assert status == 2 and len(err) == 1 and "the test set is empty" in err[0], err


# -- test examples on another scale -----------------------------------------------------------------


def test_float_test_pixels_beside_uint8_training_pixels_are_refused(digits):
    x, y = digits["x"], digits["y"]
    # Before: accepted, and the float test pixels 0..255 went unscaled into a model trained on 0..1.
    with pytest.raises(UserError, match="test examples are float32 but training examples uint8: uint8 pixels "
                                        "are scaled by 1/255 and float examples are used as they are"):
        Dataset.from_arrays(x, y, digits["x_test"].astype(np.float32), digits["y_test"])
    with pytest.raises(UserError, match="test examples are uint8 but training examples float32"):
        Dataset.from_arrays(x.astype(np.float32) / 255, y, digits["x_test"], digits["y_test"])
    # Floats of another width are converted alike (both float32), so they pass.
    ds = Dataset.from_arrays(x.astype(np.float64) / 255, y, digits["x_test"].astype(np.float32) / 255,
                             digits["y_test"])
    assert ds.x.dtype == ds.x_test.dtype == np.float32


def test_a_test_files_mistake_names_the_test_file(tmp_path, capsys, digits):
    # Before: the message named the training file (npz) or no file at all (TFRecord training data).
    x, y = digits["x"], digits["y"]
    train = save(tmp_path / "train.npz", x=x, y=y)
    test = save(tmp_path / "test.npz", x_test=digits["x_test"].astype(np.float32), y_test=digits["y_test"])
    records = tmp_path / "train.tfrecords"
    from_npz.write_examples(records, x, y, "none")
    for data, decode in ((train, []), (records, ["--x-key", "image_raw", "--y-key", "label", "--decode",
                                                 "image_raw:uint8:8,8"])):
        status, err = cli(train_main, capsys, *RUN, "--logdir", tmp_path / "run", "--steps", "2", "--data", data,
                          "--test-data", test, *decode)
        assert status == 2 and err[-1].startswith(f"towers.train: error: {test}: test examples are float32 but "
                                                  "training examples uint8"), err


# -- labels that train but say little -----------------------------------------------------------------


def test_one_class_and_labels_from_1_are_warnings_the_command_lines_print(tmp_path, capsys, digits, run_dir):
    x, y = digits["x"], digits["y"]
    assert Dataset.from_arrays(x, y, digits["x_test"], digits["y_test"]).warnings == []
    one = Dataset.from_arrays(x, np.full(len(y), 3), digits["x_test"][:4], np.full(4, 3))
    assert len(one.warnings) == 2
    assert one.warnings[0].startswith("the training labels hold one class only (label 3)")
    assert one.warnings[1].startswith("the test labels hold one class only (label 3)")
    shifted = Dataset.from_arrays(x, y + 1)
    assert shifted.warnings == ["the training labels start at 1, not 0: classes 0..0 have no examples "
                                "(labels are 0..C-1; for labels 1..C, subtract 1)"]

    zeros = save(tmp_path / "one_class.npz", x=x, y=np.zeros_like(y), x_test=digits["x_test"],
                 y_test=np.zeros_like(digits["y_test"]))
    warned = ["the training labels hold one class only (label 0): the model learns to answer 0 whatever the input, "
              "and its accuracy is the share of 0 in the test labels; check --y-key and the labels",
              "the test labels hold one class only (label 0): the accuracy measures that class alone"]
    # Before: trained silently to "test accuracy: 1.0000", exit 0; evaluated silently too.  towers.eval reads
    # the test split alone, so it warns about the test labels only.
    for prog, args, lines in (
            ("towers.train", [*RUN, "--logdir", tmp_path / "run", "--steps", "5", "--data", zeros], warned),
            ("towers.eval", ["--logdir", run_dir, "--data", zeros], warned[1:])):
        status, err = cli(train_main if prog == "towers.train" else eval_main, capsys, *args)
        assert status == 0
        assert [line for line in err if "warning" in line] == [f"{prog}: warning: {w}" for w in lines]


def test_labels_with_a_gap_warn_how_many_class_indices_have_no_example(tmp_path, capsys, digits):
    """Before: labels 0..8 and 100 built 101 outputs without a word, and test label 9 was never trained."""
    x, y, y_test = digits["x"], digits["y"].copy(), digits["y_test"]
    y[y == 9] = 100
    empty = 101 - len(np.unique(y))  # the indices 9..99 no training label names
    ds = Dataset.from_arrays(x, y, digits["x_test"], y_test)
    assert len(ds.warnings) == 1, ds.warnings
    line = ds.warnings[0]
    assert line.startswith(f"the training labels leave {empty} of the 101 class indices 0..100 without an example "
                           "(9, 10, 11, 12, 13, ...)"), line
    assert f"{np.count_nonzero(y_test == 9)} test examples have such a label" in line
    # Labels that only start above 0 keep their own line, and 0..C-1 gives none.
    assert Dataset.from_arrays(x, digits["y"] + 2).warnings[0].startswith("the training labels start at 2, not 0")
    assert Dataset.from_arrays(x, digits["y"]).warnings == []
    status, err = cli(train_main, capsys, *RUN, "--logdir", tmp_path / "run", "--steps", "2",
                      "--data", save(tmp_path / "gap.npz", x=x, y=y, x_test=digits["x_test"], y_test=y_test))
    assert status == 0 and [e for e in err if "warning" in e] == [f"towers.train: warning: {line}"]


# -- a missing --test-data beside TFRecord training data ----------------------------------------------


def test_a_missing_test_data_file_is_named_as_test_data(tmp_path, capsys, digits, run_dir):
    records = tmp_path / "digits.tfrecords"
    from_npz.write_examples(records, digits["x"], digits["y"], "none")
    missing = tmp_path / "test.npz"
    features = ["--x-key", "image_raw", "--y-key", "label"]
    expected = f"test data file {missing} does not exist: set --test-data to an .npz or TFRecord file"
    # Before: "data file .../test.npz does not exist: set --data to an .npz or TFRecord file".
    status, err = cli(train_main, capsys, *RUN, "--logdir", tmp_path / "run", "--steps", "5", "--data", records,
                      *features, "--test-data", missing)
    assert status == 2 and err[-1] == f"towers.train: error: {expected}", err  # after the "indexing" line
    status, err = cli(eval_main, capsys, "--logdir", run_dir, "--data", records, *features, "--test-data", missing)
    assert status == 2 and err[-1] == f"towers.eval: error: {expected}", err
