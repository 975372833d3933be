"""Every path that runs ops on a run's arrays runs them with that run's forms (``towers.ops.forms``).

The ops learn their form from ``forms.current()`` alone; outside a run's
scopes it answers ``NUMPY``, and an op asked there falls back to NumPy's
passes without a word: the same bits for an elementwise op, other bits for
batch norm and col2im (a checkpoint would record "numba" while NumPy ran).
``forms_seen`` watches every call of ``forms.current`` (a profile hook in
this thread and in the threads started inside the block: the tower threads)
and records the forms it answered to whom; a path is right when every answer
is the run's forms.  The runs here take numba (skipped without it): conv,
batch norm, max pool, on 2 CPU towers.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import threading

import numpy
import pytest

from towers import Config
from towers.ops import forms

pytest.importorskip("numba", reason="numba is not installed: the compiled CPU forms are optional")


@contextlib.contextmanager
def forms_seen():
    """{forms: Counter of the callers' names} of every ``forms.current()`` in the block, in this thread and in
    threads started inside it (a ``threading.setprofile`` hook: thread pools start their threads lazily)."""
    seen: dict = collections.defaultdict(collections.Counter)
    watched = forms.current.__code__

    def hook(frame, event, arg):
        if event == "call" and frame.f_code is watched:
            seen[forms.current()][frame.f_back.f_code.co_qualname] += 1
    previous = sys.getprofile()
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        yield seen
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)


def only(seen: dict, want: forms.Forms) -> None:
    """Every op asked ``want`` (and some op asked at all)."""
    assert seen, "no op asked for its form"
    wrong = {f: dict(callers) for f, callers in seen.items() if f != want}
    assert not wrong, f"ops ran outside the run's forms {want}: {wrong}"


def layers():
    import towers

    return [towers.Conv2D("c1", 4, 3), towers.BatchNorm("bn"), towers.ReLU(), towers.MaxPool2D(2),
            towers.Flatten(), towers.Dense("fc", 10)]


def config(tmp_path, **kw) -> Config:
    return Config(**{**dict(devices="cpu", n_gpu=2, batch_size=8, steps=4, lr=0.05, quiet=True, summary_every=0,
                            log_every=1000, checkpoint_every=0, cpu_kernels="numba", logdir=str(tmp_path)), **kw})


def every_call(t) -> None:
    """Each call of the Trainer's API that runs ops on its arrays."""
    x, y = t.source.next_batch()
    t.fit()
    t.train_step(x, y, want_loss=True)
    t.run_steps(2)
    t.finish()
    t.check_replicas()
    t.evaluate(ema=True)
    t.evaluate(ema=False, x=x[:5], y=y[:5])
    t.predict(x[:5], ema=True)
    t.predict(x[:5], ema=False)
    t.set_weights(t.get_weights())
    t.set_weights(t.get_weights(ema=True), ema=True)
    t.load_state_dict(t.state_dict())
    t.train_step(x, y)
    t.synchronize()


@pytest.mark.parametrize("settings", [dict(sync="grads", cpu_towers="threads"), dict(sync="grads", cpu_towers="serial"),
                                      dict(sync="weights", average_every=2), dict(sync_bn=True)],
                         ids=["threads", "serial", "weights", "sync_bn"])
def test_every_call_of_a_trainer_runs_its_forms(settings, tmp_path):
    """Steps on tower threads or serially, the weights mode's average and EMA, sync-BN, evaluation, prediction,
    weights and state set: every op asks for its form inside the run's scopes and gets the run's forms."""
    import towers

    with forms_seen() as seen:
        with towers.Trainer(config(tmp_path, **settings), model=layers()) as t:
            every_call(t)
            want = t.executor.forms
    assert want.compiled
    only(seen, want)


def test_a_trainer_built_in_one_thread_runs_its_forms_in_another(tmp_path):
    """Built in this thread, used from a worker thread (which starts without any forms): its own forms there."""
    import towers

    with towers.Trainer(config(tmp_path), model=layers()) as t:
        errors = []

        def work():
            try:
                every_call(t)
            except BaseException as e:  # noqa: BLE001 - raised by the test's thread
                errors.append(e)
        with forms_seen() as seen:
            worker = threading.Thread(target=work)
            worker.start()
            worker.join()
        assert not errors, errors
        only(seen, t.executor.forms)


def test_a_loaded_run_predicts_and_evaluates_with_its_forms_in_any_thread(tmp_path):
    """``towers.load``'s Predictor (built here, used here and from a worker thread): its forms in every call."""
    import towers

    with towers.Trainer(config(tmp_path / "run", n_gpu=1), model=layers()) as t:
        t.fit()
        x, y = t.source.next_batch()
    with towers.load(tmp_path / "run", model=layers()) as p:
        assert p.forms.compiled

        def work():
            p.predict(x, ema=True)
            p.predict(x, ema=False)
            p.evaluate(x=x, y=y)
            p.evaluate(ema=False)  # the run's test data
        with forms_seen() as seen:
            work()
            worker = threading.Thread(target=work)
            worker.start()
            worker.join()
        only(seen, p.forms)


def test_the_watch_sees_an_op_outside_a_scope():
    """The check has teeth: an op run outside any scope is seen asking, and answered ``NUMPY``."""
    from towers.ops.l2 import add_scaled

    g, w = numpy.ones(4, numpy.float32), numpy.ones(4, numpy.float32)
    with forms_seen() as seen:
        add_scaled(g, w, 0.5)
        with forms.host("numba").active():
            add_scaled(g, w, 0.5)
    assert set(seen) == {forms.NUMPY, forms.host("numba")}
    with pytest.raises(AssertionError, match="outside the run's forms"):
        only(seen, forms.host("numba"))


def test_the_gpu_benchmarks_forward_only_steps_run_the_towers_forms(tmp_path):
    """``tools/bench_gpu.py --forward-only`` times each tower's forward pass on its arrays: with the tower's forms
    (on a GPU: cuDNN where the row asks for it), not outside any (im2col, whatever the row says)."""
    import towers
    from tools import bench_gpu

    with towers.Trainer(config(tmp_path), model=layers()) as t:
        ring = [t.source.next_indices() for _ in range(2)]
        with forms_seen() as seen:
            step = bench_gpu._forward_steps(t, t.dataset, ring, 8, kept=2)
            step(0)
            step(1)
        only(seen, t.executor.forms)
