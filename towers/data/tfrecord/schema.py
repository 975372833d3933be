"""Which features become arrays: the ``--decode NAME:DTYPE[:SHAPE]`` syntax and its checks.

Shared by the converter (``towers.data.tfrecord.convert``) and training from
TFRecord files (``towers.data.tfrecord.records``): both read a fixed-length
bytes feature as a dense ``DTYPE`` array of shape (N, *SHAPE) (a float feature
of one length as float32 of that SHAPE), and both refuse a feature that is
neither with one line that says what the feature is instead (from its
:class:`~towers.data.tfrecord.columns.ColumnStats`).  ``NAME:image:H,W,C``
asks for encoded images instead (``towers.data.image``): :func:`parse_image_decode`.
"""

import math

import numpy as np

from towers.errors import UserError


class UsageError(UserError):
    """A mistake in the flags or in what they ask of the data (the converter exits 2)."""


def parse_image_decode(spec):
    """``NAME:image:H,W,C`` -> (name, (H, W, C)); None for a ``NAME:DTYPE[:SHAPE]`` spec."""
    parts = spec.split(":")
    if parts[-1] != "image" and (len(parts) < 3 or parts[-2] != "image"):
        return None
    if parts[-1] == "image" or len(parts[-1].split(",")) != 3 or \
            not all(p.strip().isdigit() for p in parts[-1].split(",")):
        raise UsageError(f"`decode` {spec!r}: encoded images take NAME:image:H,W,C, e.g. image/encoded:image:224,224,3")
    h, w, c = (int(p) for p in parts[-1].split(","))
    if min(h, w) < 1 or c not in (1, 3):
        raise UsageError(f"`decode` {spec!r}: H and W must be >= 1 and C 1 (grey) or 3 (RGB)")
    return ":".join(parts[:-2]), (h, w, c)


def parse_decode(spec):
    """``NAME:DTYPE[:SHAPE]`` -> (name, dtype, shape or None); dtypes default to little-endian."""
    parts = spec.split(":")
    shape = None
    if len(parts) >= 3 and all(p.strip().isdigit() for p in parts[-1].split(",")):
        shape = tuple(int(p) for p in parts.pop().split(","))
    if len(parts) < 2 or not parts[-1]:
        raise UsageError(f"`decode` {spec!r}: expected NAME:DTYPE[:SHAPE], e.g. image_raw:uint8:28,28")
    name, dtype_name = ":".join(parts[:-1]), parts[-1]
    try:
        dtype = np.dtype(dtype_name)
    except TypeError:
        raise UsageError(f"`decode` {spec!r}: {dtype_name!r} is not a NumPy dtype (e.g. uint8, float32)") from None
    if dtype.kind not in "biufc":
        raise UsageError(f"`decode` {spec!r}: {dtype_name!r} is not a numeric dtype")
    if dtype.byteorder == "=":
        dtype = dtype.newbyteorder("<")  # TFRecord writers store raw bytes little-endian in practice
    return name, dtype, shape


def decoded_shape(column, n, dtype, shape, spec):
    """Per-record shape of ``column`` (ColumnStats over ``n`` records) decoded as ``dtype``.

    ``shape`` None: (bytes / itemsize,).  A UsageError when the feature is not
    one string of a fitting fixed length in every record, or a float feature
    of the same length in every record, read as float32 of ``shape``.
    """
    from towers.data.tfrecord.proto import KIND_FLOAT  # (protobuf: only when records are read)

    if column.kind == KIND_FLOAT:
        return _float_shape(column, n, dtype, shape, spec)
    width = column.fixed_bytes(n)
    per_record = None if shape is None else math.prod(shape) * dtype.itemsize
    if width is None or (per_record is not None and width != per_record) or width % dtype.itemsize:
        want = f"{per_record} bytes" if per_record is not None else f"a multiple of {dtype.itemsize} bytes"
        raise UsageError(f"`decode` {spec}: needs one string of {want} in every record, but "
                         f"{column.key!r} is {column.describe(n)}; fix the DTYPE/SHAPE or drop `decode`")
    return shape if shape is not None else (width // dtype.itemsize,)


def _float_shape(column, n, dtype, shape, spec):
    """A float feature reshaped: its values are float32, ``shape`` must hold exactly one record's values."""
    dense = column.dense_shape(n)
    count = None if dense is None else math.prod(dense[1:])
    if count is None or dtype != np.dtype("<f4") or (shape is not None and math.prod(shape) != count):
        want = "float32" if dtype != np.dtype("<f4") else f"a shape of {count} values"
        raise UsageError(f"`decode` {spec}: {column.key!r} is {column.describe(n)}; a float feature of one length "
                         f"in every record reads as float32 of a shape with that many values, so give {want}")
    return shape if shape is not None else (count,)
