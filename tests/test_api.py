"""The Python API: Config, Trainer, Dataset, weights and state as name -> array dicts."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_info

import towers
from tests.conftest import DIGITS, run_cli
from towers import BatchNorm, Config, Dataset, Dense, Flatten, ReLU, Trainer, TrainingError, UserError

SMALL = dict(n_gpu=2, devices="cpu", hidden=16, batch_size=50, quiet=True, summary_every=0)


def digits():
    with np.load(DIGITS) as z:
        return {k: z[k] for k in z.files}


def test_public_names():
    for name in ("Config", "Trainer", "Dataset", "Sequential", "Dense", "ReLU", "Flatten", "Conv2D",
                 "MaxPool2D", "UserError", "TrainingError"):
        assert hasattr(towers, name), name
    assert issubclass(UserError, ValueError)


def test_cli_and_api_write_byte_identical_final_npz(tmp_path):
    res = run_cli("--n-gpu", "2", "--devices", "cpu", "--hidden", "16", "--batch-size", "50", "--steps", "30",
                  "--momentum", "0.9", "--quiet", "--summary-every", "0", "--logdir", str(tmp_path / "cli"))
    assert res.returncode == 0, res.stderr
    with Trainer(Config(**SMALL, steps=30, momentum=0.9, logdir=str(tmp_path / "api"))) as tr:
        metrics = tr.fit()
    assert metrics["step"] == 30 and metrics["test_accuracy_ema"] > 0.5
    assert (tmp_path / "cli" / "final.npz").read_bytes() == (tmp_path / "api" / "final.npz").read_bytes()


def test_get_set_weights_round_trip_and_identical_replicas():
    with Trainer(Config(**SMALL)) as tr:
        w = tr.get_weights()
        assert set(w) == {"layer1/weights", "layer1/biases", "layer2/weights", "layer2/biases"}
        assert all(a.dtype == np.float32 for a in w.values())
        assert w["layer1/weights"].shape == (64, 16)
        new = {k: np.full_like(v, 0.25) + np.arange(v.size, dtype=np.float32).reshape(v.shape) * 1e-3
               for k, v in w.items()}
        tr.set_weights(new)
        got = tr.get_weights()
        for k in new:
            assert np.array_equal(got[k], new[k]), k
        assert tr.check_replicas()  # every replica holds them, bit for bit
        tr.set_weights({k: v * 2 for k, v in new.items()}, ema=True)
        assert np.array_equal(tr.get_weights(ema=True)["layer2/biases"], new["layer2/biases"] * 2)
        assert np.array_equal(tr.get_weights()["layer2/biases"], new["layer2/biases"])  # EMA only
        got["layer1/weights"][...] = 9  # host copies: changing them changes nothing
        assert not np.array_equal(tr.get_weights()["layer1/weights"], got["layer1/weights"])


@pytest.mark.parametrize("change, needle", [
    (lambda w: w.pop("layer2/biases"), "'layer2/biases' is missing"),
    (lambda w: w.update({"layer3/weights": np.zeros(3, np.float32)}), "'layer3/weights' is not a weight"),
    (lambda w: w.update({"layer1/weights": np.zeros((16, 64), np.float32)}), "'layer1/weights' has shape (16, 64)"),
])
def test_set_weights_rejects_bad_names_and_changes_nothing(change, needle):
    with Trainer(Config(**SMALL)) as tr:
        before = tr.get_weights()
        bad = {k: v + 1 for k, v in before.items()}
        change(bad)
        with pytest.raises(UserError) as e:
            tr.set_weights(bad)
        assert needle in str(e.value)
        after = tr.get_weights()
        assert all(np.array_equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kw, needle", [
    (dict(sync="wieghts"), "sync 'wieghts' is unknown"),
    (dict(lr=float("nan")), "lr must be a finite number"),
    (dict(l2=float("inf")), "l2 must be a finite number"),
    (dict(optimizer="adagrad"), "optimizer 'adagrad' is unknown"),
    (dict(optimizer="adam", momentum=0.9), "momentum is for optimizer sgd"),
    (dict(batch_size=0), "batch_size must be an integer >= 1"),
    (dict(average_every=3), "average_every applies to sync weights"),
])
def test_invalid_settings_fail_before_any_allocation(kw, needle):
    # 10**9 hidden units would need 256 GB: a check made after allocating
    # would fail with MemoryError (or take the machine down), not UserError.
    with pytest.raises(UserError) as e:
        Trainer(Config(**{**SMALL, "hidden": 10**9, **kw}))
    assert needle in str(e.value)


def test_global_batch_larger_than_data_fails_before_allocation():
    with pytest.raises(UserError, match="larger than the dataset"):
        Trainer(Config(**{**SMALL, "hidden": 10**9, "batch_size": 5000}))


def test_model_object_and_in_memory_arrays_match_the_built_in_model():
    d = digits()
    ds = Dataset.from_arrays(d["x"], d["y"], d["x_test"], d["y_test"])
    layers = [Flatten(), Dense("layer1", 16), ReLU(), Dense("layer2", 10)]
    results = []
    for kw in (dict(model=layers, dataset=ds), {}):
        with Trainer(Config(**SMALL), **kw) as tr:
            for _ in range(15):
                tr.train_step(*tr.source.next_batch())
            results.append((tr.get_weights(), tr.evaluate(ema=False)))
    (w_obj, ev_obj), (w_cfg, ev_cfg) = results
    for k in w_cfg:
        assert np.array_equal(w_obj[k], w_cfg[k]), k
    assert ev_obj == ev_cfg and ev_obj["accuracy"] > 0.5


def test_dataset_from_arrays_is_validated_like_a_file():
    d = digits()
    with pytest.raises(UserError, match="negative label"):
        Dataset.from_arrays(d["x"], -d["y"] - 1)
    with pytest.raises(UserError, match="examples but"):
        Dataset.from_arrays(d["x"], d["y"][:-1])
    with pytest.raises(UserError, match="test label 10 is out of range"):
        Dataset.from_arrays(d["x"], d["y"] % 5 * 2 + 0, d["x_test"], d["y_test"] * 0 + 10)
    with pytest.raises(UserError, match="towers.Dataset"):
        Trainer(Config(**SMALL), dataset=(d["x"], d["y"]))
    with pytest.raises(UserError, match="not a towers.Sequential"):
        Trainer(Config(**SMALL), model={"layer1": 16})


def test_state_dict_round_trip_continues_exactly():
    cfg = Config(**SMALL, optimizer="adam")
    with Trainer(cfg) as a:
        for _ in range(7):
            a.train_step(*a.source.next_batch())
        state = a.state_dict()
        for _ in range(5):
            a.train_step(*a.source.next_batch())
        want = a.get_weights()
    assert {"params/layer1/weights", "ema/layer1/weights", "adam_m/layer1/weights", "adam_v/layer1/weights",
            "step", "data/epoch", "data/index", "config"} <= set(state)
    with Trainer(cfg) as b:
        b.load_state_dict(state)
        assert b.step == 7
        for _ in range(5):
            b.train_step(*b.source.next_batch())
        got = b.get_weights()
        assert all(np.array_equal(got[k], want[k]) for k in want)
        with pytest.raises(UserError, match="'extra/thing' is not part of a towers state dict"):
            b.load_state_dict({**state, "extra/thing": np.zeros(1)})
        with pytest.raises(UserError, match="'layer2/biases' is missing"):
            b.load_state_dict({k: v for k, v in state.items() if k != "ema/layer2/biases"})


def test_resume_with_adam_is_byte_identical(tmp_path):
    common = ["--n-gpu", "2", "--devices", "cpu", "--optimizer", "adam", "--hidden", "16", "--batch-size", "50",
              "--checkpoint-every", "7", "--quiet", "--summary-every", "0"]
    for args in (["--steps", "30", "--logdir", str(tmp_path / "whole")],
                 ["--steps", "14", "--logdir", str(tmp_path / "split")],
                 ["--steps", "30", "--resume", "--logdir", str(tmp_path / "split")]):
        res = run_cli(*common, *args)
        assert res.returncode == 0, res.stderr
    whole, split = ((tmp_path / d / "final.npz").read_bytes() for d in ("whole", "split"))
    assert whole == split


def test_model_defaults_and_what_overrides_them(tmp_path):
    assert (Config(model="lenet5").resolved().optimizer, Config(model="lenet5").resolved().lr) == ("adam", 0.001)
    sgd = Config(model="lenet5", optimizer="sgd").resolved()
    assert (sgd.lr, sgd.momentum) == (0.01, 0.9)
    assert Config(optimizer="adam").resolved().lr == 0.001  # Adam's own default, not the MLP's 0.8
    mlp = Config().resolved()
    assert (mlp.optimizer, mlp.lr, mlp.lr_decay, mlp.momentum) == ("sgd", 0.8, 0.99, 0.0)
    assert Config(model="lenet5", lr=0.003).resolved().lr == 0.003
    res = run_cli("--devices", "cpu", "--optimizer", "adam", "--steps", "3", "--hidden", "8", "--quiet",
                  "--summary-every", "0", "--logdir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[0]
    assert first.startswith("settings:") and "optimizer adam" in first and "lr 0.001" in first


def _towers_threads():
    return [t for t in threading.enumerate() if t.name.startswith("towers-cpu")]


def test_leaving_the_with_block_releases_threads_and_blas_limits_even_after_an_error():
    blas_before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    with pytest.raises(RuntimeError, match="boom"):
        with Trainer(Config(**SMALL, blas_threads=1)) as tr:
            tr.train_step(*tr.source.next_batch())
            assert _towers_threads()
            raise RuntimeError("boom")
    assert not _towers_threads()
    assert [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"] == blas_before


@pytest.mark.parametrize("kw, needle", [
    (dict(seed=-1), "seed must be an integer >= 0"),
    (dict(logdir=""), "logdir must be a non-empty string"),
    (dict(devices=[0, 1]), "devices must be a non-empty string"),
    (dict(resume="no"), "resume must be True or False"),
])
def test_more_settings_are_checked(kw, needle):
    with pytest.raises(UserError, match=needle):
        Trainer(Config(**{**SMALL, **kw}))


def test_numpy_scalars_are_accepted_and_the_users_config_is_left_alone():
    cfg = Config(**SMALL, steps=np.int64(5), lr=np.float32(0.5))
    with Trainer(cfg) as tr:
        assert (tr.cfg.steps, type(tr.cfg.steps)) == (5, int) and type(tr.cfg.lr) is float
    assert type(cfg.steps) is np.int64  # resolved() checks a copy
    with pytest.raises(UserError, match="must be a towers.Config"):
        Trainer(dict(SMALL))


def test_train_step_and_set_weights_refuse_what_would_train_wrong():
    with Trainer(Config(**SMALL)) as tr:
        x, y = tr.source.next_batch()
        for bad_y, needle in ((y - y - 1, "labels must be integers 0..9"), (y + 99, "from 99"),
                              (y.astype(np.float32), "labels must be integers")):
            with pytest.raises(UserError, match=needle):
                tr.train_step(x, bad_y)
        with pytest.raises(UserError, match="examples are"):
            tr.train_step(x.reshape(len(x), -1)[:, :10], y)
        with pytest.raises(UserError, match="100 examples and 100 labels.*got 100 and 50"):
            tr.train_step(x, y[:50])
        w = tr.get_weights()
        with pytest.raises(UserError, match="give a dict"):
            tr.set_weights(list(w.values()))
        with pytest.raises(UserError, match="holds NaN or inf"):
            tr.set_weights({**w, "layer1/biases": np.full(16, np.nan, np.float32)})
        with pytest.raises(UserError, match="give real numbers"):
            tr.set_weights({**w, "layer1/biases": np.zeros(16, np.complex64)})
        assert all(np.array_equal(tr.get_weights()[k], w[k]) for k in w)  # nothing changed
    with pytest.raises(UserError, match="closed"):
        tr.train_step(x, y)


def test_set_weights_refuses_values_beyond_float32_and_a_negative_moving_variance():
    """float64 weights past float32's range would become inf; a negative variance makes evaluation's loss NaN."""
    layers = [Flatten(), Dense("layer1", 16), BatchNorm("bn"), ReLU(), Dense("layer2", 10)]
    with Trainer(Config(**SMALL), model=layers) as tr:
        w = tr.get_weights()
        big = w["layer1/weights"].astype(np.float64)
        big[2, 3] = -1e39
        with pytest.raises(UserError, match=r"'layer1/weights' holds -1e\+39 at flat index 35, beyond float32's"):
            tr.set_weights({**w, "layer1/weights": big})
        with pytest.raises(UserError, match="beyond float32's range"):
            tr.set_weights({**w, "layer1/weights": big}, ema=True)
        var = w["bn/moving_variance"].copy()
        var[4] = -0.5
        with pytest.raises(UserError, match=r"'bn/moving_variance' holds -0.5 at flat index 4, below its least "
                                            r"value 0; give values >= 0"):
            tr.set_weights({**w, "bn/moving_variance": var})
        assert all(np.array_equal(tr.get_weights()[k], w[k]) for k in w)  # nothing changed
        tr.set_weights({**w, "layer1/weights": big.clip(-1, 1), "bn/moving_variance": var.clip(0)})  # in range


def test_train_step_takes_lists_as_it_did_before_its_checks():
    weights = []
    for as_list in (False, True):
        with Trainer(Config(**SMALL)) as tr:
            x, y = tr.source.next_batch()
            tr.train_step(list(x) if as_list else x, y.tolist() if as_list else y)
            weights.append(tr.get_weights())
    assert all(np.array_equal(weights[0][k], weights[1][k]) for k in weights[0])
    with Trainer(Config(**SMALL)) as tr:
        start = tr.get_weights()
    assert any(not np.array_equal(weights[0][k], start[k]) for k in start)  # the step did train


def test_the_loss_a_step_reports_is_the_data_loss_without_the_l2_term():
    # It included l2 * sum(w**2) / 2: a run at 100% accuracy logged loss = 104.04 (log lines, metrics, TensorBoard).
    with Trainer(Config(**SMALL, l2=0.5)) as tr:
        x, y = tr.source.next_batch()
        want = tr.evaluate(ema=False, x=x, y=y)["loss"]  # the mean cross-entropy of these weights on the batch
        l2_term = 0.5 * sum(float((w ** 2).sum()) for k, w in tr.get_weights().items() if k.endswith("weights")) / 2
        assert l2_term > 1  # large beside the data loss: the check below tells them apart
        got = np.mean([float(v) for v in tr.train_step(x, y, want_loss=True)])
        assert got == pytest.approx(want, rel=1e-5)


# -- strict inputs and honest figures (reliability, second round) ---------------------------------


@pytest.mark.parametrize("x, y, message", [
    (lambda d: d["x_test"][:5], lambda d: np.array([0, 1, -1, 2, 3]), "labels must be integers 0..9"),
    (lambda d: d["x_test"][:5], lambda d: np.array([0, 1, 10, 2, 3]), "labels must be integers 0..9"),
    (lambda d: d["x_test"][:5], lambda d: np.zeros(5, np.float32), "labels must be integers"),
    (lambda d: d["x_test"][:5].reshape(5, -1)[:, :10], lambda d: d["y_test"][:5], r"examples are .* \(10,\)"),
    (lambda d: d["x_test"][:5], lambda d: d["y_test"][:4], "as many labels as examples"),
    (lambda d: d["x_test"][:0], lambda d: d["y_test"][:0], "at least one"),
    # float pixels beside uint8 training pixels were not scaled by 1/255 (loss 38.8 instead of 1.41)
    (lambda d: d["x_test"][:5].astype(np.float32), lambda d: d["y_test"][:5],
     "test examples are float32 but training examples uint8: uint8 pixels are scaled by 1/255"),
    (lambda d: d["x_test"][:5], lambda d: None, "give both x and y"),  # was a bare TypeError
    (lambda d: None, lambda d: d["y_test"][:5], "give both x and y"),
])
def test_evaluate_checks_its_examples_as_train_step_does(x, y, message):
    d = digits()
    with Trainer(Config(**SMALL)) as tr:
        with pytest.raises(UserError, match=message):
            tr.evaluate(x=x(d), y=y(d))
        ok = tr.evaluate(x=d["x_test"][:5], y=d["y_test"][:5])
        assert 0.0 <= ok["accuracy"] <= 1.0


def test_evaluate_refuses_non_finite_examples_and_names_diverged_weights():
    d = digits()
    scaled = {k: d[k].astype(np.float32) / 255 if k.startswith("x") else d[k] for k in d}
    ds = Dataset.from_arrays(scaled["x"], scaled["y"], scaled["x_test"], scaled["y_test"])
    with Trainer(Config(**SMALL), dataset=ds) as tr:
        x = scaled["x_test"][:10].copy()
        x[3, 2, 1] = np.nan  # it gave accuracy 1.0 for labels 0: NaN logits argmax to class 0
        with pytest.raises(UserError, match=r"evaluate: key 'x' has 1 non-finite value \(NaN or inf\); the first in "
                                            r"example 3"):
            tr.evaluate(x=x, y=np.zeros(10, np.int64))
        # float64 examples are the loader's float32 ones: the same figures
        same = tr.evaluate(x=scaled["x_test"].astype(np.float64), y=scaled["y_test"])
        assert same == tr.evaluate()
    with Trainer(Config(**SMALL, lr=1e6), dataset=ds) as tr:
        tr.run_steps(20)  # diverges: the weights hold NaN
        for ema in (False, True):  # it said 'loss nan' beside an accuracy of 10%
            with pytest.raises(TrainingError, match=f"evaluate: the {'EMA' if ema else 'raw'} weights hold NaN or "
                                                    r"inf \('layer1/weights'\): training diverged"):
                tr.evaluate(ema=ema)


def test_run_steps_takes_a_count_of_steps_and_nothing_else():
    # int() took 2.5 and '2' as 2 and max() made -1 none; None was a bare TypeError.
    with Trainer(Config(**SMALL)) as tr:
        for bad in (2.5, 2.0, "2", -1, None, True):
            with pytest.raises(UserError, match=r"run_steps: n must be an integer >= 0, got "):
                tr.run_steps(bad)
        assert tr.step == 0  # no step was taken
        tr.run_steps(np.int64(2))
        tr.run_steps(0)
        assert tr.step == 2


def test_fit_refuses_a_plain_callable_as_an_extension_before_writing_anything(tmp_path):
    with Trainer(Config(**SMALL, steps=3, logdir=str(tmp_path / "run"))) as tr:
        with pytest.raises(UserError, match="not a towers.Extension"):
            tr.fit(extensions=[lambda run: None])
    assert not (tmp_path / "run").exists()


def test_fit_after_close_writes_nothing(tmp_path):
    tr = Trainer(Config(**SMALL, steps=3, logdir=str(tmp_path / "run")))
    tr.close()
    with pytest.raises(UserError, match="closed"):
        tr.fit()
    assert not (tmp_path / "run").exists()


def test_default_logdirs_are_unique_for_runs_in_the_same_second(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    made = []
    for _ in range(3):  # quick fit()s: all within a second or two
        with Trainer(Config(**SMALL, steps=1, checkpoint_every=0)) as tr:
            tr.fit()
        made = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(made) == 3 and all((tmp_path / "runs" / m / "final.npz").exists() for m in made)


def test_a_resumed_runs_figures_count_its_own_steps(tmp_path):
    common = ["--n-gpu", "2", "--devices", "cpu", "--hidden", "16", "--batch-size", "50", "--quiet",
              "--summary-every", "0", "--logdir", str(tmp_path / "a")]
    assert run_cli(*common, "--steps", "40").returncode == 0
    res = run_cli(*common, "--steps", "60", "--resume")
    assert res.returncode == 0, res.stderr
    done = [ln for ln in res.stdout.splitlines() if ln.startswith("done:")][0]
    assert done.startswith("done: 20 steps (to step 60)") and "1.00 all-reduces/step" in done, done


def test_a_closed_trainer_refuses_finish_and_check_replicas_as_on_a_cluster():
    tr = Trainer(Config(devices="cpu", n_gpu=2, hidden=8, batch_size=10, steps=2))
    tr.close()
    tr.synchronize()  # nothing to wait for
    for call in (tr.finish, tr.check_replicas):
        with pytest.raises(UserError, match="closed"):
            call()


def test_the_trainer_forwards_named_methods_only():
    """No fallthrough to the executor: its parts are ``tr.executor``'s, and what the Trainer forwards it names
    (``source``, ``cpu_kernels``, ``train_step_at`` among them)."""
    with Trainer(Config(devices="cpu", hidden=8, batch_size=10, steps=2)) as tr:
        for part in ("replicas", "engine", "ema", "towers", "reducer", "rows"):
            with pytest.raises(AttributeError, match=f"'Trainer' object has no attribute '{part}'"):
                getattr(tr, part)
            getattr(tr.executor, part)
        assert tr.source is tr.executor.source and tr.cpu_kernels == tr.executor.cpu_kernels == "numpy"
        tr.train_step_at(np.arange(10))
        assert tr.step == 1


class _DeviceArray:
    """An array in GPU memory as the API sees one: NumPy's interface plus CUDA's (CuPy arrays have both)."""

    def __init__(self, a):
        self.a = np.asarray(a)
        self.dtype, self.shape = self.a.dtype, self.a.shape
        self.__cuda_array_interface__ = {"shape": self.a.shape, "typestr": self.a.dtype.str, "data": (0, False),
                                         "version": 3}

    def __len__(self):
        return len(self.a)


def test_device_arrays_given_to_the_api_are_one_user_error():
    """train_step, train_step_at, evaluate, set_weights and load_state_dict take host arrays: a CuPy array is one
    line saying so (it was a TypeError from deep inside NumPy or CuPy)."""
    with Trainer(Config(devices="cpu", n_gpu=2, hidden=16, batch_size=10), dataset=towers.load_dataset(str(DIGITS))) as tr:
        x, y = tr.dataset.x[:20], tr.dataset.y[:20]
        for call in (lambda: tr.train_step(_DeviceArray(x), y), lambda: tr.train_step(x, _DeviceArray(y)),
                     lambda: tr.train_step_at(_DeviceArray(np.arange(20))),
                     lambda: tr.evaluate(x=_DeviceArray(x), y=y)):
            with pytest.raises(UserError, match="in GPU memory; give a host"):
                call()
        w = tr.get_weights()
        name = next(iter(w))
        with pytest.raises(UserError, match=f"{name}.*in GPU memory"):
            tr.set_weights({**w, name: _DeviceArray(w[name])})
        state = tr.state_dict()
        with pytest.raises(UserError, match="in GPU memory"):
            tr.load_state_dict({**state, "params/" + name: _DeviceArray(w[name])})


def test_train_step_at_checks_its_row_numbers_without_the_data_on_a_device():
    with Trainer(Config(devices="cpu", n_gpu=2, hidden=16, batch_size=10), dataset=towers.load_dataset(str(DIGITS))) as tr:
        n = len(tr.dataset.x)
        for bad in (np.arange(19), np.full(20, n), np.full(20, -1), np.zeros(20, np.float32)):
            with pytest.raises(UserError, match="train_step_at takes one global batch of 20 row numbers"):
                tr.train_step_at(bad)
        tr.train_step_at(np.arange(20))
