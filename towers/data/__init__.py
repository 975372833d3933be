"""Input: one data pipeline from files to the towers' devices.

    source  ->  per-example transform  ->  sampler  ->  worker pool  ->  batches  ->  staging
    (rows)      (decode, augment,          (which rows,  (makes the      (in order,     (a tower's slice
                 normalize)                 in order)     rows)           ahead)         onto its device)

- **source** (``sources.py``): random access to examples by row: npz
  arrays (``ArraySource``; plain npz training reads the array itself), TFRecord
  records raw (``RawRecordSource``) or encoded images (``RecordSource``), image
  files (``FileSource``).  TFRecord records are located by the record index
  (``tfrecord/index.py``) and read by the one record reader
  (``tfrecord/gather.py``: ``RecordReader``, framing, both CRCs and the
  record against its index, for every path; ``Gatherer``, the same checks a
  batch at a time).
- **transform** (``image/augment.py``): decode, augment, normalize, one
  example at a time, its draws from (seed, epoch, index).
  An encoded-image training set that fits the budget is decoded once
  (``image/cache.py``: the decode stage's pixels, before augmentation) and
  then read from memory (``CachedSource``).
- **sampler** (``batches.py``: ``Sampler``): the seeded per-epoch permutation
  and the input position (``data/epoch``, ``data/index``), kept and
  serialized once.
- **worker pool** (``workers.py``: ``Workers``): one pool of processes,
  each fed through its own pipe, that makes a chunk of rows straight into the
  batch's shared memory (a raw TFRecord chunk is gathered whole; other rows
  are read and transformed one by one); ``workers=0`` makes them in the
  input thread.
- **batches** (``batches.py``: ``BatchSource``, ``Prefetcher``): global
  batches drawn by the sampler, started ahead on a background thread, taken
  in order.  The examples arrays over the pool: ``tfrecord/records.py``
  (``RecordArray``, raw records) and ``image/array.py`` (``ImageArray``).
- **staging** (``staging.py``; ``device_data.py`` keeps a training set on the
  GPUs instead).

``loading.py`` (``load_dataset``) builds the stages from a path and the
settings; ``dataset.py`` holds and validates the result.
"""
