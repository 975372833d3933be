"""Convert TFRecord files of tf.train.Example / SequenceExample records to one .npz (the library half of
``towers-tfrecord-to-npz``; its command line is :mod:`towers.tfrecord_to_npz`).

Each input is a path or a glob; a glob's matches are read in sorted order and
all inputs are concatenated in the order given.  The pipeline per file is
:class:`towers.data.tfrecord.framing.TFRecordReader` (framing, both CRCs, decompression)
-> :class:`towers.data.tfrecord.columns.ColumnStore` (protobuf parse, columns
spilled to an owned temporary folder beside the output, see :mod:`towers.files`) ->
:func:`towers.files.write_npz` into a temporary file that is renamed to the output
only when everything succeeded.  An output that is one of the inputs is refused
before anything is read.

Errors: :class:`UsageError` for a usage mistake (including the output being an
input), :class:`TFRecordError` and :class:`UndecodableImage` for damaged or
unreadable input (naming file, record index and byte offset), ``OSError`` /
``DiskError`` for a full disk.  No output and no temporary files are left
behind unless :func:`convert` returns; what a SIGKILL leaves is removed by the
next conversion writing to the same folder.  What happens on the way (the
compression detected, an empty file, dropped records, removed leftovers) is
said through ``say`` (by default the ``towers`` logger); nothing is printed.
See tools/README.md.
"""

import os
from dataclasses import dataclass

from towers.errors import info
from towers.files import atomic_path, check_new_output, output_folder, refuse_overwriting_inputs, write_npz
from towers.data.tfrecord.framing import TFRecordReader
from towers.data.tfrecord.columns import ColumnStore
from towers.data.tfrecord.schema import UsageError, decoded_shape, parse_decode, parse_image_decode
from towers.data.image.convert import decode_images
from towers.data.image.load import propose
from towers.data.inputs import expand_inputs

CHUNK_SIZE = 8 << 20  # bytes read and converted per batch


@dataclass(frozen=True)
class Reading:
    """How the TFRecord files are read: ``compression`` (``auto`` detects gzip/zlib per file), ``on_error``
    (``skip`` drops records whose payload CRC fails, framing intact, and counts them), ``chunk_size``
    (bytes per batch, > 0) and ``progress`` (a tqdm bar on stderr, shown only when it is a terminal)."""
    compression: str = "auto"
    on_error: str = "stop"
    chunk_size: int = CHUNK_SIZE
    progress: bool = False


@dataclass(frozen=True)
class Converted:
    """What :func:`convert` wrote (``kind``: Example or SequenceExample)."""
    rows: int
    kind: str
    features: int
    arrays: int


@dataclass(frozen=True)
class Schema:
    """What :func:`schema` found: the records, their kind, one line per feature, and the settings that
    train from the records' encoded images (``towers.data.image.load.propose``; None if they hold none)."""
    rows: int
    kind: str
    files: int
    lines: list
    proposal: str | None


def _decoded(store, name, dtype, shape, spec):
    """ArrayBytes of a bytes feature read as ``dtype`` with shape (N, *shape)."""
    column = store.find(name)
    if column is None or column.is_list:
        raise UsageError(f"--decode {spec}: no feature {name!r}; see --schema for the names")
    shape = decoded_shape(column, store.rows, dtype, shape, spec)
    return column.values.source(dtype=dtype, shape=(store.rows, *shape))


def _entries(store, decode, x, y, input_workers, ends=()):
    """The npz members: the convention's keys, decoded arrays, and x/y (``ends``: (path, records so far) after
    each input file, to name an image that does not decode)."""
    entries = dict(store.entries())
    dense_key = {name: store.prefixes()[0] + name for name in store.context}
    decoded = {}
    for spec in decode:
        image = parse_image_decode(spec)
        if image is not None:
            column = store.find(image[0])
            if column is None or column.is_list:
                raise UsageError(f"--decode {spec}: no feature {image[0]!r}; see --schema for the names")
            entries[dense_key[column.key]] = decoded[dense_key[column.key]] = decode_images(
                column, store.rows, image[1], store.spill_dir, input_workers, ends)
            continue
        name, dtype, shape = parse_decode(spec)
        source = _decoded(store, name, dtype, shape, spec)
        key = dense_key[store.find(name).key]
        entries[key] = decoded[key] = source
    for flag, name in (("x", x), ("y", y)):
        if name is None:
            continue
        column = store.find(name)
        if column is None or column.is_list:
            raise UsageError(f"--{flag} {name}: no feature {name!r}; see --schema for the names")
        key = dense_key[column.key]
        if key not in entries:
            raise UsageError(f"--{flag} {name}: the feature has no dense form ({column.describe(store.rows)}); "
                             "use --decode for fixed-length bytes")
        if flag in entries and flag != key:
            raise UsageError(f"--{flag} {name}: a feature is already called {flag!r}; rename it first")
        entries[flag] = entries[key]
    return list(entries.items())


def _progress(total, shown):
    from towers.errors import progress_bar
    return progress_bar(shown, total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="converting")


def read_all(paths, store, reading=Reading(), say=info, ends=None):
    """Feed every record of every file to ``store``; return the count of skipped records.

    ``ends``: a list that gets (path, records so far) after each file."""
    skipped, last_choice = 0, None
    with _progress(sum(os.path.getsize(p) for p in paths), reading.progress) as bar:
        for path in paths:
            reader = TFRecordReader(path, reading.compression, reading.on_error, reading.chunk_size)
            if reading.compression == "auto" and reader.compression != last_choice:
                say(f"{path}: compression auto -> {reader.compression}")
                last_choice = reader.compression
            if reader.size == 0:
                say(f"warning: {path} is empty (0 bytes): it adds no records")
            done = 0
            for batch in reader:
                store.add(batch, path)
                bar.update(reader.consumed - done)
                done = reader.consumed
                bar.set_postfix_str(f"{store.rows} records", refresh=False)
            bar.update(reader.consumed - done)
            skipped += reader.skipped
            if ends is not None:
                ends.append((path, store.rows))
    if skipped:
        say(f"warning: dropped {skipped} record(s) whose payload CRC failed (--on-error skip)")
    return skipped


def _check_decode(decode):
    """Flag mistakes surface before a long read: a malformed spec, two specs for one feature."""
    named = {}
    for spec in decode:
        image = parse_image_decode(spec)
        name = image[0] if image is not None else parse_decode(spec)[0]
        if name in named:
            raise UsageError(f"`decode` {named[name]} and `decode` {spec} both decode {name!r}: give one `decode` "
                             "for each feature")
        named[name] = spec


def schema(inputs, reading=Reading(), say=info, decode=()):
    """The :class:`Schema` of the records in ``inputs`` (paths or globs); reads everything, writes nothing.

    ``decode``: specs checked as :func:`convert` checks them (a mistake is refused before the read)."""
    paths = expand_inputs(inputs)
    _check_decode(decode)
    store = ColumnStore(None)
    read_all(paths, store, reading, say)
    return Schema(store.rows, "tf.train.SequenceExample" if store.sequence else "tf.train.Example", len(paths),
                  list(store.schema_lines()), propose(inputs[0]))


def convert(inputs, output, decode=(), x=None, y=None, compress=False, input_workers=None, reading=Reading(),
            say=info):
    """Write the records of ``inputs`` (paths or globs) to the npz ``output`` atomically; a :class:`Converted`.

    ``decode``: ``NAME:DTYPE[:SHAPE]`` or ``NAME:image:H,W,C`` specs (dense arrays of bytes features);
    ``x``/``y``: features whose dense arrays are also written as ``x``/``y``; ``compress``: deflate the
    members; ``input_workers``: processes that decode images (None: one per core).  The output path and
    the specs are checked before anything is read.
    """
    paths = expand_inputs(inputs)
    _check_decode(decode)
    if output is None:
        raise UsageError("give the output file with -o OUT.npz (or use --schema)")
    refuse_overwriting_inputs(output, paths)
    check_new_output(output, "tfrecord_to_npz", "-o")
    stale = []
    with output_folder(output, stale, "-o") as folder:
        for path in stale:
            say(f"removed {path}: temporary files of a conversion that was killed")
        store = ColumnStore(folder)
        ends = []
        read_all(paths, store, reading, say, ends)
        entries = _entries(store, decode, x, y, input_workers, ends)
        with atomic_path(output, folder) as tmp:
            write_npz(tmp, entries, compress=compress)
    return Converted(store.rows, "SequenceExample" if store.sequence else "Example", len(store.columns),
                     len(entries))
