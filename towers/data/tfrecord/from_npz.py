"""Write tf.train.Example (or SequenceExample) records from an npz in the converter's layout.

Usage::

    python -m tools.npz_to_tfrecord IN.npz -o OUT.tfrecords [--compression none|gzip|zlib]

The npz must follow the layout :mod:`tools.tfrecord_to_npz` writes: for each
feature ``F.present``, ``F.row_lengths``, ``F.values`` (and
``F.value_lengths`` for bytes); with ``context/`` and ``feature_lists/``
prefixes (``.step_counts`` per record, ``.row_lengths`` per step) the records
are SequenceExamples.  Dense keys, ``x``/``y`` and anything else are ignored:
the flat arrays alone define the records, so TFRecord -> npz -> TFRecord ->
npz gives the same npz.  The kind comes from the dtype of ``F.values``:
uint8 with ``value_lengths`` is bytes, floating is float (written as float32),
integer is int64.

The output is written as :mod:`towers.output.files` describes (never over the input,
no partial output or temporaries on failure, Ctrl-C or SIGTERM; exit status 0,
1 for unreadable input or a full disk, 2 for a layout or usage mistake, 130 on
Ctrl-C, 143 on SIGTERM).

A present feature with no values is written as an empty list of its kind (as
TensorFlow writes it); an absent one is left out of the record.  Limits: the
npz arrays are loaded into memory (the records are written one at a time).
"""

import argparse
import sys

import numpy as np

from towers.output.files import OutputError, Terminated, atomic_path, output_folder, refuse_overwriting_inputs, \
    sigterm_raises
from towers.data.tfrecord.framing import TFRecordWriter
from towers.data.tfrecord.proto import SequenceExample

PROG = "npz_to_tfrecord"


class LayoutError(Exception):
    """The npz does not follow the converter's layout."""


def _offsets(lengths):
    return np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).tolist()


class _Feature:
    """One feature's flat arrays, sliced per record as Python lists."""

    def __init__(self, npz, key, is_list):
        def need(suffix):
            if key + suffix not in npz:
                raise LayoutError(f"{key}{suffix} is missing; the npz must come from tools.tfrecord_to_npz")
            return npz[key + suffix]

        self.name = key.split("/", 1)[1] if "/" in key else key
        self.present = need(".present").astype(bool).tolist()
        values = need(".values")
        if key + ".value_lengths" in npz:
            self.kind, data = "bytes_list", values.astype(np.uint8).tobytes()
            ends = _offsets(npz[key + ".value_lengths"])
            self.values = [data[a:b] for a, b in zip(ends[:-1], ends[1:])]
            if ends[-1] != len(data):
                raise LayoutError(f"{key}.value_lengths add up to {ends[-1]} bytes, {key}.values has {len(data)}")
        elif values.dtype.kind == "f":
            self.kind, self.values = "float_list", values.astype(np.float32).tolist()
        elif values.dtype.kind in "iub":
            self.kind, self.values = "int64_list", values.astype(np.int64).tolist()
        else:
            raise LayoutError(f"{key}.values has dtype {values.dtype}; expected uint8, float32 or int64")
        # Per record: [start, end) into the per-step lengths (lists) or into the values.
        self.steps = _offsets(need(".step_counts")) if is_list else None
        self.value_ends = _offsets(need(".row_lengths"))
        if self.value_ends[-1] != len(self.values):
            raise LayoutError(f"{key}.row_lengths add up to {self.value_ends[-1]}, but there are "
                              f"{len(self.values)} values")
        if is_list and self.steps[-1] != len(self.value_ends) - 1:
            raise LayoutError(f"{key}.step_counts add up to {self.steps[-1]}, but {key}.row_lengths has "
                              f"{len(self.value_ends) - 1} steps")

    def fill(self, feature, i):
        """Set ``feature`` (a Feature message) to the values of row ``i`` of the flat arrays."""
        typed = getattr(feature, self.kind)
        typed.SetInParent()  # an empty list still records the kind
        typed.value.extend(self.values[self.value_ends[i]:self.value_ends[i + 1]])


def load_features(npz):
    """(context features, feature lists) found in an opened npz."""
    stems = sorted(k[: -len(".present")] for k in npz.files if k.endswith(".present"))
    if not stems:
        raise LayoutError("no F.present keys: the npz does not follow the tools.tfrecord_to_npz layout")
    sequence = any(s.startswith("feature_lists/") for s in stems)
    context = [_Feature(npz, s, False) for s in stems
               if not s.startswith("feature_lists/") and (s.startswith("context/") or not sequence)]
    lists = [_Feature(npz, s, True) for s in stems if s.startswith("feature_lists/")]
    counts = {len(f.present) for f in context + lists}
    if len(counts) != 1:
        raise LayoutError(f"features disagree on the number of records: {sorted(counts)}")
    return context, lists, counts.pop()


def records(context, lists, n):
    """Serialized records, one per row (Example wire format when there are no lists)."""
    for i in range(n):
        record = SequenceExample()
        for f in context:
            if f.present[i]:
                f.fill(record.context.feature[f.name], i)
        for f in lists:
            if f.present[i]:
                steps = record.feature_lists.feature_list[f.name].feature
                for step in range(f.steps[i], f.steps[i + 1]):
                    f.fill(steps.add(), step)
        yield record.SerializeToString()


def write_examples(out_path, x, y, compression="none", x_feature="image_raw", y_feature="label"):
    """Examples as the original MNIST script writes them: ``x_feature`` (each row's bytes), ``y_feature``
    and ``pixels`` (int64); written atomically.  Returns the record count."""
    with output_folder(out_path) as folder, atomic_path(out_path, folder) as tmp:
        with open(tmp, "wb") as f, TFRecordWriter(f, compression) as writer:
            for xi, yi in zip(x, y):
                record = SequenceExample()
                features = record.context.feature
                features[x_feature].bytes_list.value.append(np.ascontiguousarray(xi).tobytes())
                features[y_feature].int64_list.value.append(int(yi))
                features["pixels"].int64_list.value.append(int(np.size(xi)))
                writer.write(record.SerializeToString())
    return len(y)


def write(npz_path, out_path, compression="none", removed=None):
    """Write the records of ``npz_path`` to ``out_path`` atomically; return the record count.

    Paths of dead runs' temporary folders removed on the way are appended to ``removed``.
    """
    refuse_overwriting_inputs(out_path, [npz_path])
    with np.load(npz_path) as npz:
        context, lists, n = load_features(npz)
    with output_folder(out_path, removed) as folder, atomic_path(out_path, folder) as tmp:
        with open(tmp, "wb") as f, TFRecordWriter(f, compression) as writer:
            for payload in records(context, lists, n):
                writer.write(payload)
    return n


def main(argv=None, prog="python -m tools.npz_to_tfrecord"):
    """The command line; returns the exit status."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("input", metavar="IN.npz")
    p.add_argument("-o", "--output", required=True, metavar="OUT.tfrecords")
    p.add_argument("--compression", choices=("none", "gzip", "zlib"), default="none")
    args = p.parse_args(argv)
    stale = []
    try:
        with sigterm_raises():
            n = write(args.input, args.output, args.compression, stale)
    except OutputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.status
    except LayoutError as exc:
        print(f"{PROG}: error: {args.input}: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"{PROG}: error: {getattr(exc, 'filename', None) or args.input}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted: no output written", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{PROG}: terminated (SIGTERM): no output written", file=sys.stderr)
        return 143
    for path in stale:
        print(f"{PROG}: removed {path}: temporary files of a conversion that was killed", file=sys.stderr)
    print(f"{PROG}: wrote {args.output}: {n} records ({args.compression})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
