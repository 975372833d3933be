"""The fingerprint of a training set: what a checkpoint records so that a resume notices other data.

A resume checks the data's shape, class count and class names against the
checkpoint's and refuses a change (``towers.run.resume``).  Data of
the same shape can still differ: labels permuted, float32 pixels 0..16
where uint8 ones were (the input scale changes), other examples.  Such a
change does not stop a run, but its continuation follows another
trajectory, so the resume says so in one line, as it does for a changed
setting.  The fingerprint is what it compares::

    {"count": N, "dtype": "uint8", "labels": <hash>, "examples": <hash>}

* ``count`` and ``dtype``: the number of training examples and the dtype
  they are stored as (an image set's decoded pixels: uint8; what
  ``normalize`` makes of them is a setting's business, noted as such);
* ``labels``: a hash of every label (int32, 4 bytes an example, in memory);
* ``examples``: a hash of what the examples are stored as, which each kind
  of source gives cheaply (``Source.fingerprint``, ``towers.data.sources``):

  - arrays in memory or memory-mapped (npz, ``Dataset.from_arrays``, an npz
    to augment): every byte when the array is at most ``WHOLE_BYTES``, else
    ``SAMPLE`` rows spread evenly over it, first and last included (reads of
    ``SAMPLE`` rows of a mapped file);
  - TFRecord records (raw examples or encoded images): the feature's name
    and the payload CRC-32C of every record, which the record index keeps in
    memory and every read is checked against; so every record's bytes
    count, and nothing is read;
  - an image folder: every file's name under the folder (class folder and
    file: the order the shuffle visits) and the bytes of ``SAMPLE`` files
    spread evenly, read as stored; not decoded, so a new decoder or
    ``image_size`` does not change it, and neither does the decoded-image
    cache (the fingerprint is of the files, not of the cache).

What it does not cover: a changed example outside the sample of a large
array or of an image folder (a sample is what keeps it cheap on every
start), and the test data, which does not steer training.  Paths are not
part of it: a moved or copied file with the same contents is the same data.

Cost: one pass over the labels and the sample; computed once per
``Dataset`` (``Dataset.fingerprint``) on the first checkpoint or resume.
Blake2b, 16-byte digests, as hex.
"""
from __future__ import annotations

import hashlib

import numpy

SAMPLE = 64  # examples hashed from a large array or an image folder
WHOLE_BYTES = 16 << 20  # arrays up to this size are hashed whole (about 20 ms)


def new_hash():
    return hashlib.blake2b(digest_size=16)


def sample_rows(n: int) -> numpy.ndarray:
    """The rows of the sample of ``n`` examples: ``SAMPLE`` spread evenly, the first and the last included."""
    return numpy.unique(numpy.linspace(0, max(n - 1, 0), min(SAMPLE, n)).astype(numpy.int64))


def hash_rows(h, array) -> None:
    """Feed ``h`` an array's stored bytes: whole up to ``WHOLE_BYTES``, else ``sample_rows``."""
    a = numpy.asarray(array) if not isinstance(array, numpy.ndarray) else array
    if a.nbytes <= WHOLE_BYTES:
        h.update(memoryview(numpy.ascontiguousarray(a)).cast("B"))
        return
    for row in sample_rows(len(a)).tolist():
        h.update(memoryview(numpy.ascontiguousarray(a[row])).cast("B"))


def fingerprint(dataset) -> dict:
    """The fingerprint of ``dataset``'s training split (see the module docstring)."""
    x = dataset.x
    examples = new_hash()
    if isinstance(x, numpy.ndarray):  # in memory or mapped
        hash_rows(examples, x)
        dtype = x.dtype
    else:  # made on demand (towers.data.examples.Examples): the source they are made from
        x.stored.fingerprint(examples)
        dtype = x.stored.dtype
    labels = new_hash()
    labels.update(memoryview(numpy.ascontiguousarray(dataset.y, "<i4")).cast("B"))
    return {"count": int(len(x)), "dtype": numpy.dtype(dtype).name, "labels": labels.hexdigest(),
            "examples": examples.hexdigest()}


def changes(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints, in words (empty: the same data)."""
    out = []
    if old.get("count") != new.get("count"):
        out.append(f"{old.get('count')} -> {new.get('count')} examples")
    if old.get("dtype") != new.get("dtype"):
        out.append(f"examples stored as {old.get('dtype')} -> {new.get('dtype')}")
    if old.get("labels") != new.get("labels"):
        out.append("other labels")
    if old.get("examples") != new.get("examples") and old.get("dtype") == new.get("dtype"):
        out.append("other examples")
    return out
