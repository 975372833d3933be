"""numba's compiled CPU forms of the ops (``towers.ops.forms``, ``towers.ops.numba_jit``) against NumPy's passes.

Batch norm: the NumPy passes are the reference (their precision is checked
against float64 in ``tests/nn/test_sync_bn.py``); its compiled loops sum in
another order (float64 sums), so the two agree within float32 rounding, not
bit for bit.  The other ops' compiled forms give NumPy's bits.  Also: the
``cpu_kernels`` setting, numba missing or broken, its disk cache, and runs.
Skipped where numba is not installed; ``cpu_kernels`` numpy and auto then run
NumPy.
"""
from __future__ import annotations

import sys

import numpy
import pytest

from tests.conftest import cpu_form
from towers import Config
from towers.errors import UserError
from towers.nn.context import StepContext
from towers.nn.layers import Workspace
from towers.nn.normalization import BatchNorm
from towers.ops import forms, numba_jit
from towers.ops.codegen import elementwise

numba = pytest.importorskip("numba", reason="numba is not installed: the compiled CPU forms are optional")


def _bn_step(x, dy, form, scale=True, center=True, step=3):
    """One training forward and backward of a BatchNorm on ``x``; (y, dx, grads, moving stats)."""
    c = x.shape[-1]
    bn = BatchNorm("bn", scale=scale, center=center)
    bn.build(x.shape[1:])
    rng = numpy.random.default_rng(1)
    dt = x.dtype
    p = {"gamma": (1 + 0.5 * rng.standard_normal(c)).astype(dt), "beta": rng.standard_normal(c).astype(dt),
         "moving_mean": rng.standard_normal(c).astype(dt), "moving_variance": (1 + rng.random(c)).astype(dt)}
    g = {"gamma": numpy.zeros(c, dt), "beta": numpy.zeros(c, dt)}
    ctx = StepContext(step=step)
    ws = Workspace(numpy, ctx, (0,))
    with cpu_form(form):
        y = bn.forward(p, x, ws).copy()
        dx = bn.backward(p, g, dy, ws, True).copy()
    return y, dx, g, (p["moving_mean"], p["moving_variance"])


def _close(a, b, what, rtol=2e-5):
    scale = float(numpy.abs(b).max()) or 1.0
    err = float(numpy.abs(a - b).max()) / scale
    assert err <= rtol, f"{what}: max error {err:.2e} of the largest value, more than float32 rounding"


@pytest.mark.parametrize("shape", [(8, 6, 5, 16), (4, 9, 7, 3), (50, 10), (2, 3, 3, 64)])
@pytest.mark.parametrize("scale, center", [(True, True), (False, False)])
def test_compiled_batch_norm_equals_the_numpy_passes(shape, scale, center):
    rng = numpy.random.default_rng(0)
    # A large mean beside a small spread: the case the shifted moments exist for.
    x = (100 + 0.01 * rng.standard_normal(shape)).astype(numpy.float32)
    dy = rng.standard_normal(shape).astype(numpy.float32)
    want = _bn_step(x, dy, "numpy", scale, center)
    got = _bn_step(x, dy, "numba", scale, center)
    _close(got[0], want[0], "y")
    _close(got[1], want[1], "dx", rtol=5e-5)
    for k in want[2]:
        _close(got[2][k], want[2][k], f"d{k}", rtol=5e-5)
    _close(got[3][0], want[3][0], "moving mean", rtol=1e-6)
    _close(got[3][1], want[3][1], "moving variance", rtol=5e-5)


def test_compiled_batch_norm_gradient_matches_finite_differences():
    """float64 through the compiled loops: dx and dgamma, dbeta against central differences of sum(y * w)."""
    rng = numpy.random.default_rng(2)
    shape = (3, 4, 5, 6)
    x = (3 + rng.standard_normal(shape))
    w = rng.standard_normal(shape)  # the loss is sum(y * w): dy = w
    _, dx, g, _ = _bn_step(x, w, "numba")
    c = shape[-1]
    bn = BatchNorm("bn")
    bn.build(shape[1:])

    def loss(xv, gamma, beta):
        p = {"gamma": gamma, "beta": beta, "moving_mean": numpy.zeros(c), "moving_variance": numpy.ones(c)}
        with cpu_form("numba"):
            return float((bn.forward(p, xv, Workspace(numpy, StepContext(), (0,))) * w).sum())

    r = numpy.random.default_rng(1)
    gamma = (1 + 0.5 * r.standard_normal(c))
    beta = r.standard_normal(c)
    eps = 1e-6
    for idx in [(0, 0, 0, 0), (1, 2, 3, 4), (2, 3, 4, 5), (0, 1, 4, 2)]:
        xp_, xm = x.copy(), x.copy()
        xp_[idx] += eps
        xm[idx] -= eps
        fd = (loss(xp_, gamma, beta) - loss(xm, gamma, beta)) / (2 * eps)
        assert abs(fd - dx[idx]) <= 1e-6 * max(1.0, abs(fd)), (idx, fd, dx[idx])
    for j in range(c):
        for name in ("gamma", "beta"):
            plus, minus = gamma.copy(), gamma.copy()
            bp, bm = beta.copy(), beta.copy()
            if name == "gamma":
                plus[j] += eps
                minus[j] -= eps
            else:
                bp[j] += eps
                bm[j] -= eps
            fd = (loss(x, plus, bp) - loss(x, minus, bm)) / (2 * eps)
            assert abs(fd - g[name][j]) <= 1e-6 * max(1.0, abs(fd)), (name, j, fd, g[name][j])


def test_cpu_kernels_setting():
    assert not forms.available("numpy")
    assert forms.available("auto") and forms.available("numba")
    with pytest.raises(UserError, match="cpu_kernels"):
        forms.available("fast")
    with pytest.raises(UserError, match="cpu_kernels .fast. is unknown"):
        Config(cpu_kernels="fast").resolved()


def _bn_run(cpu_kernels, logdir, **kw):
    """Ten steps of a small batch-norm model on the embedded data, 2 CPU towers; the final weights."""
    import towers

    model = [towers.Flatten(), towers.Dense("fc1", 24), towers.BatchNorm("bn"), towers.ReLU(), towers.Dense("fc2", 10)]
    cfg = Config(devices="cpu", n_gpu=2, steps=10, quiet=True, summary_every=0, log_every=1000, checkpoint_every=0,
                 cpu_kernels=cpu_kernels, logdir=str(logdir), **kw)
    with towers.Trainer(cfg, model=model) as t:
        t.fit()
        return t.get_weights()


def test_the_setting_picks_the_kernels_of_a_training_run(tmp_path):
    """`cpu_kernels` numba trains through the compiled loops: near the NumPy run, and not its bits."""
    ref, got = _bn_run("numpy", tmp_path / "numpy"), _bn_run("numba", tmp_path / "numba")
    assert ref.keys() == got.keys()
    assert any(not numpy.array_equal(ref[k], got[k]) for k in ref), "numba gave NumPy's bits: not used"
    # One scale for all: fc1's biases feed a batch norm, so their gradient is rounding noise around 0.
    _close(numpy.concatenate([got[k].ravel() for k in ref]), numpy.concatenate([ref[k].ravel() for k in ref]),
           "the weights", rtol=1e-4)


@pytest.mark.parametrize("sync", ["grads", "weights"])
def test_a_conv_batch_norm_run_records_the_form_it_ran_and_its_bits_follow_it(sync, tmp_path):
    """A convolution and batch norm on 2 CPU towers, trained with `cpu_kernels` numba and numpy (in grads mode
    and in weights mode, whose average runs outside the towers): the checkpoint records the form that ran, the
    caller's thread is left without any (the forms are current in the Trainer's scopes only), and the runs end
    on other bits (batch norm's statistics round otherwise in the compiled loops), within float32 rounding."""
    import towers

    out = {}
    for kernels in ("numba", "numpy"):
        logdir = tmp_path / kernels
        cfg = Config(devices="cpu", n_gpu=2, batch_size=8, steps=4, lr=0.05, quiet=True, summary_every=0,
                     log_every=1000, checkpoint_every=0, cpu_kernels=kernels, logdir=str(logdir), sync=sync,
                     **({"average_every": 2} if sync == "weights" else {}))
        layers = [towers.Conv2D("c1", 4, 3), towers.BatchNorm("bn"), towers.ReLU(), towers.Flatten(),
                  towers.Dense("fc", 10)]
        with towers.Trainer(cfg, model=layers) as t:
            t.fit()
            assert t.executor.forms.name == kernels and forms.current() is forms.NUMPY
            out[kernels] = {**t.get_weights(), **{"ema/" + k: v for k, v in t.get_weights(ema=True).items()}}
        (last,) = logdir.glob("ckpt-*.npz")
        with numpy.load(last) as ck:
            assert str(ck["cpu_kernels"]) == kernels
    assert out["numba"].keys() == out["numpy"].keys()
    assert any(out["numba"][k].tobytes() != out["numpy"][k].tobytes() for k in out["numpy"]), "numba did not run"
    # One scale for all: c1's biases feed a batch norm, so their gradient is rounding noise around 0.
    _close(*(numpy.concatenate([out[m][k].ravel() for k in out["numpy"]]) for m in ("numba", "numpy")),
           "the weights", rtol=1e-4)


def test_without_numba_auto_is_numpy_and_numba_is_refused(monkeypatch, notices):
    monkeypatch.setattr(numba_jit, "_STATE", {})  # this process imported it already
    monkeypatch.setitem(sys.modules, "numba", None)  # hidden, as an uninstalled package is
    assert not forms.available("auto")
    assert not notices  # not installed is a choice: nothing to say
    with pytest.raises(UserError, match="numba is not installed"):
        forms.available("numba")


class _BrokenNumba:
    """A meta-path finder for which numba is installed but fails to import, as a release too old for NumPy does."""

    def find_spec(self, name, path=None, target=None):
        if name == "numba":
            raise ImportError("Numba needs NumPy 2.3 or less")
        return None


def test_a_numba_that_fails_to_import_is_named(monkeypatch, notices):
    monkeypatch.setattr(numba_jit, "_STATE", {})
    monkeypatch.delitem(sys.modules, "numba", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenNumba()] + sys.meta_path)
    assert not forms.available("auto")
    assert any("numba does not import (Numba needs NumPy 2.3 or less)" in m for m in notices)
    with pytest.raises(UserError, match="numba does not import .*pip install -U numba"):
        forms.available("numba")


def test_warm_up_loads_every_kernel_for_float32():
    """What a run choosing numba loads before its first step: every hand-written loop and every op's."""
    numba_jit.warm_up()
    kernels = {k.__name__: k for k in numba_jit.kernels()}
    assert {"col2im_loop", "maxpool_loop", "maxpool_backward_loop", "moments_loop", "center_scale_loop",
            "backward_sums_loop", "backward_dx_loop", "towers_ema", "towers_relu_backward", "towers_add_relu",
            "towers_add_scaled", "towers_mean2"} <= set(kernels), sorted(kernels)
    for op in elementwise.made():
        if op.compiled:
            assert op.loop() in numba_jit.kernels()
    for name, k in kernels.items():
        if k.warmed_up:
            assert any("float32" in str(sig) for sig in k.compiled().signatures), f"{name} is not warmed up"


@pytest.mark.parametrize("shape, stride, pad", [((2, 14, 14, 5, 5, 3), 1, (2, 2)), ((3, 4, 3, 3, 3, 4), 2, (1, 0)),
                                               ((2, 6, 6, 3, 3, 2), 1, (0, 0)), ((1, 5, 5, 5, 5, 1), 1, (2, 2))])
def test_the_compiled_col2im_has_numpys_bits(shape, stride, pad):
    """The compiled gather sums each input pixel's taps in NumPy's order (strided adds into zeros): same bits."""
    from towers.ops.im2col import col2im

    n, ho, wo, k, _, c = shape
    hw = ((ho - 1) * stride + k - 2 * pad[0], (wo - 1) * stride + k - 2 * pad[1])
    rng = numpy.random.default_rng(ho)
    dcols = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, shape)).astype(numpy.float32)
    with cpu_form("numpy"):
        ref = col2im(dcols, hw, pad, Workspace(numpy, StepContext(), (0,)), stride).copy()
    out = numpy.full((n,) + hw + (c,), numpy.nan, numpy.float32)  # every element must be written
    with cpu_form("numba"):
        got = col2im(dcols, hw, pad, Workspace(numpy, StepContext(), (0,)), stride, out)
    assert got is out and got.tobytes() == ref.tobytes()


@pytest.mark.parametrize("size, scale", [(1, 0.5), (1027, 0.5), (1027, 1 / 3), (64, 1.0)])
def test_the_compiled_mean_of_two_towers_has_numpys_bits(size, scale):
    """``(a + b) * scale`` into both in one pass: NumPy's add, scale and copy, bit for bit (specials included)."""
    from towers.ops.mean2 import mean2

    rng = numpy.random.default_rng(size)
    a = (rng.standard_normal(size) * 10.0 ** rng.integers(-40, 38, size)).astype(numpy.float32)
    b = (rng.standard_normal(size) * 10.0 ** rng.integers(-40, 38, size)).astype(numpy.float32)
    specials = numpy.array([numpy.inf, -numpy.inf, numpy.nan, -0.0, 1e-45, 3e38], numpy.float32)
    a[: min(size, 6)], b[-min(size, 6):] = specials[: min(size, 6)], specials[::-1][: min(size, 6)]
    ref_a, ref_b, got_a, got_b = a.copy(), b.copy(), a.copy(), b.copy()
    with numpy.errstate(all="ignore"), cpu_form("numpy"):
        mean2(ref_a, ref_b, scale)
    with cpu_form("numba"):
        mean2(got_a, got_b, scale)
    assert got_a.tobytes() == ref_a.tobytes() and got_b.tobytes() == ref_a.tobytes()
    assert not numpy.array_equal(got_b, b, equal_nan=True), "nothing was averaged"


def test_auto_loads_numba_for_models_it_serves():
    """``auto``: for 100k parameters or more, or a layer whose results depend on it; not for a small model alone."""
    import towers
    from towers.nn.models import build_model

    assert forms.worth_loading(build_model("mlp", (28, 28), 10, 500))  # 397,510 parameters
    assert not forms.worth_loading(build_model("mlp", (8, 8), 10, 500))  # the default digits MLP: 37,510
    small_bn = towers.Sequential([towers.Flatten(), towers.Dense("fc1", 8), towers.BatchNorm("bn"),
                                  towers.Dense("fc2", 10)]).build((8, 8))
    assert small_bn.size < forms.WORTH_PARAMS and forms.worth_loading(small_bn)
    assert forms.worth_loading(build_model("lenet5", (28, 28), 10))


def test_the_default_run_does_not_import_numba(tmp_path):
    """The default MLP (37.5 k parameters) gains less from the compiled loops than numba's start costs it."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import sys\nfrom towers.train import main\n"
            "rc = main(['--devices', 'cpu', '--n-gpu', '2', '--steps', '3', '--quiet', '--logdir', sys.argv[1]])\n"
            "assert 'numba' not in sys.modules, 'numba imported'\nsys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr


def test_without_a_writable_cache_the_kernels_are_compiled_each_run(monkeypatch, notices):
    """A read-only install and no home: numba has nowhere to cache (it raises when a kernel is defined)."""
    import numba.core.caching

    from towers.ops import batch_norm

    monkeypatch.setattr(numba_jit, "_STATE", {})
    monkeypatch.setattr(numba.core.caching.CacheImpl, "_locator_classes", [])  # no writable place found
    assert forms.available("auto")
    fresh = numba_jit.NumbaKernel(batch_norm.moments_loop.py_func)  # a new dispatcher, as a new process makes
    x = numpy.arange(8, dtype=numpy.float32).reshape(4, 2)
    shift, off, var = fresh(x)
    assert any("numba cannot cache them" in m and "NUMBA_CACHE_DIR" in m for m in notices)
    numpy.testing.assert_allclose(shift + off, x.mean(axis=0), rtol=1e-6)


def test_a_damaged_cache_is_compiled_again_with_a_notice(monkeypatch, tmp_path, notices):
    """A kernel's cached index or data file damaged on disk (numba raised UnpicklingError at the kernel's first
    call in every run until the folder was deleted): the kernel is compiled again, a notice names the folder,
    and the next process loads the rewritten cache without one."""
    import numba.core.config

    monkeypatch.setattr(numba.core.config, "CACHE_DIR", str(tmp_path))  # NUMBA_CACHE_DIR, for this test

    from towers.ops.l2 import add_scaled
    from towers.ops.mean2 import mean2

    def fresh_kernels():
        """What a new process gets: new dispatchers, which read the disk cache at their first call."""
        monkeypatch.setattr(numba_jit, "_DAMAGED", set())  # a notice a folder and process
        loop = {op.name: numba_jit.from_source(op.numba_source, "towers_" + op.name) for op in (mean2, add_scaled)}
        a, b = numpy.arange(6, dtype=numpy.float32), numpy.ones(6, numpy.float32)
        loop["mean2"](a, b, numpy.float32(0.5))
        g = numpy.ones(6, numpy.float32)
        loop["add_scaled"](g, numpy.ones(6, numpy.float32), numpy.float32(2))
        numpy.testing.assert_array_equal(a, (numpy.arange(6, dtype=numpy.float32) + 1) * numpy.float32(0.5))
        numpy.testing.assert_array_equal(g, numpy.full(6, 3, numpy.float32))

    fresh_kernels()  # compiled and cached
    files = {f.name: f for f in tmp_path.rglob("*") if f.is_file()}
    index = next(f for name, f in files.items() if ".towers_mean2-" in name and name.endswith(".nbi"))
    data = next(f for name, f in files.items() if ".towers_add_scaled-" in name and name.endswith(".nbc"))
    assert not notices
    index.write_bytes(b"garbage")  # numba: UnpicklingError
    data.write_bytes(data.read_bytes()[:40])  # cut short
    fresh_kernels()
    said = [m for m in notices if "numba's cache in" in m]
    assert len(said) == 1 and f"cache in {index.parent} does not load" in said[0], notices
    assert "compiling the kernels again" in said[0]
    notices.clear()
    fresh_kernels()  # the rewritten cache loads
    assert not notices


def _made_in_a_function():
    """A loop defined inside a function: its qualname holds ``<locals>``, which numba leaves out of its file names."""
    def add_one(a):
        for i in range(a.shape[0]):
            a[i] += numpy.float32(1)

    return add_one


def test_a_damaged_cache_of_a_loop_made_in_a_function_is_compiled_again(monkeypatch, tmp_path, notices):
    """numba names a nested loop's cache files without ``<`` and ``>`` (``...make.locals.loop-N``): the damaged
    index must be found and removed under that name, or the fresh dispatcher loads it again and every run raises.
    Another Python's files of the same loop in that folder stay."""
    import numba.core.config

    monkeypatch.setattr(numba.core.config, "CACHE_DIR", str(tmp_path))  # NUMBA_CACHE_DIR, for this test
    monkeypatch.setattr(numba_jit, "_DAMAGED", set())
    a = numpy.zeros(3, numpy.float32)
    numba_jit.NumbaKernel(_made_in_a_function())(a)  # compiled and cached
    (index,) = tmp_path.rglob("*.nbi")
    assert "locals" in index.name and "<" not in index.name
    index.write_bytes(b"garbage")  # numba: UnpicklingError
    other = index.with_name(index.name.replace(f".py{sys.version_info[0]}{sys.version_info[1]}", ".py27"))
    other.write_bytes(b"another Python's index")  # the same folder, another interpreter's cache: not ours to remove
    numba_jit.NumbaKernel(_made_in_a_function())(a)  # a new process's dispatcher: compiled again
    assert other.exists()
    numpy.testing.assert_array_equal(a, numpy.full(3, 2, numpy.float32))
    assert [m for m in notices if f"cache in {index.parent} does not load" in m], notices
    notices.clear()
    numba_jit.NumbaKernel(_made_in_a_function())(a)  # the rewritten cache loads
    assert not notices


def test_a_resume_notes_a_change_of_the_kernels_that_ran(tmp_path, notices):
    """The checkpoint records what ran batch norm (numba or numpy), not the setting: auto is either."""
    import towers

    def run(kernels, steps, resume):
        model = [towers.Flatten(), towers.Dense("fc1", 24), towers.BatchNorm("bn"), towers.ReLU(),
                 towers.Dense("fc2", 10)]
        cfg = Config(devices="cpu", n_gpu=2, steps=steps, quiet=True, summary_every=0, log_every=1000,
                     checkpoint_every=4, cpu_kernels=kernels, logdir=str(tmp_path), resume=resume)
        with towers.Trainer(cfg, model=model) as t:
            t.fit()

    changed = "the CPU kernels changed since the checkpoint"
    run("numba", 4, False)
    run("auto", 8, True)  # numba again: nothing to say
    assert not any(changed in m for m in notices)
    run("numpy", 12, True)
    assert any(f"{changed} (numba -> numpy" in m for m in notices)


def _pool_model():
    """A convolution (more filters than channels, but the first layer: no input gradient), max-pooling, ReLU."""
    import towers

    return [towers.Conv2D("c1", 8, 3), towers.MaxPool2D(2), towers.ReLU(), towers.Flatten(), towers.Dense("fc", 10)]


@pytest.mark.parametrize("model, optimizer", [("pool", "adam"), ("pool", "sgd"), ("mlp", "sgd"), ("mlp", "rmsprop")])
def test_models_without_batch_norm_train_to_numpys_bits_through_the_exact_kernels(model, optimizer, tmp_path):
    """No batch norm and no input gradient of a convolution with more filters than channels: the max-pooling,
    ReLU, L2, all-reduce and optimizer forms are exact, so numba's run and NumPy's end on the same bits (and
    numba's loops ran: the run says which, and the update's loop has float32 machine code)."""
    import towers

    out = {}
    for kernels in ("numba", "numpy"):
        cfg = Config(devices="cpu", n_gpu=2, optimizer=optimizer, batch_size=16, steps=4, quiet=True,
                     summary_every=0, log_every=1000, checkpoint_every=0, cpu_kernels=kernels,
                     logdir=str(tmp_path / kernels), **({"model": model} if model == "mlp" else {}))
        with towers.Trainer(cfg, model=_pool_model() if model == "pool" else None) as t:
            t.fit()
            assert t.cpu_kernels == kernels and t.executor.forms.compiled == (kernels == "numba")
            if kernels == "numba":
                assert all(o._op.loop().compiled().signatures for o in t.executor.optimizers)
            out[kernels] = {k: v.tobytes() for k, v in {**t.get_weights(), **t.get_weights(ema=True)}.items()}
    assert out["numba"] == out["numpy"]


@pytest.mark.parametrize("model", ["mlp", "pool"])
def test_a_model_whose_results_do_not_depend_on_the_kernels_resumes_across_them_to_the_same_bits(
        model, tmp_path, notices):
    """No batch norm, and no input gradient of a convolution with more filters than channels (the pool model's is
    its first layer): a run written with numba's kernels and resumed with NumPy's says nothing and ends on the
    uninterrupted run's bits."""
    import towers

    def run(kernels, steps, logdir, resume=False):
        cfg = Config(devices="cpu", n_gpu=2, steps=steps, quiet=True, summary_every=0, log_every=1000,
                     checkpoint_every=4, cpu_kernels=kernels, logdir=str(logdir), resume=resume)
        with towers.Trainer(cfg, model=_pool_model() if model == "pool" else None) as t:
            t.fit()
            assert t.cpu_kernels == kernels
            return {k: v.tobytes() for k, v in {**t.get_weights(), **t.get_weights(ema=True)}.items()}

    run("numba", 4, tmp_path / "split")
    resumed = run("numpy", 8, tmp_path / "split", resume=True)
    assert not any("the CPU kernels changed" in m for m in notices)
    assert resumed == run("numpy", 8, tmp_path / "whole")


def test_lenet5_takes_its_input_gradient_by_col2im_through_numba(tmp_path):
    """LeNet-5's conv2 (32 -> 64 channels) takes dx by the compiled col2im with numba and by dy's im2col
    without: other sums, so the runs agree to float32 rounding, not bit for bit, and the layer says so."""
    import towers

    out = {}
    for kernels in ("numba", "numpy"):
        cfg = Config(devices="cpu", n_gpu=2, model="lenet5", batch_size=16, steps=4, quiet=True, summary_every=0,
                     log_every=1000, checkpoint_every=0, cpu_kernels=kernels, logdir=str(tmp_path / kernels))
        with towers.Trainer(cfg) as t:
            t.fit()
            convs = [(i, layer) for i, layer in enumerate(t.model.layers) if isinstance(layer, towers.Conv2D)]
            # Both have more filters than channels; conv1 is the first layer and takes no input gradient.
            assert [layer.compiled_rounding(input_grad=i > 0) for i, layer in convs] == [False, True]
            assert forms.rounds_otherwise(t.model)
            out[kernels] = t.get_weights()
    assert any(out["numba"][k].tobytes() != out["numpy"][k].tobytes() for k in out["numpy"]), "col2im did not run"
    for k in out["numpy"]:
        _close(out["numba"][k], out["numpy"][k], k, rtol=1e-5)


def test_two_trainers_in_one_process_each_train_with_their_own_forms(tmp_path):
    """Each Trainer holds its forms; a Trainer built later with other ``cpu_kernels`` does not change what an
    earlier one runs: batch norm's statistics (which the compiled loops round otherwise) end on the bits of the
    earlier Trainer's run alone."""
    pytest.importorskip("numba", reason="numba is not installed")
    import towers

    def model():
        return [towers.Conv2D("c1", 4, 3), towers.BatchNorm("bn"), towers.ReLU(), towers.Flatten(),
                towers.Dense("fc", 10)]

    def trainer(kernels, name):
        cfg = Config(devices="cpu", n_gpu=2, batch_size=8, steps=3, quiet=True, summary_every=0, log_every=1000,
                     checkpoint_every=0, cpu_kernels=kernels, logdir=str(tmp_path / name))
        return towers.Trainer(cfg, model=model())

    with trainer("numba", "alone") as t:
        t.fit()
        alone = t.get_weights()
    with trainer("numba", "first") as first, trainer("numpy", "second") as second:
        first.fit()
        second.fit()
        assert all(alone[k].tobytes() == v.tobytes() for k, v in first.get_weights().items())
        assert any(alone[k].tobytes() != v.tobytes() for k, v in second.get_weights().items())


def test_two_trainers_fitting_in_two_threads_each_train_with_their_own_forms(tmp_path):
    """Each Trainer holds its forms: a Trainer built or stepping in another thread does not change what this one
    runs, in its own thread or its tower threads (one numba, one numpy, their steps interleaved), and building
    one leaves no forms current in its thread."""
    import threading

    import towers

    def trainer(kernels, name, steps):
        layers = [towers.Conv2D("c1", 4, 3), towers.BatchNorm("bn"), towers.ReLU(), towers.Flatten(),
                  towers.Dense("fc", 10)]
        cfg = Config(devices="cpu", n_gpu=2, batch_size=8, steps=steps, quiet=True, summary_every=0,
                     log_every=1000, checkpoint_every=0, cpu_kernels=kernels, logdir=str(tmp_path / name))
        return towers.Trainer(cfg, model=layers)

    def alone(kernels):
        out = {}

        def run():
            with trainer(kernels, "alone-" + kernels, 6) as t:
                t.fit()
                out["w"] = t.get_weights()
        th = threading.Thread(target=run)
        th.start()
        th.join()
        return out["w"]

    want = {k: alone(k) for k in ("numba", "numpy")}
    built, done, got, errors = threading.Barrier(2), threading.Event(), {}, []

    def numba_side():
        try:
            with trainer("numba", "numba", 6) as t:
                built.wait()  # the numpy Trainer is built (its choice made) only after this one
                built.wait()
                got["name"] = (t.executor.forms.name, forms.current().name)  # its own; none current here
                t.fit()
                got["numba"] = t.get_weights()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            built.abort()
        finally:
            done.set()

    def numpy_side():
        try:
            built.wait()
            with trainer("numpy", "numpy", 6) as t:
                built.wait()
                t.fit()
                got["numpy"] = t.get_weights()
                while not done.is_set():  # more steps, each making numpy its thread's choice, beside the fit
                    t.train_step(*t.source.next_batch())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            built.abort()

    threads = [threading.Thread(target=numba_side), threading.Thread(target=numpy_side)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert got["name"] == ("numba", "numpy")
    for kernels in ("numba", "numpy"):
        assert all(want[kernels][k].tobytes() == v.tobytes() for k, v in got[kernels].items()), kernels
    assert any(want["numba"][k].tobytes() != want["numpy"][k].tobytes() for k in want["numpy"])


def test_a_kernels_own_error_goes_up_without_a_cache_notice(notices):
    """A call that fails through a fresh compile too is the kernel's error, not its cache's: raised, no notice."""
    import numba

    from towers.ops import batch_norm

    fresh = numba_jit.NumbaKernel(batch_norm.moments_loop.py_func)
    with pytest.raises(numba.core.errors.TypingError):
        fresh("not an array")
    assert not [m for m in notices if "numba's cache" in m]
    x = numpy.arange(8, dtype=numpy.float32).reshape(4, 2)
    shift, off, var = fresh(x)  # the kernel still runs
    numpy.testing.assert_allclose(shift + off, x.mean(axis=0), rtol=1e-6)
