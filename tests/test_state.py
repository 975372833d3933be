"""Components that own their state: round trips, strict loading, a layer with a buffer, old checkpoints."""
import shutil
from pathlib import Path

import numpy as np
import pytest

import towers
from towers import Config, Trainer, UserError
from towers.config import DEFAULT_DATA
from towers.data.batches import InputPosition
from towers.nn.layers import Dense, Flatten, Layer, Param, ReLU, Sequential
from towers.optim.ema import EMA
from towers.optim.optimizers import SGD, Adam
from towers.optim.optimizers.adamw import AdamW
from towers.optim.optimizers.rmsprop import RMSProp
from towers.state import Layout
from towers.output.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parent.parent
OLD = REPO / "tests" / "files" / "ckpt-format1-step10.npz"  # written by towers 41a9acc (format 1)
SMALL = dict(devices="cpu", n_gpu=2, hidden=8, batch_size=20, summary_every=0, quiet=True)


def layout():
    return Layout([("a/w", (3, 2), 0, 6), ("a/b", (2,), 6, 2)])


@pytest.mark.parametrize("make", [lambda p: SGD(p, 0.9), lambda p: Adam(p), lambda p: AdamW(p),
                                  lambda p: RMSProp(p, momentum=0.5, centered=True)])
def test_an_optimizers_slots_round_trip_under_their_names(make):
    rng = np.random.default_rng(0)
    opt = make(np.zeros(8, np.float32))
    for buf in opt.state.values():
        buf[...] = rng.random(8, dtype=np.float32)
    state = opt.state_dict(layout())
    assert sorted(state) == sorted(f"{s}/{n}" for s in opt.state for n in ("a/w", "a/b"))
    other = make(np.zeros(8, np.float32))
    other.set_state(other.read_state(state, layout(), "here"))
    for slot in opt.state:
        assert np.array_equal(opt.state[slot], other.state[slot])
    bad = {**state, next(iter(state)): np.zeros((9,), np.float32)}
    with pytest.raises(UserError, match=f"{next(iter(state)).split('/', 1)[1]}.*shape"):
        other.read_state(bad, layout(), "here")


def test_the_ema_and_the_input_position_round_trip():
    ema = EMA(np.arange(8, dtype=np.float32), 0.9)
    state = ema.state_dict(layout())
    assert sorted(state) == ["ema/a/b", "ema/a/w"]
    other = EMA(np.zeros(8, np.float32), 0.9)
    other.set_state(other.read_state(state, layout(), "here"))
    assert np.array_equal(other.shadow, ema.shadow)
    pos = InputPosition(100, 30, start_step=2, start=(1, 50))
    assert pos.at(4) == (2, 10) and pos.state_dict(4) == {"data/epoch": 2, "data/index": 10}
    assert pos.read_state(pos.state_dict(4), "here") == (2, 10)


def test_a_trainers_state_dict_is_the_union_of_its_parts_and_round_trips():
    with Trainer(Config(**SMALL, momentum=0.9, steps=5)) as a:
        for _ in range(5):
            a.train_step(*a.source.next_batch())
        state = a.state_dict()
        with Trainer(Config(**SMALL, momentum=0.9, steps=5)) as b:
            b.load_state_dict(state)
            again = b.state_dict()
    assert sorted(state) == sorted(again)
    for k in state:
        assert np.array_equal(state[k], again[k]), k
    prefixes = {k.split("/")[0] for k in state}
    assert {"params", "ema", "momentum", "data", "step", "sync", "format", "config"} <= prefixes


@pytest.mark.parametrize("key, value, message", [
    ("data/index", np.int64(10 ** 9), "'data/index' 1000000000 is beyond"),
    ("data/epoch", np.int64(-1), "'data/epoch' must be an integer >= 0"),
    ("step", np.int64(-3), "'step' must be an integer >= 0"),
    ("step", np.float64(2.5), "'step' must be an integer"),
    ("mystery/x", np.zeros(2, np.float32), "'mystery/x' is not part of a towers state dict"),
])
def test_load_state_dict_refuses_bad_counters_and_keys_before_changing_anything(key, value, message):
    with Trainer(Config(**SMALL)) as t:
        t.train_step(*t.source.next_batch())
        state = t.state_dict()
        before = t.get_weights()
        with pytest.raises(UserError, match=message):
            t.load_state_dict({**state, "params/layer1/biases": state["params/layer1/biases"] + 1, key: value})
        assert all(np.array_equal(before[k], v) for k, v in t.get_weights().items())
        assert t.step == 1


# -- a layer with a buffer ----------------------------------------------------------------------


class RunningMean(Layer):
    """Passes x through; in training keeps a moving mean of its input's features as a buffer."""

    scope = "running"

    def build(self, in_shape):
        return [Param("mean", tuple(in_shape), trainable=False)], tuple(in_shape)

    def forward(self, p, x, ws):
        m = p["mean"]
        m *= np.float32(0.9)
        m += np.float32(0.1) * x.mean(axis=0)
        return x

    def backward(self, p, g, dy, ws, need_dx):
        return dy if need_dx else None


def buffered_model(input_shape, num_classes):
    return [Flatten(), RunningMean(), Dense("layer1", 8), ReLU(), Dense("layer2", num_classes)]


def test_a_buffer_is_state_but_not_a_weight_everywhere(tmp_path):
    cfg = Config(**SMALL, model="tests.test_state:buffered_model", steps=6, sync="weights", average_every=3,
                 logdir=str(tmp_path / "a"))
    with Trainer(cfg) as t:
        assert t.model.size == 64 * 8 + 8 + 8 * 10 + 10  # the buffer is no trainable parameter
        assert [r.buffers.size for r in t.executor.replicas] == [64, 64]
        t.train_step(*t.source.next_batch())
        t.synchronize()
        # Weights mode: between averages each tower's buffer follows its own slice...
        assert not np.array_equal(t.executor.replicas[0].buffers, t.executor.replicas[1].buffers)
        t.train_step(*t.source.next_batch())
        t.train_step(*t.source.next_batch())  # step 3: an average
        t.synchronize()
        # ... and the average makes them equal, as it does the weights.
        assert np.array_equal(t.executor.replicas[0].buffers, t.executor.replicas[1].buffers)
        assert t.executor.replicas[0].buffers.any()
        w = t.get_weights()
        assert "running/mean" in w and w["running/mean"].shape == (64,)
        assert "running/mean" in t.get_weights(ema=True)
        state = t.state_dict()
        assert "buffers/running/mean" in state and "params/running/mean" not in state
        assert "ema/running/mean" not in state  # the EMA covers trainable weights only
        # set_weights takes the buffer with the weights, strictly.
        t.set_weights({**w, "running/mean": np.full(64, 0.5, np.float32)})
        assert all((r.buffers == 0.5).all() for r in t.executor.replicas)
        missing = {k: v for k, v in w.items() if k != "running/mean"}
        with pytest.raises(UserError, match="'running/mean' is missing"):
            t.set_weights(missing)
        t.set_weights(missing, ema=True)  # EMA weights: the buffers are optional


def test_a_buffer_survives_checkpoint_and_resume_exactly(tmp_path, monkeypatch):
    base = dict(**SMALL, model="tests.test_state:buffered_model", checkpoint_every=4)
    with Trainer(Config(**base, steps=8, logdir=str(tmp_path / "whole"))) as t:
        t.fit()
    with Trainer(Config(**base, steps=4, logdir=str(tmp_path / "split"))) as t:
        t.fit()
    with Trainer(Config(**base, steps=8, logdir=str(tmp_path / "split"), resume=True)) as t:
        t.fit()
    whole, split = np.load(tmp_path / "whole" / "ckpt-00000008.npz"), np.load(tmp_path / "split" / "ckpt-00000008.npz")
    assert "buffers/running/mean" in whole.files and whole["buffers/running/mean"].any()
    for k in whole.files:
        if k != "config":
            assert np.array_equal(whole[k], split[k]), k


# -- checkpoints written before the redesign ------------------------------------------------------


def test_a_checkpoint_written_before_the_redesign_resumes_as_one_written_now_and_near_a_fresh_run(tmp_path):
    """The old checkpoint's 10 steps were trained on another CPU, whose BLAS rounds differently: a
    fresh run here matches them to float32 rounding, not to the bit.  So the exact check compares
    code with code on this machine: the old file resumed, and a checkpoint written now from the
    state it loads, resumed (that a checkpoint written now resumes to an uninterrupted run's
    weights, bit for bit, is tests/output/test_checkpoint.py's).  The fresh run is compared with a
    tolerance far above rounding (about 1e-7 here) and far below a lost step or input position."""
    # The data given: a resume would take the checkpoint's path, of the machine that wrote it.
    cfg = dict(**SMALL, checkpoint_every=10, data=DEFAULT_DATA)
    logdir, loaded, now = tmp_path / "old", tmp_path / "loaded", tmp_path / "now"
    for d in (logdir, loaded, now):
        d.mkdir()
    for d in (logdir, loaded):
        shutil.copy(OLD, d / "ckpt-00000010.npz")
    with Trainer(Config(**cfg, steps=20, logdir=str(logdir), resume=True)) as t:
        t.fit()
    with Trainer(Config(**cfg, steps=10, logdir=str(loaded), resume=True)) as t:
        t.fit()  # resumes at step 10 and takes no step
        Checkpointer(str(now), keep=1).write(t.step, t.state_dict())
        ran = t.cpu_kernels
    with np.load(OLD) as before, np.load(now / "ckpt-00000010.npz") as written:
        # Metadata keys that came later: what ran the CPU towers' fused kernels (the old file ran
        # NumPy's) and the training data's fingerprint.
        assert sorted(before.files) == sorted(set(written.files) - {"cpu_kernels", "data/fingerprint"})
        assert str(written["cpu_kernels"]) == ran
        for k in before.files:  # the state as loaded is the state as written then
            assert k == "config" or np.array_equal(before[k], written[k]), k
    with Trainer(Config(**cfg, steps=20, logdir=str(now), resume=True)) as t:
        t.fit()
    with Trainer(Config(**cfg, steps=20, logdir=str(tmp_path / "fresh"))) as t:
        t.fit()
    old, new = np.load(logdir / "final.npz"), np.load(now / "final.npz")
    fresh = np.load(tmp_path / "fresh" / "final.npz")
    assert sorted(old.files) == sorted(new.files) == sorted(fresh.files)
    for k in fresh.files:
        # The old file's first 10 EMA updates took their decay from the updates before each (TF counts the one
        # it follows too, as towers does now): its EMA stays about 2e-4 from a fresh run's.
        close = 1e-3 if k.startswith("ema/") else 1e-4
        np.testing.assert_allclose(old[k], fresh[k], rtol=0, atol=close * np.abs(fresh[k]).max(), err_msg=k)
    for k in new.files:
        assert np.array_equal(old[k], new[k]), k


# -- one Trainer, one host or several ---------------------------------------------


def test_one_hosts_placement_and_reducer_are_refused_for_several_hosts_before_ray_starts():
    for kw in ({"reducer": lambda placement, streams: None}, {"placement": object()}):
        with pytest.raises(UserError, match="each host makes its own placement and reducer"):
            Trainer(Config(**{**SMALL, "n_gpu": 1}, hosts=2), **kw)


def test_a_model_objects_run_records_that_it_was_an_object(tmp_path):
    model = Sequential([Flatten(), Dense("layer1", 8), ReLU(), Dense("layer2", 10)])
    with Trainer(Config(**SMALL, steps=2, logdir=str(tmp_path)), model=model) as t:
        assert t.cfg.model == towers.config.MODEL_OBJECT
        t.fit()
    ck = np.load(tmp_path / "ckpt-00000002.npz")
    assert '"model": "<model object>"' in str(ck["config"])


def bn_model(input_shape, num_classes):
    return [Flatten(), Dense("layer1", 16), towers.BatchNorm("bn1"), ReLU(), Dense("layer2", num_classes)]


@pytest.mark.parametrize("cpu_towers", ["threads", "serial"])
def test_sync_bn_towers_through_the_engine_train_like_one_tower_with_their_whole_batch(cpu_towers):
    base = dict(devices="cpu", model="tests.test_state:bn_model", summary_every=0, quiet=True, momentum=0.9)
    two = Trainer(Config(**base, n_gpu=2, batch_size=20, sync_bn=True, cpu_towers=cpu_towers))
    one = Trainer(Config(**base, n_gpu=1, batch_size=40))
    with two, one:
        for _ in range(5):
            x, y = one.source.next_batch()
            one.train_step(x, y)
            two.train_step(x, y)
        a, b = one.get_weights(), two.get_weights()
        assert "bn1/moving_mean" in a
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=2e-4, atol=2e-6, err_msg=k)
