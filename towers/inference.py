"""A finished run's model, for inference: ``towers.load`` and the ``Predictor`` it gives.

``towers.load(source)`` reads what a run left: its logdir (the newest
checkpoint there that loads), one of its ``ckpt-*.npz``, or its ``final.npz``
(weights only: the settings come from the checkpoint of its step beside it,
``towers.output.checkpoint.load_final``).  A checkpoint records the run's
settings and what its training data was (the example shape, the classes and
their names, the examples' stored dtype), so the model is built and its
inputs are checked without the training data.  ``towers.eval`` builds its
model, and finds its test data, through this module too: one piece of code.

Why a ``Predictor`` and not a ``Trainer``: docs/architecture.md, "Why some
paths are as they are".  What the two share is one piece of code each: the
input check (``towers.run.trainer.check_inputs``), the forward pass in chunks
(``Replica.predict``, ``Replica.evaluate``).

Algorithm: the raw and the EMA weights are checked against the model's
layout and kept as host flat arrays; one ``Replica`` on the device (the first
GPU where there is one, else the CPU) holds the model's buffers (batch
norm's moving statistics) and takes the weights asked for when they change.
Sync points: ``predict`` copies its logits to the host once at the end;
``evaluate`` brings each chunk's loss and count to the host.  Limits: the
weights are held twice on the host (raw and EMA) and once on the device; a
model handed to the ``Trainer`` as an object is not in its checkpoint, which
records only that there was one: give it again (``model=``).
"""
from __future__ import annotations

import contextlib
import json
import os
from types import SimpleNamespace

import numpy

from towers.arrays import check_host
from towers.config import MODEL_OBJECT, checkpoint_settings
from towers.data.dataset import OnDemand, TestSet, check_test_split, hold_out, test_label_warnings
from towers.data.fingerprint import changes as fingerprint_changes
from towers.data.inputs import is_tfrecord
from towers.data.loading import labelled, load_dataset, load_test_data, load_unlabelled
from towers.data.pipeline import DataSpec, describe
from towers.devices.cpu_threads import input_workers, limit_blas
from towers.devices.placement import Device, resolve
from towers.errors import UserError, notice
from towers.nn.models import build_model
from towers.nn.replica import Replica
from towers.output.checkpoint import named_to_flat, newest_readable, read_checkpoint, recorded_classes
from towers.run.resume import model_weights
from towers.settings import integer
from towers.state import Layout, under
from towers.run.trainer import check_inputs
from towers.step.tower import choose_forms

FIX = {"loaded": "it cannot be loaded", "evaluated": "it cannot be evaluated"}


def load(source: str, model=None) -> "Predictor":
    """The model of a finished run, ready to ``predict`` and ``evaluate`` without its training data.

    ``source``: a run's logdir (its newest checkpoint that loads; unreadable
    newer ones are skipped with a notice), a ``ckpt-*.npz``, or a run's
    ``final.npz`` (with the checkpoint of its step beside it, as a run leaves
    it).  ``model``: the model object (a ``towers.Sequential`` or a list of
    layers) a run was given in place of a built-in one.  Anything else is a
    ``UserError`` in one line.
    """
    what = "give a run's logdir, one of its ckpt-*.npz, or its final.npz"
    if not isinstance(source, (str, bytes, os.PathLike)):
        raise UserError(f"towers.load: {source!r} ({type(source).__name__}) is not a path: {what}")
    source = os.fsdecode(source)
    if os.path.isdir(source):
        found = newest_readable(source, notice, "load", lambda newest: f"towers.load({newest!r}) says why it fails")
        if found is None:
            raise UserError(f"towers.load: no checkpoint in {source}: {what} (train with `logdir` {source} first)")
        path, arrays = found
    elif not os.path.exists(source):
        raise UserError(f"towers.load: {source} does not exist: {what}")
    else:
        path, arrays = source, read_checkpoint(source)
    return Predictor(path, arrays, model=model)


class Predictor:
    """A trained model from a checkpoint, on one device: ``predict``, ``evaluate``, ``get_weights``.

    Made by ``towers.load`` (or by ``towers.eval``, from the arrays of
    ``towers.output.checkpoint.load_checkpoint``).  Its attributes describe the
    run: ``path`` (the checkpoint read), ``step``, ``config`` (the run's
    settings, a dict), ``example_shape`` (what the model takes),
    ``example_dtype`` (what the run's data stored: the dtype ``predict``
    takes; None when the checkpoint does not record it, before
    fingerprints), ``num_classes``, ``classes`` (an image folder's class
    names, label k at k, else None), ``model``, ``device``, and how it
    computes there, chosen as a ``Trainer`` of one tower on that device
    chooses (``towers.step.tower.choose_forms``,
    ``towers.devices.cpu_threads.limit_blas``): ``forms`` (``towers.ops.forms``,
    current while it computes), ``cpu_kernels`` (``numba`` or ``numpy``: the
    forms' name) and ``blas_threads`` (None on a GPU), held until ``close``.

    Inputs: ``predict`` and ``evaluate`` take examples as the run's data
    stored them (uint8 pixels, or floats) and apply the run's own input
    transform inside, as its loader and towers did (``input_scale``; for a
    run with image operations, ``normalize`` and the deterministic path of
    ``augment``: ``towers.data.image.load.made_as_trained``); examples on
    another scale (floats for a run of uint8 pixels) are refused.  ``device``: where it runs (default: the first GPU
    where there is one, else the CPU); ``test`` and ``test_sets``: what
    ``test_data`` reads (``TestSets.get``'s overrides, and the cache it is
    kept in: ``towers.eval`` shares one between checkpoints); ``purpose``: how
    a checkpoint that does not fit its model is refused ("it cannot be ...").
    Use it as a context manager, or ``close()`` (a TFRecord or image test set
    has input workers to stop).
    """

    def __init__(self, path: str, arrays: dict, model=None, device: Device | None = None, test: dict | None = None,
                 test_sets: "TestSets | None" = None, purpose: str = "loaded"):
        ck = arrays["config"]
        self.path, self.step, self.config = path, int(arrays["step"]), ck
        self.example_shape = tuple(int(v) for v in numpy.ravel(arrays["data/shape"])[1:])
        self.num_classes = int(arrays["data/num_classes"])
        self.classes = recorded_classes(arrays)
        self.example_dtype = stored_dtype(arrays)
        self._spec = run_spec(arrays, None, decode=ck.get("decode"))
        if not self._spec.ops:
            self._spec = None  # the stored examples are the model's inputs (scaled on the device)
        elif self.example_dtype is None:
            self.example_dtype = numpy.dtype(numpy.uint8)  # image operations take uint8 pixels
        self.model = run_model(arrays, path, model)
        self._weights = {ema: named_to_flat(self.model, model_weights(self.model, arrays, "ema" if ema else "params",
                                                                     path, FIX[purpose]))
                         for ema in (False, True)}
        buffers = Layout(self.model.buffer_layout(), self.model.minimums())  # moving statistics: evaluation normalizes with them
        self._buffers = buffers.join(buffers.check(under(arrays, "buffers"), f"{path} does not fit this model",
                                                   "buffer"))
        self.device = device or resolve(1, None, soft=True).towers[0]  # a GPU when there is one
        # As a Trainer of one tower on this device computes: its forms of the ops and its BLAS threads.
        self.settings = SimpleNamespace(**checkpoint_settings(ck))
        # No CUDA graphs for a loaded run (it captures nothing): CuPy's GEMM binding makes the same cuBLAS calls
        # as nvmath-python's, so a run trained with `cuda_graphs` loads where nvmath-python is not installed.
        self.forms = choose_forms(SimpleNamespace(**{**vars(self.settings), "cuda_graphs": False}), self.model,
                                  [self.device])
        self.cpu_kernels = self.forms.name
        self.blas_threads, self._blas = limit_blas([self.device], self.settings.blas_threads)
        with self._scope():
            self.replica = Replica(self.model, self.device.xp)
            self.replica.input_scale = self.settings.input_scale
            self.replica.set_buffers(self._buffers)
        self._holds = None  # which weights the replica holds: True the EMA's, False the raw ones
        self._arrays, self._test = arrays, dict(test or {})
        self._own_sets = test_sets is None
        self._sets = TestSets() if test_sets is None else test_sets

    @contextlib.contextmanager
    def _scope(self):
        """Its device current, with its forms (``towers.ops.forms``): where its replica is made and runs."""
        with self.device.scope(), self.forms.active():
            yield

    def _replica(self, ema: bool) -> Replica:
        """The replica with the weights asked for (call within ``_scope``)."""
        if self._holds is not bool(ema):
            self.replica.set_params(self._weights[bool(ema)])
            self._holds = bool(ema)
        return self.replica

    def _check(self, x, y, where: str):
        """(x, y) as the model takes them: ``x`` checked as the ``Trainer`` checks examples, against what the
        run's data stored, and for a run with image operations made by them (an array made on demand, which
        the caller closes); ``y`` checked against the classes."""
        check_host(x, f"{where}: x")
        x = x if hasattr(x, "dtype") else numpy.asarray(x)
        uint8 = numpy.dtype(numpy.uint8)
        if self.example_dtype == uint8 and x.dtype != uint8 and x.dtype.kind in "fiu":
            raise UserError(f"{where}: x is {x.dtype}, but this run takes uint8 pixels (0..255) and {self._does()} "
                            "itself: give the raw uint8 pixels (not scaled to 0..1, not normalized)")
        if self._spec is None:
            return check_inputs(x, y, where, self.example_shape, self.example_dtype, self.num_classes)
        c = self.example_shape[-1]
        # (N, H, W) is grey images only; one image (H, W, C) is not H images (W, C): its last axis says so.
        alone = x.ndim == 3 and x.shape[-1] == c
        if alone or x.ndim not in (3, 4) or (x.ndim == 4 and x.shape[-1] != c) or (x.ndim == 3 and c != 1):
            grey = " or (N, H, W)" if c == 1 else ""
            raise UserError(f"{where}: x must be images (N, H, W, {c}){grey} of uint8 pixels (any H x W: they are "
                            f"fitted as the run fitted its images), got {x.dtype} {tuple(x.shape)}"
                            + (": one image needs its batch axis (x[None])" if alone else ""))
        x, y = check_inputs(x, y, where, x.shape[1:], uint8, self.num_classes)
        from towers.data.image.load import made_as_trained  # the image path: imported only for it
        from towers.data.kinds import image_arrays

        labels = numpy.zeros(len(x), numpy.int32) if y is None else y
        return made_as_trained(self._spec, image_arrays(x, labels, f"{where}: x"), self.example_shape,
                               f"{where}: x"), y

    def _does(self) -> str:
        """What the run's input transform does to uint8 pixels, for messages."""
        s = self.settings
        done = [f"scales (`input_scale` {s.input_scale})" if s.augment != "tf-cifar10" else "standardizes"]
        if s.normalize:
            done.append(f"normalizes (`normalize` {s.normalize})")
        if self._spec is not None:
            done.append("fits (`augment` " + s.augment + ")" if s.augment != "none" else "fits")
        return ", ".join(done[:-1]) + " and " + done[-1] if len(done) > 1 else done[0]

    def predict(self, x=None, ema: bool = True, batch_size: int = 250) -> numpy.ndarray:
        """The logits of ``x`` (default: the test data) as a host float32 array (len(x), classes).

        As ``Trainer.predict``: the EMA weights (``ema=False``: the raw ones),
        evaluation mode, chunks of ``batch_size``.  ``x``: examples as the
        run's data stored them (see the class doc: the run's input transform
        is applied here); for the same examples the logits are the
        ``Trainer``'s.
        """
        batch = integer(batch_size, 1, "predict: batch_size")
        made = x is not None
        x = self.test_data().x if x is None else self._check(x, None, "predict")[0]
        try:
            with self._scope():
                return self._replica(ema).predict(x, batch)
        finally:
            if made and isinstance(x, OnDemand):
                x.close()

    def evaluate(self, ema: bool = True, x=None, y=None) -> dict:
        """{"loss", "accuracy"} on ``x``, ``y`` (checked as ``Trainer.evaluate`` checks them), or on the test
        data (``test_data``); the loss is the mean cross-entropy without the L2 term."""
        if (x is None) != (y is None):
            raise UserError("evaluate: give both x and y (examples and their labels), or neither for the test data")
        made = x is not None
        if x is None:
            ds = self.test_data()
            x, y = ds.x, ds.y
        else:
            x, y = self._check(x, y, "evaluate")
        try:
            with self._scope():
                loss, acc = self._replica(ema).evaluate(x, y)
        finally:
            if made and isinstance(x, OnDemand):
                x.close()
        return {"loss": loss, "accuracy": acc}

    def test_labelled(self) -> bool:
        """Whether the test data (``test_data``'s source) has labels (``towers.data.loading.labelled``): else
        ``predict_unlabelled`` predicts it."""
        if held_out_split(self._arrays, self._test.get("data"), self._test.get("test_data")):
            return True  # training examples, with their labels
        return labelled(test_spec(self._arrays, **self._test)[0])

    def predict_unlabelled(self, ema: bool = True, batch_size: int = 250) -> tuple[numpy.ndarray, list | None]:
        """(logits, file names or None) of the test data's source read without labels
        (``towers.data.loading.load_unlabelled``): every image below a folder (flat or in class folders: the
        names are their paths below it), an npz's examples, a TFRecord's; made as the run made its test data."""
        batch = integer(batch_size, 1, "predict: batch_size")
        spec = test_spec(self._arrays, **self._test)[0]
        x, names = load_unlabelled(spec, self.example_shape, input_workers(self.config.get("input_workers"), 0))
        try:
            if self._spec is None:  # stored examples: those the run trained on, or not
                check_test_split(x, None, f"{spec.path}: ", spec.x_key, self.example_dtype, self.example_shape)
            with self._scope():
                return self._replica(ema).predict(x, batch), names
        finally:
            if isinstance(x, OnDemand):
                x.close()

    def test_data(self) -> TestSet:
        """The test split ``evaluate()`` and ``predict()`` take without ``x``: the run's `test_data`, else its
        `data`'s x_test/y_test, read alone (``towers.data.loading.load_test_data``: the training data may be
        gone), labelled in the run's classes; for a run with `validation_split`, the examples it held out of
        its `data` (``held_out_test``); loaded once."""
        return self._sets.get(self._arrays, **self._test)

    def get_weights(self, ema: bool = False) -> dict[str, numpy.ndarray]:
        """{name: float32 host copy}: the weights (or the EMA's), then the model's buffers, as
        ``Trainer.get_weights`` gives them."""
        named = Layout(self.model.layout()).split(self._weights[bool(ema)])
        named.update(Layout(self.model.buffer_layout()).split(self._buffers))
        return {k: numpy.array(v, dtype=numpy.float32) for k, v in named.items()}

    def __repr__(self) -> str:
        dtype = f" {self.example_dtype}" if self.example_dtype is not None else ""
        model = self.config.get("model", "mlp")
        return (f"<towers.Predictor {os.path.basename(self.path)} (step {self.step}): {model}, examples "
                f"{self.example_shape}{dtype} -> {self.num_classes} classes, on {self.device}>")

    def close(self) -> None:
        """Stop the input workers of a TFRecord or image test set it loaded, and give the process its BLAS
        threads back (idempotent)."""
        if self._own_sets:
            self._sets.close()
        if self._blas is not None:
            self._blas.restore_original_limits()
            self._blas = None

    def __enter__(self) -> "Predictor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_model(arrays: dict, path: str, model=None):
    """The model a checkpoint's run trained, built from its settings for its data's shape and classes
    (``towers.nn.models.build_model``); ``model``: the model object the run was given, which a checkpoint
    records only as ``<model object>``."""
    ck = arrays["config"]
    spec = ck.get("model", "mlp") if model is None else model
    if isinstance(spec, str) and spec == MODEL_OBJECT:
        raise UserError(f"{path} was trained with a model object handed to the Trainer, which a checkpoint does not "
                        f"hold: give it again in Python, towers.load({path!r}, model=...)")
    shape = tuple(int(v) for v in numpy.ravel(arrays["data/shape"])[1:])
    return build_model(spec, shape, int(arrays["data/num_classes"]), ck.get("hidden", 500))


def run_spec(arrays: dict, path, x_key="x", y_key="y", decode=None) -> DataSpec:
    """The description (``towers.data.pipeline``) of ``path`` read as a checkpoint's run read its data: its
    settings' operations (``normalize``, ``augment``, ``image_size``, ``input_scale``), and an ``Images`` op
    when the run had one (image operations, or an image folder: it recorded its classes).  ``path`` None:
    the run's operations alone (what a loaded run applies to the examples it is given)."""
    ck = arrays["config"]
    settings = dict(on_error=ck.get("on_error", "stop"), augment=ck.get("augment", "none"),
                    normalize=ck.get("normalize"), image_size=ck.get("image_size"),
                    input_scale=ck.get("input_scale", "1/255"))
    spec = describe(path, x_key, y_key, decode=decode, **settings)
    if recorded_classes(arrays) is not None or describe(None, decode=ck.get("decode"), **settings).ops:
        spec = spec.as_images()
    return spec


def test_spec(arrays: dict, data=None, test_data=None, x_key=None, y_key=None, decode=None) -> tuple[DataSpec, bool]:
    """(the description of a checkpoint's test data, whether it is `data`'s own test split): ``test_data``
    (else the checkpoint's, unless ``data`` replaces the whole data source), else ``data`` (else the
    checkpoint's); the keys and ``decode`` the checkpoint's unless given; read as the run read its data
    (``run_spec``: a model trained from images has its test data made as images too)."""
    ck = arrays["config"]
    test = test_data or (None if data else ck.get("test_data"))
    path = test or data or ck["data"]
    x_key, y_key = x_key or ck.get("x_key", "x"), y_key or ck.get("y_key", "y")
    return run_spec(arrays, path, x_key, y_key, decode or (ck.get("decode") if is_tfrecord(path) else None)), \
        test is None


def held_out_split(arrays: dict, data=None, test_data=None) -> float:
    """The checkpoint's `validation_split` where its test data is the split it held out of its training data
    (no `test_data`, given or recorded, and no other ``data`` in place of its own), else 0."""
    ck = arrays["config"]
    if test_data or data or ck.get("test_data"):
        return 0.0
    return float(ck.get("validation_split") or 0.0)


def held_out_test(arrays: dict, spec: DataSpec) -> TestSet:
    """The examples a run of `validation_split` held out of its training data ``spec`` as its test data:
    the data read again whole (``towers.data.loading.load_dataset``, with the run's `seed`: synthetic data is
    made again) and split by ``towers.data.dataset.hold_out`` with the run's `validation_split` and `seed`,
    as the ``Trainer`` split it.  What stays to train on is checked against the checkpoint's record of its
    training examples (their shape and fingerprint, ``towers.data.fingerprint``): data gone or changed since
    the run holds out other examples, and is a UserError.  Limits: the whole training data is read, and a
    change outside the fingerprint's sample of a large array is not noticed."""
    ck = arrays["config"]
    split, seed = ck["validation_split"], ck.get("seed", 0)
    again = f"the run held out `validation_split` {split:g} of `data` {spec.path} as its test data"
    fix = "restore the data as it was, or give test data (`test_data`)"
    try:
        whole = load_dataset(spec, workers=0, seed=seed)
    except UserError as e:
        raise UserError(f"{again}, which cannot be read again ({e}): {fix}") from None
    try:
        ds = hold_out(whole, split, seed)
    finally:
        whole.close()
    shape = tuple(int(v) for v in numpy.ravel(arrays["data/shape"]))
    differs = ([] if tuple(ds.x.shape) == shape else [f"examples {shape} -> {tuple(ds.x.shape)} after the split"])
    if not differs and "data/fingerprint" in arrays:
        differs = fingerprint_changes(json.loads(str(numpy.asarray(arrays["data/fingerprint"])[()])), ds.fingerprint)
    if differs:
        raise UserError(f"{again}, which changed since ({', '.join(differs)}): the examples held out now are "
                        f"not those; {fix}")
    return TestSet(ds.x_test, ds.y_test, test_label_warnings(ds.y_test))


def stored_dtype(arrays: dict) -> numpy.dtype | None:
    """The dtype a checkpoint's training examples were stored as (its fingerprint's): uint8 pixels, or float32
    (the loader makes every float dtype float32); what a loaded run takes, its input transform applied after.
    None when the checkpoint does not record it (written before ``data/fingerprint``)."""
    if "data/fingerprint" not in arrays:
        return None
    stored = json.loads(str(numpy.asarray(arrays["data/fingerprint"])[()])).get("dtype")
    return numpy.dtype(numpy.uint8 if stored == "uint8" else numpy.float32)


class TestSets:
    """The test splits checkpoints are evaluated on, each loaded once (``towers.eval --watch`` evaluates many
    checkpoints of one run); ``loaded(test_set)`` is called with each one when it is loaded."""

    __test__ = False  # not a pytest class

    def __init__(self, loaded=None):
        self._sets: dict = {}
        self.loaded = loaded

    def get(self, arrays: dict, data: str | None = None, test_data: str | None = None, x_key: str | None = None,
            y_key: str | None = None, decode: str | None = None) -> TestSet:
        """The test split a checkpoint is evaluated on, labelled in its classes.

        ``test_data`` (else the checkpoint's, unless ``data`` replaces the whole data source) is read
        alone; without one, the test split of ``data`` (else the checkpoint's): an npz's ``x_test``/
        ``y_test``.  The training data is not read (but for `validation_split`, below): what the test split is checked and matched against
        (example shape, classes and their names, the stored dtype) is in the checkpoint.  ``x_key``,
        ``y_key``, ``decode``: the checkpoint's unless given.  A run of `validation_split` without test
        data is evaluated on the examples it held out (``held_out_test``: its training data is read).
        """
        ck = arrays["config"]
        spec, own = test_spec(arrays, data, test_data, x_key, y_key, decode)
        shape = tuple(int(v) for v in numpy.ravel(arrays["data/shape"])[1:])
        classes = recorded_classes(arrays)
        stored = json.loads(str(arrays["data/fingerprint"][()])) if "data/fingerprint" in arrays else {}
        split = held_out_split(arrays, data, test_data) if own else 0.0
        held = (split, ck.get("seed", 0), stored.get("labels"), stored.get("examples")) if split else None
        key = (spec.path, own, spec.x_key, spec.y_key, shape, int(arrays["data/num_classes"]),
               tuple(classes) if classes else None, stored.get("dtype"), held)
        if key not in self._sets:
            if held:
                ds = held_out_test(arrays, spec)
            else:
                ds = load_test_data(spec, shape, key[5], classes, stored.get("dtype"),
                                    workers=input_workers(ck.get("input_workers"), 0), own=own)
            if self.loaded is not None:
                self.loaded(ds)
            self._sets[key] = ds
        return self._sets[key]

    def close(self) -> None:
        """Stop the worker processes of TFRecord and image test sets."""
        for ds in self._sets.values():
            ds.close()
