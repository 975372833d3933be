"""TFRecord files: framing and CRCs, the Example schema, conversion to npz, and training straight from them.

Modules, in data-flow order:

    framing    records, masked CRC32C, compression; the streaming reader and the writer
    proto      the tf.train.Example / SequenceExample messages, built at run time
    columns    parsed records -> columns (spilled to disk) and per-feature statistics
    schema     the ``--decode NAME:DTYPE[:SHAPE]`` syntax and its checks
    convert    TFRecord -> npz (its command line: ``towers.tfrecord_to_npz``)
    from_npz   npz -> TFRecord (its command line: ``towers.npz_to_tfrecord``)
    records    training input: a record index, its cache, and parse workers behind an array
"""
