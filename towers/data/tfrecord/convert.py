"""Convert TFRecord files of tf.train.Example / SequenceExample records to one .npz.

Usage::

    python -m tools.tfrecord_to_npz INPUT [INPUT ...] -o OUT.npz [options]
    python -m tools.tfrecord_to_npz output.tfrecords -o mnist.npz \\
        --decode image_raw:uint8:28,28 --x image_raw --y label

Each INPUT is a path or a glob; a glob's matches are read in sorted order and
all inputs are concatenated in the order given.  The pipeline per file is
:class:`towers.data.tfrecord.framing.TFRecordReader` (framing, both CRCs, decompression)
-> :class:`towers.data.tfrecord.columns.ColumnStore` (protobuf parse, columns
spilled to an owned temporary folder beside OUT, see :mod:`towers.output.files`) ->
:func:`towers.output.files.write_npz` into a temporary file that is renamed to OUT
only when everything succeeded.  An OUT that is one of the inputs is refused
before anything is read.

Exit status: 0 on success, 1 for damaged or unreadable input (one line naming
file, record index and byte offset) or a full disk, 2 for a usage mistake
(including OUT being an input), 130 on Ctrl-C, 143 on SIGTERM.  No OUT and no
temporary files are left behind unless the status is 0; what a SIGKILL leaves
is removed by the next run writing to the same folder.  See tools/README.md.
"""

import os
import sys
import time

from towers.cli import Parser, run_main, sigterm_raises
from towers.errors import flags_in_messages, render
from towers.output.files import atomic_path, output_folder, refuse_overwriting_inputs, write_npz
from towers.data.tfrecord.framing import COMPRESSIONS, TFRecordError, TFRecordReader
from towers.data.tfrecord.columns import ColumnStore
from towers.data.tfrecord.schema import UsageError, decoded_shape, parse_decode, parse_image_decode
from towers.data.image.convert import UndecodableImage, decode_images
from towers.data.image.load import propose
from towers.data.inputs import expand_inputs

PROG = "tfrecord_to_npz"


def _parser(prog):
    p = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="TFRecord file or glob (matches read sorted)")
    p.add_argument("-o", "--output", metavar="OUT.npz", help="output file (required unless --schema)")
    p.add_argument("--compression", choices=COMPRESSIONS, default="auto",
                   help="input compression; auto detects gzip/zlib per file (default: auto)")
    p.add_argument("--decode", action="append", default=[], metavar="NAME:DTYPE[:SHAPE]",
                   help="turn a fixed-length bytes feature into a dense array, e.g. image_raw:uint8:28,28")
    p.add_argument("--x", metavar="NAME", help="also write this feature's dense array as 'x'")
    p.add_argument("--y", metavar="NAME", help="also write this feature's dense array as 'y'")
    p.add_argument("--schema", action="store_true", help="print the inferred schema and write nothing")
    p.add_argument("--on-error", choices=("stop", "skip"), default="stop",
                   help="skip: drop records whose payload CRC fails (framing intact) and count them")
    p.add_argument("--compress", action="store_true", help="deflate the npz members (smaller, slower)")
    p.add_argument("--chunk-size", type=int, default=8 << 20, metavar="BYTES",
                   help="bytes read and converted per batch, > 0 (default 8 MiB)")
    p.add_argument("--input-workers", type=int, default=None, metavar="N",
                   help="processes that decode images for --decode NAME:image:H,W,C (default: one per core)")
    return p


def check_output_file(output, example="out.npz", flag="-o"):
    """Raise :class:`UsageError` unless ``output`` can become a file: not a folder, in a folder that exists.

    Call it before reading anything; the atomic writer would otherwise fail at
    the end, naming its hidden temporary file.
    """
    if not output:
        raise UsageError(f"{flag} is empty: give the output file's path")
    if os.path.isdir(output):
        raise UsageError(f"{flag} {output} is a directory: give a file path, for example {os.path.join(output, example)}")
    folder = os.path.dirname(os.path.abspath(output))
    if os.path.isdir(folder):
        return
    blocker = folder
    while not os.path.exists(blocker) and os.path.dirname(blocker) != blocker:
        blocker = os.path.dirname(blocker)  # the nearest part of the path that exists
    if os.path.isdir(blocker):
        raise UsageError(f"{flag} {output}: the folder {folder} does not exist; create it first")
    raise UsageError(f"{flag} {output}: {blocker} is a file, not a folder; give a path in a folder")


def _decoded(store, name, dtype, shape, spec):
    """ArraySource of a bytes feature read as ``dtype`` with shape (N, *shape)."""
    column = store.find(name)
    if column is None or column.is_list:
        raise UsageError(f"--decode {spec}: no feature {name!r}; see --schema for the names")
    shape = decoded_shape(column, store.rows, dtype, shape, spec)
    return column.values.source(dtype=dtype, shape=(store.rows, *shape))


def _entries(store, args, ends=()):
    """The npz members: the convention's keys, decoded arrays, and x/y (``ends``: (path, records so far) after
    each input file, to name an image that does not decode)."""
    entries = dict(store.entries())
    dense_key = {name: store.prefixes()[0] + name for name in store.context}
    decoded = {}
    for spec in args.decode:
        image = parse_image_decode(spec)
        if image is not None:
            column = store.find(image[0])
            if column is None or column.is_list:
                raise UsageError(f"--decode {spec}: no feature {image[0]!r}; see --schema for the names")
            entries[dense_key[column.key]] = decoded[dense_key[column.key]] = decode_images(
                column, store.rows, image[1], store.spill_dir, args.input_workers, ends)
            continue
        name, dtype, shape = parse_decode(spec)
        source = _decoded(store, name, dtype, shape, spec)
        key = dense_key[store.find(name).key]
        entries[key] = decoded[key] = source
    for flag, name in (("x", args.x), ("y", args.y)):
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


def _progress(total):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
                disable=not sys.stderr.isatty(), file=sys.stderr, desc="converting")


def read_all(paths, store, args, say, ends=None):
    """Feed every record of every file to ``store``; return the count of skipped records.

    ``ends``: a list that gets (path, records so far) after each file."""
    skipped, last_choice = 0, None
    with _progress(sum(os.path.getsize(p) for p in paths)) as bar:
        for path in paths:
            reader = TFRecordReader(path, args.compression, args.on_error, args.chunk_size)
            if args.compression == "auto" and reader.compression != last_choice:
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


def convert(args, say):
    paths = expand_inputs(args.inputs)
    for spec in args.decode:
        if parse_image_decode(spec) is None:
            parse_decode(spec)  # flag mistakes surface before a long read
    start = time.perf_counter()
    if args.schema:
        store = ColumnStore(None)
        read_all(paths, store, args, say)
        kind = "tf.train.SequenceExample" if store.sequence else "tf.train.Example"
        print(f"{store.rows} records ({kind}) in {len(paths)} file(s)")
        for line in store.schema_lines():
            print(line)
        hint = propose(args.inputs[0])
        if hint:
            with flags_in_messages():
                print("proposed: " + render(hint).replace("--x-key", "--x").replace("--y-key", "--y"))
        return
    if args.output is None:
        raise UsageError("give the output file with -o OUT.npz (or use --schema)")
    check_output_file(args.output)
    refuse_overwriting_inputs(args.output, paths)
    stale = []
    with output_folder(args.output, stale) as folder:
        for path in stale:
            say(f"removed {path}: temporary files of a conversion that was killed")
        store = ColumnStore(folder)
        ends = []
        read_all(paths, store, args, say, ends)
        entries = _entries(store, args, ends)
        with atomic_path(args.output, folder) as tmp:
            write_npz(tmp, entries, compress=args.compress)
    seconds = time.perf_counter() - start
    kind = "SequenceExample" if store.sequence else "Example"
    say(f"wrote {args.output}: {store.rows} {kind} records, {len(store.columns)} features, {len(entries)} arrays "
        f"in {seconds:.1f} s ({store.rows / max(seconds, 1e-9):,.0f} records/s)")


def main(argv=None, prog="towers-tfrecord-to-npz"):
    """The command line (``towers-tfrecord-to-npz``, ``python -m tools.tfrecord_to_npz``); the exit status."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.input_workers is not None and args.input_workers < 0:
        parser.error(f"--input-workers must be >= 0, got {args.input_workers}")
    if args.chunk_size <= 0:  # 0 would read nothing and write an empty npz
        parser.error(f"--chunk-size must be > 0 (bytes read per batch), got {args.chunk_size}")

    def say(message):
        print(f"{PROG}: {message}", file=sys.stderr)

    def body():
        with sigterm_raises():
            convert(args, say)

    return run_main(PROG, body, more={TFRecordError: 1, UndecodableImage: 1, UsageError: 2}, interrupted="interrupted: no output written",
                    terminated="terminated (SIGTERM): no output written")


if __name__ == "__main__":
    sys.exit(main())
