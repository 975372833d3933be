"""Which features become arrays: the ``--decode NAME:DTYPE[:SHAPE]`` syntax and its checks.

Shared by the converter (``towers.data.tfrecord.convert``) and training from
TFRecord files (``towers.data.tfrecord.records``): both read a fixed-length
bytes feature as a dense ``DTYPE`` array of shape (N, *SHAPE), and both refuse
a feature that is not one string of the same length in every record with one
line that says what the feature is instead (from its
:class:`~towers.data.tfrecord.columns.ColumnStats`).
"""

import math

import numpy as np

from towers.errors import UserError


class UsageError(UserError):
    """A mistake in the flags or in what they ask of the data (the converter exits 2)."""


def parse_decode(spec):
    """``NAME:DTYPE[:SHAPE]`` -> (name, dtype, shape or None); dtypes default to little-endian."""
    parts = spec.split(":")
    shape = None
    if len(parts) >= 3 and all(p.strip().isdigit() for p in parts[-1].split(",")):
        shape = tuple(int(p) for p in parts.pop().split(","))
    if len(parts) < 2 or not parts[-1]:
        raise UsageError(f"--decode {spec!r}: expected NAME:DTYPE[:SHAPE], e.g. image_raw:uint8:28,28")
    name, dtype_name = ":".join(parts[:-1]), parts[-1]
    try:
        dtype = np.dtype(dtype_name)
    except TypeError:
        raise UsageError(f"--decode {spec!r}: {dtype_name!r} is not a NumPy dtype (e.g. uint8, float32)") from None
    if dtype.kind not in "biufc":
        raise UsageError(f"--decode {spec!r}: {dtype_name!r} is not a numeric dtype")
    if dtype.byteorder == "=":
        dtype = dtype.newbyteorder("<")  # TFRecord writers store raw bytes little-endian in practice
    return name, dtype, shape


def decoded_shape(column, n, dtype, shape, spec):
    """Per-record shape of ``column`` (ColumnStats over ``n`` records) decoded as ``dtype``.

    ``shape`` None: (bytes / itemsize,).  A UsageError when the feature is not
    one string of a fitting fixed length in every record.
    """
    width = column.fixed_bytes(n)
    per_record = None if shape is None else math.prod(shape) * dtype.itemsize
    if width is None or (per_record is not None and width != per_record) or width % dtype.itemsize:
        want = f"{per_record} bytes" if per_record is not None else f"a multiple of {dtype.itemsize} bytes"
        raise UsageError(f"--decode {spec}: needs one string of {want} in every record, but "
                         f"{column.key!r} is {column.describe(n)}; fix the DTYPE/SHAPE or drop --decode")
    return shape if shape is not None else (width // dtype.itemsize,)
