"""--precision bf16/fp16 and --allreduce-dtype bf16 on the CPU: the rounding op, fp16's loss scaling (skip, growth,
checkpoint, resume), accuracy against float32, and the bf16 all-reduce's mean."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import DIGITS, run_cli
from towers import Config, Dataset, Trainer, UserError
from towers.data.batches import BatchSource
from towers.data.dataset import input_scale
from towers.data.loading import load_dataset
from towers.nn.models import build_model
from towers.nn.replica import Replica
from towers.ops.precision import round_bf16, round_to
from towers.optim.loss_scale import INITIAL

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is the bf16 reference (pip install ml_dtypes)")

SMALL = dict(n_gpu=2, devices="cpu", hidden=16, batch_size=40, quiet=True, summary_every=0)


def special_bits() -> np.ndarray:
    """float32 bit patterns where a rounding goes wrong first: zeros, NaNs (payloads high and low, both signs,
    signalling and quiet), infinities, float32 and bf16/fp16 subnormals, exact ties to even and odd, just
    around ties, the largest finite values (which round to inf), fp16's overflow edge, and random bits."""
    s = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,
         0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF, 0x00000001, 0x80000001, 0x00007FFF, 0x00008000,
         0x00008001, 0x00018000, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,
         0x7F7EFFFF, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x3F800000, 0xBF808000, 0xBF818000]
    for v in (65504.0, 65519.99, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-14, 6.1e-5,
              1 + 2.0**-11, 1 + 3 * 2.0**-11, 1e-8, 3e38):
        s += [int(np.float32(v).view(np.uint32)), int(np.float32(-v).view(np.uint32))]
    rng = np.random.default_rng(37)
    return np.concatenate([np.array(s, np.uint32), rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32),
                           np.arange(0, 1 << 17, 7, dtype=np.uint32)])


def reference(x: np.ndarray, precision: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(ml_dtypes.bfloat16 if precision == "bf16" else np.float16).astype(np.float32)


def same_rounding(got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit, except that a NaN need only be a NaN (its payload is the format's business)."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    mismatch = np.flatnonzero(got[~nan].view(np.uint32) != want[~nan].view(np.uint32))
    assert mismatch.size == 0, [hex(int(b)) for b in got[~nan].view(np.uint32)[mismatch[:5]]]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_rounding_matches_the_reference_on_special_values(precision):
    x = special_bits().view(np.float32)
    y = x.copy()
    round_to(y, precision)
    same_rounding(y, reference(x, precision))
    z = x.copy()[::-1][::2]  # a strided view: the same rounding through a copy
    zx = z.copy()
    round_to(z, precision)
    same_rounding(z, reference(zx, precision))
    y2 = y.copy()
    round_to(y2, precision)  # rounding twice changes nothing (what a layer's view of its input relies on)
    assert np.array_equal(y2.view(np.uint32), y.view(np.uint32))


def test_bf16_keeps_nan_a_nan_and_rounds_ties_to_even():
    x = np.array([0x7F800001, 0xFFFFFFFF, 0x3F808000, 0x3F818000, 0x7F7FFFFF], np.uint32).view(np.float32)
    round_bf16(np, x)
    assert np.isnan(x[:2]).all()
    assert x[2] == 1.0 and x[3] == np.float32(1 + 2.0**-6)  # a tie to the even neighbour, down and up
    assert np.isinf(x[4])
    with pytest.raises(ValueError):
        round_to(np.zeros(3, np.float64), "bf16")


def test_low_precision_replica_rounds_what_a_gpu_holds_in_low_precision():
    """One training step of a replica in bf16: its weight copy, activations and parameter gradients are bf16
    values, the float32 masters are untouched, and the gradient is close to float32's but not the same."""
    model = build_model("mlp", (8, 8), 10, hidden=32)
    d = load_dataset(str(DIGITS))
    x = d.x[:64].astype(np.float32) / 255
    y = d.y[:64]
    init = model.init_params(0)
    grads = {}
    for p in ("fp32", "bf16"):
        r = Replica(model, np, precision=p)
        r.set_params(init)
        r.loss_and_grads(x, y, 0.0)
        grads[p] = r.grads.copy()
        assert np.array_equal(r.params, init)  # the masters
    low = grads["bf16"].copy()
    round_to(low, "bf16")
    assert np.array_equal(low, grads["bf16"])  # the gradients are bf16 values
    assert not np.array_equal(grads["bf16"], grads["fp32"])
    rel = np.linalg.norm(grads["bf16"] - grads["fp32"]) / np.linalg.norm(grads["fp32"])
    assert rel < 0.05, rel


# -- fp16's loss scaling --------------------------------------------------------------------------


def float_digits():
    """The digits as float32 in [0, 1]: a batch can then hold a value float16 cannot (a tower's overflow)."""
    with np.load(DIGITS) as z:
        return z["x"].astype(np.float32) / 255, z["y"]


def state(tr):
    s = tr.state_dict()
    return s, {k: np.asarray(v).copy() for k, v in s.items() if k.startswith(("params/", "ema/", "momentum/"))}


def test_fp16_skips_a_step_whose_averaged_gradient_overflowed_and_halves_the_scale():
    x, y = float_digits()
    cfg = Config(**SMALL, precision="fp16", momentum=0.9)
    with Trainer(cfg, dataset=Dataset.from_arrays(x, y)) as tr:
        b = cfg.batch_size
        tr.train_step(x[: 2 * b], y[: 2 * b])  # a clean step: momentum and EMA are not zero any more
        s0, before = state(tr)
        assert float(s0["loss_scale/scale"]) == INITIAL and int(s0["loss_scale/skipped"]) == 0
        bad = x[2 * b: 4 * b].copy()
        bad[b + 3, 2, 2] = 7e4  # one example of tower 1 only: float16 overflows there, so its gradient does
        tr.train_step(bad, y[2 * b: 4 * b])
        s1, after = state(tr)
        for k, v in before.items():  # weights, momentum slots and EMA untouched
            assert np.array_equal(v, after[k]), k
        assert float(s1["loss_scale/scale"]) == INITIAL / 2
        assert int(s1["loss_scale/skipped"]) == 1 and int(s1["loss_scale/clean_steps"]) == 0
        assert tr.step == 2  # a skipped step still counts (towers.optim.loss_scale)
        assert tr.check_replicas()
        tr.train_step(x[4 * b: 6 * b], y[4 * b: 6 * b])  # clean again: it updates
        s2, later = state(tr)
        assert not np.array_equal(later["params/layer1/weights"], after["params/layer1/weights"])
        assert int(s2["loss_scale/clean_steps"]) == 1 and float(s2["loss_scale/scale"]) == INITIAL / 2


@pytest.mark.parametrize("n", [2, 3])  # the two-tower mean is one op; three gather into a leader
def test_fp16_overflow_across_towers_warns_nothing(n, recwarn):
    """Gradients that overflow to +inf on one tower and -inf on another make the mean NaN: a skipped step,
    counted and reported by towers, not NumPy's "invalid value encountered in add" on stderr."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((300, 8, 8)) * 3e3).astype(np.float32)
    y = rng.integers(0, 10, 300)
    cfg = Config(**{**SMALL, "n_gpu": n, "batch_size": 20}, precision="fp16", cpu_kernels="numpy")
    with Trainer(cfg, dataset=Dataset.from_arrays(x, y, x[:50], y[:50])) as tr:
        for _ in range(3):
            tr.train_step(*tr.source.next_batch())
        assert int(tr.state_dict()["loss_scale/skipped"]) == 3
    assert not [str(w.message) for w in recwarn.list if issubclass(w.category, RuntimeWarning)]


def test_fp16_scale_doubles_after_n_clean_steps_and_unscales_exactly():
    x, y = float_digits()
    cfg = Config(**SMALL, precision="fp16", loss_scale_growth=3)
    with Trainer(cfg, dataset=Dataset.from_arrays(x, y)) as tr:
        src = BatchSource(tr.dataset, 2 * cfg.batch_size, 0)
        scales = []
        for _ in range(7):
            tr.train_step(*src.next_batch())
            s = tr.state_dict()
            scales.append((float(s["loss_scale/scale"]), int(s["loss_scale/clean_steps"])))
        assert scales == [(INITIAL, 1), (INITIAL, 2), (2 * INITIAL, 0), (2 * INITIAL, 1), (2 * INITIAL, 2),
                          (4 * INITIAL, 0), (4 * INITIAL, 1)]
        assert int(s["loss_scale/skipped"]) == 0
        # The gradient the update used is the unscaled one: the size of a float32 step's, not 2**16 times it.
        g = tr.get_gradients()["layer1/weights"]
        assert 1e-6 < np.abs(g).max() < 10


def test_fp16_checkpoint_round_trip_and_resume_is_exact(tmp_path):
    """2N steps in one run equal N steps, then a resume to 2N, bit for bit (the scale changes in both halves)."""
    kw = dict(**SMALL, precision="fp16", loss_scale_growth=3, checkpoint_every=5)
    with Trainer(Config(**kw, steps=10, logdir=str(tmp_path / "whole"))) as tr:
        tr.fit()
        whole = tr.state_dict()
    with Trainer(Config(**kw, steps=5, logdir=str(tmp_path / "half"))) as tr:
        tr.fit()
        half = tr.state_dict()
    assert float(half["loss_scale/scale"]) == 2 * INITIAL and int(half["loss_scale/clean_steps"]) == 2
    with Trainer(Config(**kw, steps=10, logdir=str(tmp_path / "half"), resume=True)) as tr:
        tr.fit()
        resumed = tr.state_dict()
    assert float(whole["loss_scale/scale"]) == 8 * INITIAL
    for k, v in whole.items():
        if k != "config":
            assert np.array_equal(np.asarray(v), np.asarray(resumed[k])), k
    assert (tmp_path / "whole" / "final.npz").read_bytes() == (tmp_path / "half" / "final.npz").read_bytes()


def test_loss_scale_state_loads_strictly_and_old_checkpoints_start_at_the_initial_scale():
    with Trainer(Config(**SMALL, precision="fp16", loss_scale_growth=2)) as tr:
        for _ in range(3):
            tr.train_step(*BatchSource(tr.dataset, 80, 0).next_batch())
        s = tr.state_dict()
        assert float(s["loss_scale/scale"]) == 2 * INITIAL
        with pytest.raises(UserError, match="'loss_scale/scal' is not a loss-scale key"):
            tr.load_state_dict({**s, "loss_scale/scal": np.float64(1)})
        with pytest.raises(UserError, match="'loss_scale/scale' must be a power of two"):
            tr.load_state_dict({**s, "loss_scale/scale": np.float64(3)})
        with pytest.raises(UserError, match="'loss_scale/skipped' is missing"):
            tr.load_state_dict({k: v for k, v in s.items() if k != "loss_scale/skipped"})
        assert float(tr.state_dict()["loss_scale/scale"]) == 2 * INITIAL  # nothing changed
        tr.load_state_dict({k: v for k, v in s.items() if not k.startswith("loss_scale/")})  # an old checkpoint
        s2 = tr.state_dict()
        assert float(s2["loss_scale/scale"]) == INITIAL and int(s2["loss_scale/clean_steps"]) == 0
        tr.load_state_dict(s)
        assert float(tr.state_dict()["loss_scale/scale"]) == 2 * INITIAL
    with Trainer(Config(**SMALL)) as fp32:  # an fp32 run writes no loss-scale keys, and reads fp16's
        assert not any(k.startswith("loss_scale/") for k in fp32.state_dict())
        fp32.load_state_dict(s)


# -- accuracy ---------------------------------------------------------------------------------------

#: Test accuracy on the digits' 359 test examples after ACCURACY_STEPS steps of the default MLP (2 towers x 100,
#: sgd lr 0.8): bf16 and fp16 must end within this many points of float32 (measured: 0.9387 raw in all three; EMA 0.9526 fp32,
#: 0.9499 bf16, 0.9526 fp16).
ACCURACY_MARGIN = 0.02
ACCURACY_STEPS = 60


def test_low_precision_trains_the_digits_as_well_as_float32(tmp_path):
    acc = {}
    for p in ("fp32", "bf16", "fp16"):
        with Trainer(Config(n_gpu=2, devices="cpu", steps=ACCURACY_STEPS, precision=p, quiet=True, summary_every=0,
                            logdir=str(tmp_path / p))) as tr:
            tr.fit()
            acc[p] = tr.evaluate(ema=False)["accuracy"]
            if p == "fp16":
                assert int(tr.state_dict()["loss_scale/skipped"]) == 0
    assert acc["fp32"] > 0.85, acc
    for p in ("bf16", "fp16"):
        assert abs(acc[p] - acc["fp32"]) <= ACCURACY_MARGIN, acc


# -- the bf16 all-reduce ----------------------------------------------------------------------------


def test_bf16_allreduce_averages_the_rounded_gradients_and_keeps_replicas_identical(standin):
    """Towers that keep their own weights (the NCCL stand-in): after each step every replica holds the same
    bytes, and the mean gradient is the float32 mean of each tower's gradient rounded to bf16."""
    n = 2
    cfg = Config(**{**SMALL, "n_gpu": n}, allreduce_dtype="bf16", momentum=0.9)
    ds = load_dataset(str(DIGITS))
    with Trainer(cfg, dataset=ds, reducer=standin.reducer(n)) as tr:
        for r in tr.executor.replicas:
            standin.register(r.grads)
        src = BatchSource(ds, cfg.batch_size * n, cfg.seed)
        model = tr.executor.model
        for _ in range(3):
            xb, yb = src.next_batch()
            w = tr.executor.replicas[0].params.copy()
            want = []
            for i in range(n):  # each tower's own gradient, as the tower computes it, rounded by the reference
                r = Replica(model, np)
                r.set_params(w)
                rows = slice(i * cfg.batch_size, (i + 1) * cfg.batch_size)
                r.loss_and_grads(xb[rows].astype(np.float32) * input_scale(xb.dtype), yb[rows], tr.cfg.l2)
                want.append(r.grads.astype(ml_dtypes.bfloat16).astype(np.float32))
            tr.train_step(xb, yb)
            mean = (want[0] + want[1]) * np.float32(0.5)
            got = np.concatenate([g.reshape(-1) for g in tr.get_gradients().values()])
            assert np.array_equal(got, mean)
            assert tr.check_replicas()
            assert np.array_equal(tr.executor.replicas[0].params, tr.executor.replicas[1].params)


def test_bf16_allreduce_on_cpu_towers_that_split_the_mean():
    """Plain CPU towers on threads (each reduces a slice): the gradient is a mean of bf16 values, unlike fp32's."""
    grads = {}
    for d in ("fp32", "bf16"):
        with Trainer(Config(**SMALL, allreduce_dtype=d)) as tr:
            tr.train_step(*BatchSource(tr.dataset, 80, 0).next_batch())
            grads[d] = np.concatenate([g.reshape(-1) for g in tr.get_gradients().values()])
    assert not np.array_equal(grads["fp32"], grads["bf16"])
    assert np.abs(grads["fp32"] - grads["bf16"]).max() <= 2.0**-8 * np.abs(grads["fp32"]).max()


# -- settings ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, message", [
    (dict(precision="fp8"), "precision 'fp8' is unknown: use one of fp32, bf16, fp16"),
    (dict(allreduce_dtype="fp16"), "allreduce_dtype 'fp16' is unknown"),
    (dict(precision="fp16", sync="weights"), "precision fp16 scales the loss"),
    (dict(allreduce_dtype="bf16", sync="weights"), "sync grads only"),
    (dict(precision="bf16", loss_scale_growth=10),
     "loss_scale_growth applies to precision fp16 (its loss scaling), not bf16: set precision fp16, or drop "
     "loss_scale_growth"),
    (dict(loss_scale_growth=0), "loss_scale_growth must be an integer >= 1"),
])
def test_precision_settings_are_checked(kw, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Trainer(Config(**SMALL, **kw))


def test_a_bad_precision_flag_is_one_line():
    res = run_cli("--precision", "fp8")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "--precision 'fp8' is unknown" in res.stderr
