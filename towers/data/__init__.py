"""Input: one data pipeline from files to the towers' devices, run from a description of the data set.

    description  ->  source  ->  per-example ops  ->  sampler  ->  worker pool  ->  batches  ->  staging
    (DataSpec)       (rows)      (decode, augment,    (which rows,  (runs the       (in order,     (a tower's slice
                                  normalize)           in order)     job)            ahead)         onto its device)

- **description** (``pipeline.py``: ``DataSpec``, ``describe``): the data
  set said once as data: its source (paths, keys, how a TFRecord feature is
  stored) and its per-example operations (``Images``, ``Augment``,
  ``Normalize``) with their settings.  ``loading.py`` (``load_dataset``)
  runs a description (or builds one from a path and the named settings);
  ``dataset.py`` holds and validates the result.
- **source** (``sources.py``): random access to examples by row: npz
  arrays (``ArraySource``; plain npz training reads the array itself), TFRecord
  records raw (``RawRecordSource``) or encoded images (``RecordSource``), image
  files (``FileSource``).  What a path is, and how each kind opens a split, is
  ``kinds.py`` (``KINDS``: image folder, TFRecord, npz; the one place a new
  kind of source is added).  TFRecord records are located by the record index
  (``tfrecord/index.py``) and read by the one record reader
  (``tfrecord/gather.py``: ``RecordReader``, framing, both CRCs and the
  record against its index, for every path; ``Gatherer``, the same checks a
  batch at a time).
- **per-example ops** (``image/augment.py``: ``Transform``): decode, augment,
  normalize, one example at a time, its draws from (seed, epoch, index).
  ``image/load.py`` decides where they run: an encoded-image training set
  that fits the budget is decoded once (``image/cache.py``: the decode's
  pixels, before augmentation) and then read from memory (``CachedSource``),
  the cheap operations after it in the input thread.
- **job** (``jobs.py``): what a worker runs for a chunk of rows, the
  operations bound to their source: ``Gather`` (rows as stored, a chunk at a
  time) or ``Transformed`` (each row read and transformed).
- **sampler** (``batches.py``: ``Sampler``): the seeded per-epoch permutation
  and the input position (``data/epoch``, ``data/index``), kept and
  serialized once.
- **worker pool** (``workers.py``: ``Workers``): one pool of processes,
  each fed through its own pipe, that runs a job on a chunk of rows
  straight into the batch's shared memory; ``workers=0`` runs it in the
  input thread.  The image converter decodes through it too.
- **batches** (``batches.py``: ``BatchSource``, ``Prefetcher``, ``Batch``):
  global batches drawn by the sampler, started ahead on a background thread,
  taken in order; ``Batch`` is the one batch type, waited for once.  The one
  examples array over the pool: ``examples.py`` (``Examples``).
- **staging** (``staging.py``; ``device_data.py`` keeps a training set on the
  GPUs instead).
"""
