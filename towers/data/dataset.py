"""Datasets: examples and labels in host memory, validated once, from a file or from arrays.

``Dataset.from_arrays(x, y, x_test=None, y_test=None)`` checks what training needs and every loader
goes through it, so in-memory arrays and files are held to the same rules (listed in docs/data.md, "npz
files").  Every problem is a ``UserError`` naming the array (or the file and key), and for bad values
the count and the first index.  The value checks run in chunks of ``CHUNK_BYTES`` along the first axis,
so they need bounded memory on a memory-mapped array.  Labels that train but say little are
``Dataset.warnings`` (``_label_warnings``), which the command lines print; the library prints nothing.

``load_dataset`` reads .npz files with ``zipfile`` and ``numpy.lib.format`` rather than ``numpy.load``,
whose ``NpzFile`` reads members lazily (damage would surface mid-run) and cannot map a member:

- a member stored uncompressed (``numpy.savez``) is memory-mapped read-only (``numpy.memmap`` at the
  member's data offset: the local zip header's length plus the .npy header's); its CRC-32 is still
  verified at load, in one streamed pass through ``zipfile`` (bounded memory, nothing kept);
- a compressed member (``numpy.savez_compressed``) is decompressed whole into memory, in chunks, and
  ``zipfile`` checks its CRC at the end;
- object (pickled) arrays are refused from their .npy header, before any of their data is read.

Limits of a mapped member: it stays mapped for the dataset's life, so the file must not be rewritten in
place meanwhile (a truncated file faults on access); labels are copied into memory as int32, and
examples that are not uint8 or float32 in native byte order are converted, which loads them whole.
Gathering batches from a Fortran-ordered mapping is slow (each example is strided across the file).
"""
from __future__ import annotations

import functools
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass, field

import numpy
from numpy.lib import format as npy

from towers.arrays import check_host
from towers.errors import UserError

# At most 2**20 classes (labels 0..1048575).  The class count sizes the output
# layer (hidden x C float32, times replica, gradient, optimizer state and EMA):
# at 2**20 and the default 500 hidden units that is already 2 GiB per copy,
# about the most one device holds, while a label beyond it is in practice a
# wrong key or garbage (one label of 2**24 asked for 31 GiB).  A cap relative
# to the number of examples was not chosen: it would refuse legitimate small
# subsets (ten examples of an ImageNet-1k file have labels up to 999).
MAX_CLASSES = 1 << 20
CHUNK_BYTES = 1 << 20  # per step of a value check, a read or a CRC pass: bounded memory, cache-sized (measured fastest)
_INT32_MAX = int(numpy.iinfo(numpy.int32).max)
PIXEL_SCALE = numpy.float32(1 / 255)  # uint8 pixels -> [0, 1]
#: The values of the `input_scale` setting and what uint8 pixels are multiplied by for each: 1/255 (0..1, the
#: default) or 1 (0..255 as floats, as TensorFlow's multi-GPU example feeds them).
INPUT_SCALES = {"1/255": PIXEL_SCALE, "1": numpy.float32(1)}


def input_scale(dtype, setting: str = "1/255") -> numpy.float32 | None:
    """What examples of ``dtype`` are multiplied by on the device: uint8 pixels by the `input_scale` setting's
    factor (``INPUT_SCALES``: 1/255 by default), floats not at all (None).

    The one place of the rule; staging, device-resident data, evaluation and
    the image pipeline's normalization all ask here.
    """
    return INPUT_SCALES[setting] if numpy.dtype(dtype) == numpy.uint8 else None


class OnDemand:
    """NumPy-style reads of examples made on demand (TFRecord records, decoded images): ``x[i]``,
    ``x[a:b]`` and ``x[rows]`` through the subclass's ``submit(rows).examples()``; ``rows`` names them in
    an IndexError.  ``Dataset.close`` stops what such arrays run.  The one subclass is
    ``towers.data.examples.Examples``; the batch code tells such arrays from arrays in memory by this class."""

    rows = "examples"

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r}, shape={self.shape}, dtype={self.dtype})"

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self.submit(numpy.arange(len(self))[key]).examples()
        if numpy.ndim(key) == 0:
            if not -len(self) <= key < len(self):
                raise IndexError(f"index {key} is out of range for {len(self)} {self.rows}")
            return self.submit(numpy.array([key]) % len(self)).examples()[0]
        return self.submit(numpy.asarray(key)).examples()


@dataclass
class Dataset:
    x: numpy.ndarray  # (N, ...) uint8 or float32
    y: numpy.ndarray  # (N,) int32
    num_classes: int
    x_test: numpy.ndarray | None = None
    y_test: numpy.ndarray | None = None
    class_names: list | None = None  # an image folder's classes, by label
    warnings: list[str] = field(default_factory=list)  # lines about labels that train but say little

    def __post_init__(self):
        # Every construction, from_arrays or a loader's, gets these checks and the warnings.
        if 0 in tuple(self.x.shape[1:]):  # nothing to train on (and a checkpoint of 0-byte weights cannot be written)
            raise UserError(f"the examples have shape {tuple(self.x.shape[1:])} each: they hold no features (an axis "
                            "of length 0); give examples of at least one value (check `x_key` and the data)")
        check_test_split(self.x_test, self.y_test, "", dtype=self.x.dtype)
        self.warnings = list(self.warnings) + _label_warnings(self.y, self.y_test)

    @functools.cached_property
    def fingerprint(self) -> dict:
        """What identifies the training examples and labels, cheaply (``towers.data.fingerprint``): a checkpoint
        records it, and a resume on other data of the same shape says so.  Computed once."""
        from towers.data.fingerprint import fingerprint

        return fingerprint(self)

    def close(self) -> None:
        """Stop the worker processes of examples read on demand (TFRecord records, images); idempotent.

        A no-op for arrays in memory or mapped from an npz file.
        """
        for array in (self.x, self.x_test):
            if isinstance(array, OnDemand):  # towers.data.examples.Examples
                array.close()

    @property
    def example_shape(self) -> tuple:
        return tuple(self.x.shape[1:])

    @classmethod
    def from_arrays(cls, x, y, x_test=None, y_test=None, names=("x", "y", "x_test", "y_test"),
                    where: str = "Dataset.from_arrays", test_where: str | None = None) -> "Dataset":
        """A validated dataset from host arrays (uint8 or float examples, integer labels).

        ``where`` prefixes the messages about the training arrays, ``test_where``
        (default: ``where``) those about the test arrays (their file, say).
        """
        test_where = test_where or where
        if (x_test is None) != (y_test is None):
            raise UserError(f"{where}: give both {names[2]} and {names[3]}, or neither")
        x, y = _pair(_host(x), _host(y), where, names[0], names[1])
        if len(x) == 0:
            raise UserError(f"{where}: the dataset is empty ({names[0]!r} has 0 examples)")
        num_classes = int(y.max()) + 1
        if x_test is not None:
            x_test, y_test = _pair(_host(x_test), _host(y_test), test_where, names[2], names[3])
            check_test_split(x_test, y_test, f"{test_where}: ", names[2], x.dtype, x.shape[1:], num_classes)
        return cls(x, y, num_classes, x_test, y_test)


def hold_out(dataset: Dataset, fraction: float, seed: int) -> Dataset:
    """``dataset`` with ``fraction`` of its training examples moved to its test split (``validation_split``).

    Which examples: a permutation of the example numbers from NumPy's
    ``default_rng(seed)`` (a generator of its own: the weights' and the
    shuffle's draws are untouched), its first ``round(fraction * N)`` (at least
    one) held out; both parts keep the file's order.  So a run, its resume and
    a second run of the same seed hold out the same examples, and training
    never sees them (its shuffle draws from the rest).  The class count stays
    the whole data's.  Examples held in memory or mapped from an npz only
    (the parts are copies: a mapped file is read into memory); records and
    images read on demand are refused, as is data with a test split of its own.
    """
    if not fraction:
        return dataset
    if dataset.x_test is not None:
        raise UserError("`validation_split` holds out training examples as the test data, but the data has test "
                        "data of its own (x_test/y_test in `data`, or `test_data`): drop `validation_split` or the "
                        "test data")
    if not isinstance(dataset.x, numpy.ndarray):
        raise UserError("`validation_split` splits examples held in memory or in an npz file; the examples of "
                        "`data` are read on demand (TFRecord records, images): give test data (`test_data`) instead")
    n = len(dataset.x)
    k = max(1, round(fraction * n))
    if k >= n:
        raise UserError(f"`validation_split` {fraction:g} of {n} examples leaves none to train on: lower it")
    order = numpy.random.default_rng(seed).permutation(n)
    held, kept = numpy.sort(order[:k]), numpy.sort(order[k:])
    return Dataset(dataset.x[kept], dataset.y[kept], dataset.num_classes, dataset.x[held], dataset.y[held],
                   class_names=dataset.class_names)


@dataclass
class TestSet:
    """Test examples and labels alone, the labels in a trained model's classes (``towers.data.loading.
    load_test_data``: what ``towers.eval`` evaluates, without the training data)."""

    x: numpy.ndarray
    y: numpy.ndarray  # int32, label k is the trained model's class k
    warnings: list[str] = field(default_factory=list)

    @property
    def example_shape(self) -> tuple:
        return tuple(self.x.shape[1:])

    def close(self) -> None:
        """Stop the worker processes of examples read on demand; idempotent."""
        if isinstance(self.x, OnDemand):
            self.x.close()


def check_test_split(x_test, y_test, where: str, key: str = "x_test", dtype=None, shape=None,
                     num_classes: int | None = None) -> None:
    """Test examples and labels against the training data's ``dtype``, example ``shape`` and ``num_classes``
    (each checked when given; ``x_test`` None: nothing to check); ``where`` is a prefix for the message.

    A test split must hold examples: an empty one gave an accuracy of 0.0 (no
    example right out of none).  uint8 pixels are scaled by 1/255 on the
    device and floats are used as they are, so uint8 beside float examples
    (float32 pixels 0..255 beside uint8 ones, say) would be scaled differently
    at training and test time.  A test label must be one of the model's
    classes.  The one place of these rules, for a loaded training split and for
    a checkpoint's record of one (``towers.eval``).
    """
    if x_test is None:
        return
    if len(x_test) == 0:
        raise UserError(f"{where}the test set is empty ({key!r} has 0 examples): give test examples, or none "
                        "at all (no x_test/y_test) to train without a test accuracy")
    if dtype is not None and x_test.dtype != dtype:
        raise UserError(f"{where}test examples are {x_test.dtype} but training examples {numpy.dtype(dtype)}: uint8 "
                        "pixels are scaled by 1/255 and float examples are used as they are, so the two would be "
                        "scaled differently; give both as uint8 pixels, or both as floats on one scale")
    if shape is not None and tuple(x_test.shape[1:]) != tuple(shape):
        raise UserError(f"{where}test examples have shape {tuple(x_test.shape[1:])} but training examples "
                        f"{tuple(shape)}")
    if num_classes is not None and y_test is not None and len(y_test) and int(y_test.max()) >= num_classes:
        raise UserError(f"{where}test label {int(y_test.max())} is out of range: training labels are "
                        f"0..{num_classes - 1}")


def _class_number(name: str) -> int | None:
    """The label number a class folder named by a number stands for (``3``, ``007``), else None."""
    return int(name) if name.isascii() and name.isdigit() else None


def _listed(names, limit=10) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def match_test_labels(train_classes, test_classes, test_labels, test_path, n_classes: int) -> numpy.ndarray:
    """The test labels in the training classes' numbers, or a UserError when they cannot mean the same classes.

    ``train_classes``, ``test_classes``: the class names of each side (an image folder's, label k at k), or
    None for numbered labels (npz, TFRecord); the training side may be a checkpoint's record of them.
    Folders on both sides match by class name.  A test folder beside numbered labels needs class folders
    named by those numbers (``0`` .. ``C-1``); numbered test labels beside a training folder need its
    classes named by numbers.  Folder order never stands for a label: a class folder missing on one side
    would shift every class after it.
    """
    if test_classes is None and train_classes is None:
        return test_labels
    if test_classes is not None and train_classes is not None:
        number = {name: k for k, name in enumerate(train_classes)}
        unknown = [name for name in test_classes if name not in number]
        if unknown:
            raise UserError(f"`test_data` {test_path} has class folders the training data lacks: "
                            f"{_listed(unknown, 5)}; its classes must be among {_listed(train_classes)}")
        return numpy.array([number[name] for name in test_classes], numpy.int32)[test_labels]
    if test_classes is not None:  # a test folder beside numbered training labels
        numbers = [_class_number(name) for name in test_classes]
        named = [name for name, k in zip(test_classes, numbers) if k is None]
        if named:
            raise UserError(f"`test_data` {test_path}: class folders {_listed(named, 5)} cannot be matched to the "
                            f"training data's labels 0..{n_classes - 1}, which have no class names: name the test "
                            "class folders by the label numbers they hold (0, 1, ...)")
        lacking = [name for name, k in zip(test_classes, numbers) if k >= n_classes]
        if lacking:
            raise UserError(f"`test_data` {test_path} has class folders the training data lacks: "
                            f"{_listed(lacking, 5)}; training labels are 0..{n_classes - 1}")
        return numpy.array(numbers, numpy.int32)[test_labels]
    numbers = [_class_number(name) for name in train_classes]  # numbered test labels beside a training folder
    if None in numbers:
        raise UserError(f"`test_data` {test_path} has numbered labels, but the training classes are the folders "
                        f"{_listed(train_classes)}: give the test data as an image folder with the same class "
                        "folders")
    label = numpy.full(max(numbers) + 1, -1, numpy.int32)
    label[numbers] = numpy.arange(len(numbers), dtype=numpy.int32)
    seen = numpy.unique(test_labels)
    lacking = [int(k) for k in seen if k >= len(label) or label[k] < 0]
    if lacking:
        raise UserError(f"`test_data` {test_path} has labels the training data lacks: "
                        f"{_listed([str(k) for k in lacking], 5)}; the training class folders are "
                        f"{_listed(train_classes)}")
    return label[test_labels]


def _label_warnings(y, y_test) -> list[str]:
    """Lines about labels that train but say little: one class, class indices without a training example.

    The model has one output per index 0..max(y), so labels that start above 0
    or skip numbers (0..8 and 100) leave outputs that nothing trains, and a
    test label among them can never be predicted right.  Counting them is one
    ``bincount`` over the labels (at most ``MAX_CLASSES`` bins).
    """
    out = []
    low, high = (int(y.min()), int(y.max())) if len(y) else (0, 1)
    if low == high:
        out.append(f"the training labels hold one class only (label {low}): the model learns to answer "
                   f"{low} whatever the input, and its accuracy is the share of {low} in the test labels; "
                   "check `y_key` and the labels")
        empty = numpy.zeros(0, numpy.int64)
    else:
        counts = numpy.bincount(numpy.asarray(y, numpy.int64)) if len(y) else numpy.ones(2)
        empty = numpy.flatnonzero(counts == 0)
    if len(empty) and empty[-1] < low:  # only below the first label: labels counted from 1 (or more)
        out.append(f"the training labels start at {low}, not 0: classes 0..{low - 1} have no examples "
                   f"(labels are 0..C-1; for labels 1..C, subtract 1)")
    elif len(empty):
        shown = ", ".join(str(int(k)) for k in empty[:5]) + (", ..." if len(empty) > 5 else "")
        untrained = 0
        if y_test is not None and len(y_test):
            yt = numpy.asarray(y_test, numpy.int64)
            untrained = int(numpy.count_nonzero(numpy.isin(yt, empty)))
        test = (f"; {_plural(untrained, 'test example')} {'has' if untrained == 1 else 'have'} such a label"
                if untrained else "")
        out.append(f"the training labels leave {len(empty)} of the {high + 1} class indices 0..{high} without an "
                   f"example ({shown}): the model gets {high + 1} outputs and never learns those classes{test}; "
                   "labels are 0..C-1: renumber them (numpy.unique(y, return_inverse=True))")
    return out + test_label_warnings(y_test)


def test_label_warnings(y_test) -> list[str]:
    """Lines about test labels that measure little: one class only."""
    if y_test is not None and len(y_test) > 1 and int(y_test.min()) == int(y_test.max()):
        return [f"the test labels hold one class only (label {int(y_test.min())}): the accuracy measures "
                "that class alone"]
    return []


def _host(a) -> numpy.ndarray:
    """A host array; a ``numpy.memmap`` stays one (it says the data is mapped, not loaded).  A device array
    is a ``UserError``: a data set lives in host memory (``towers.data.device_data`` copies it to the GPUs)."""
    check_host(a, "Dataset.from_arrays: an array")
    return a if isinstance(a, numpy.memmap) else numpy.asarray(a)


def _scan(a: numpy.ndarray, bad) -> tuple[int, int]:
    """(count, first example index or -1) of the elements where ``bad(chunk)`` is True.

    Chunks of about ``CHUNK_BYTES`` along the first axis, so a mapped array is
    read once, a chunk at a time.
    """
    rows = max(1, CHUNK_BYTES // max(1, a[:1].nbytes))
    count, first = 0, -1
    for start in range(0, len(a), rows):
        b = bad(a[start : start + rows])
        n = int(numpy.count_nonzero(b))
        if n and first < 0:
            first = start + int(numpy.argmax(b.reshape(len(b), -1).any(axis=1)))
        count += n
    return count, first


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _labels(y: numpy.ndarray, where: str, key: str) -> numpy.ndarray:
    if y.ndim != 1 or not numpy.issubdtype(y.dtype, numpy.integer):
        raise UserError(
            f"{where}: key {key!r} must be 1-D integer labels, got {y.dtype} {y.shape}"
        )
    info = numpy.iinfo(y.dtype)
    if info.min < 0:
        n, i = _scan(y, lambda c: c < 0)
        if n:
            raise UserError(f"{where}: key {key!r} has {_plural(n, 'negative label')}: {int(y[i])} at index {i}; "
                            "labels are 0..C-1")
    # int32 first: it is what used to wrap silently into other classes.
    for limit, what in ((_INT32_MAX + 1, "that {} not fit int32"),
                        (MAX_CLASSES, f"of 2**{MAX_CLASSES.bit_length() - 1} or more")):
        n, i = _scan(y, lambda c: c >= limit) if info.max >= limit else (0, -1)
        if n:
            v = int(y[i])
            raise UserError(
                f"{where}: key {key!r} has {_plural(n, 'label')} {what.format('does' if n == 1 else 'do')}: "
                f"{v} at index {i} would make {v + 1} classes; towers keeps labels as int32 and allows "
                f"at most {MAX_CLASSES} classes (labels 0..{MAX_CLASSES - 1})"
            )
    return y.astype(numpy.int32)


def check_examples(x: numpy.ndarray, where: str, key: str) -> numpy.ndarray:
    """Examples as a data set holds them: uint8 pixels as they are, floats as float32 with no NaN or inf and,
    from a wider float, none beyond float32's range (a ``UserError`` naming the count and the first example);
    other dtypes are refused."""
    if x.dtype == numpy.uint8:
        return x
    if not numpy.issubdtype(x.dtype, numpy.floating):
        raise UserError(f"{where}: key {key!r} is {x.dtype}; give uint8 pixels or float32 features")
    if x.dtype.itemsize > 4:
        big = numpy.finfo(numpy.float32).max
        n, i = _scan(x, lambda c: numpy.isfinite(c) & (numpy.abs(c) > big))
        if n:
            raise UserError(
                f"{where}: key {key!r} has {_plural(n, 'value')} beyond float32's range (+-{big:.4g}); the first "
                f"in example {i}: towers trains in float32, where they would be inf; scale or clip them")
    x = x.astype(numpy.float32, copy=False)
    n, i = _scan(x, lambda c: ~numpy.isfinite(c))
    if n:
        raise UserError(
            f"{where}: key {key!r} has {_plural(n, 'non-finite value')} (NaN or inf); the first in example {i}: "
            "replace them (numpy.nan_to_num) or drop those examples"
        )
    return x


class _Npz:
    """An .npz file's members, each read (or mapped) and verified whole on request.

    ``what`` and ``setting`` name the file in messages ("data", `data`).
    """

    def __init__(self, path: str, what: str, setting: str):
        self.path, self.what = path, what
        fix = f"set `{setting}` to an .npz or TFRecord file"
        if os.path.isdir(path):  # (a folder with class folders or images is an image folder: towers.data.kinds)
            raise UserError(f"{what} file {path} is a directory: {fix}, or "
                            f"to an image folder {os.path.join(path, '<class>', '*.jpg')} (one folder per class, "
                            ".jpg, .jpeg or .png)")
        if not os.path.exists(path):
            from towers.data.fetch import DATASETS

            name = os.path.basename(path)[:-len(".npz")] if path.endswith(".npz") else None
            if name in DATASETS:  # a data set the fetcher writes under this name
                fix = (f"towers-fetch-data {name} -o {os.path.dirname(path) or '.'} writes it (or {fix})")
            raise UserError(f"{what} file {path} does not exist: {fix}")
        try:
            self._zip = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, NotImplementedError) as e:
            if str(e) == "File is not a zip file":  # no end-of-archive record: not a zip, or cut short
                raise UserError(self._not_npz()) from None
            raise UserError(f"{what} file {path} is a damaged zip file ({e}): write or download it again") from None
        except OSError as e:
            raise UserError(f"cannot read {what} file {path} ({e.strerror or e})") from None
        self._members = {i.filename[:-4] if i.filename.endswith(".npy") else i.filename: i
                         for i in self._zip.infolist()}

    def _not_npz(self) -> str:
        with open(self.path, "rb") as f:
            if f.read(len(npy.MAGIC_PREFIX)) == npy.MAGIC_PREFIX:
                return (f"{self.what} file {self.path} is a .npy file (one array), not an npz: "
                        "save the arrays together with numpy.savez")
        return (f"{self.what} file {self.path} is not an npz (zip) file, or it is cut short: "
                "give a file written by numpy.savez")

    def __enter__(self) -> "_Npz":
        return self

    def __exit__(self, *exc) -> None:
        self._zip.close()

    def has(self, *keys: str) -> bool:
        return all(k in self._members for k in keys)

    def has_test(self) -> bool:
        """Whether the file holds its own test split, ``x_test`` and ``y_test``; one without the other is a
        UserError (it would have trained without test data, saying there was none)."""
        x, y = self.has("x_test"), self.has("y_test")
        if x != y:
            have, lack = ("x_test", "y_test") if x else ("y_test", "x_test")
            raise UserError(f"{self.path} has {have} but no {lack}: an npz's test split is both arrays; add {lack}, "
                            f"or remove {have}")
        return x

    def array(self, key: str) -> numpy.ndarray:
        """The member ``key`` as an array: mapped if stored uncompressed, else read whole."""
        info = self._members.get(key)
        if info is None:
            raise UserError(
                f"{self.path} has no key {key!r} (keys: {', '.join(self._members) or 'none'}); "
                "use `x_key`/`y_key` to pick others"
            )
        where = f"member {info.filename!r} of {self.path}"
        try:
            with self._zip.open(info) as f:
                dtype, shape, order = _npy_header(f)
                if dtype.hasobject:
                    raise UserError(f"{where} holds pickled objects, which towers does not load: "
                                    "save numeric arrays (uint8 or float examples, integer labels)")
                nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
                mapped = info.compress_type == zipfile.ZIP_STORED and nbytes > 0
                at = f.tell()
                arr = None if mapped else _read_into(f, dtype, shape, order, nbytes)
                while f.read(CHUNK_BYTES):  # to the end: zipfile checks the CRC there
                    pass
        except UserError:
            raise
        except zipfile.BadZipFile as e:
            raise self._corrupt(where, "bad CRC" if "CRC" in str(e) else str(e)) from None
        except zlib.error:
            raise self._corrupt(where, "bad deflate data") from None
        except EOFError:
            raise self._corrupt(where, "it ends early") from None
        except ValueError as e:  # from the .npy header
            raise self._corrupt(where, f"bad .npy header: {e}") from None
        except OSError as e:
            raise UserError(f"cannot read {where} ({e.strerror or e})") from None
        except (RuntimeError, NotImplementedError) as e:  # zipfile: encrypted, or an unknown compression
            raise UserError(f"cannot read {where} ({e}): write it with numpy.savez") from None
        if arr is None:
            if at + nbytes > info.file_size:
                raise self._corrupt(where, "it ends early")
            arr = numpy.memmap(self.path, dtype=dtype, mode="r", offset=self._data_offset(info) + at,
                               shape=shape, order=order)
        return arr

    def _data_offset(self, info: zipfile.ZipInfo) -> int:
        """Where a member's bytes start: after its local header, whose name and extra
        field lengths may differ from the central directory's (zip64 extras)."""
        with open(self.path, "rb") as f:
            f.seek(info.header_offset)
            fields = struct.unpack(zipfile.structFileHeader, f.read(zipfile.sizeFileHeader))
        return info.header_offset + zipfile.sizeFileHeader + fields[10] + fields[11]  # name, extra lengths

    @staticmethod
    def _corrupt(where: str, why: str) -> UserError:
        return UserError(f"{where} is corrupt ({why}): write or download the file again")


def _npy_header(f) -> tuple[numpy.dtype, tuple, str]:
    """(dtype, shape, order) from a .npy header; ``f`` is left at the array's data."""
    version = npy.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f".npy format {version[0]}.{version[1]} is not read by towers")
    read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
    shape, fortran, dtype = read(f)
    return dtype, shape, "F" if fortran else "C"


def _read_into(f, dtype: numpy.dtype, shape: tuple, order: str, nbytes: int) -> numpy.ndarray:
    """A member's array, read in chunks straight into its final buffer (no second copy)."""
    flat = numpy.empty(nbytes, numpy.uint8)
    view, pos = memoryview(flat), 0
    while pos < nbytes:
        n = f.readinto(view[pos : pos + CHUNK_BYTES])
        if not n:
            raise EOFError
        pos += n
    return flat.view(dtype).reshape(shape, order=order)


def _pair(x, y, where: str, xk: str, yk: str):
    x, y = check_examples(x, where, xk), _labels(y, where, yk)
    if x.ndim < 2:
        raise UserError(f"{where}: key {xk!r} has shape {x.shape}; expected (N, features...)")
    if len(x) != len(y):
        raise UserError(f"{where}: {xk!r} has {len(x)} examples but {yk!r} has {len(y)} labels")
    return x, y


def npz_has(path: str, *keys: str, what: str = "data", setting: str = "data") -> bool:
    """Whether the npz file ``path`` has every one of ``keys`` (reads only its directory)."""
    with _Npz(path, what, setting) as npz:
        return npz.has(*keys)


def npz_has_test(path: str, what: str = "test data", setting: str = "test_data") -> bool:
    """Whether the npz file ``path`` holds its own test split, ``x_test`` and ``y_test`` (reads only its
    directory; one without the other is a UserError).

    It picks the keys of a ``test_data`` file, so a file that cannot be read
    is named as test data (``what``, ``setting``), not as `data`.
    """
    with _Npz(path, what, setting) as npz:
        return npz.has_test()


def test_keys(path: str, x_key: str, y_key: str, own: bool = False, what: str = "test data",
              setting: str = "test_data") -> tuple[str, str]:
    """The keys of an npz file's test examples and labels: its own ``x_test``/``y_test`` first, then its
    training keys; with ``own`` (the test split of a `data` file) only the first, else a UserError."""
    if npz_has_test(path, what=what, setting=setting):
        return "x_test", "y_test"
    if own:
        raise UserError(f"{path} has no x_test/y_test: give test data (`test_data`), or data with x_test/y_test")
    return x_key, y_key


def read_npz_examples(path: str, x_key: str, what: str = "test data", setting: str = "test_data") -> numpy.ndarray:
    """An npz file's examples alone, under ``x_key`` (data without labels, to predict): read (or mapped),
    verified and checked as every split's examples are (``check_examples``)."""
    with _Npz(path, what, setting) as npz:
        x = npz.array(x_key)
    if x.ndim < 1 or not len(x):
        raise UserError(f"{path}: key {x_key!r} holds no examples ({x.dtype} {x.shape})")
    return check_examples(_host(x), str(path), x_key)


def read_npz_pair(path: str, x_key: str, y_key: str, what: str = "data", setting: str = "data"):
    """An npz file's examples and labels under ``x_key``/``y_key``: read (or mapped), verified and validated
    as every split is (``_pair``); what the split must hold besides (not empty, ...) is the caller's check."""
    with _Npz(path, what, setting) as npz:
        x, y = npz.array(x_key), npz.array(y_key)
    return _pair(_host(x), _host(y), path, x_key, y_key)


def load_npz(path: str, x_key: str = "x", y_key: str = "y", test_path: str | None = None) -> Dataset:
    """Load and validate training (and test) data from .npz files; every problem is a UserError.

    npz members are read (or mapped) and verified at load, so a damaged file
    stops here, before anything is allocated or written.  A ``test_path``
    file's own ``x_test``/``y_test`` come first, then its training keys.
    """
    with _Npz(path, "data", "data") as npz:
        x, y = npz.array(x_key), npz.array(y_key)
        tx = ty = None
        tkx, tky = "x_test", "y_test"
        if test_path is not None:
            tkx, tky = test_keys(test_path, x_key, y_key)
            with _Npz(test_path, "test data", "test_data") as tnpz:
                tx, ty = tnpz.array(tkx), tnpz.array(tky)
        elif npz.has_test():
            tx, ty = npz.array("x_test"), npz.array("y_test")
    return Dataset.from_arrays(x, y, tx, ty, names=(x_key, y_key, tkx, tky), where=path, test_where=test_path)
