"""A new optimizer and a new activation, each one file with its arithmetic written once, train and compile.

* Lion (``tests/fixtures/lion.py``), copied into ``towers/optim/optimizers/``
  of a copy of the package and nothing else: the command line trains with
  ``--optimizer lion`` on 2 CPU towers, through NumPy's passes and through
  numba's loop, to the same bits; its CUDA kernel (with and without the EMA)
  compiles under NVRTC without a fused multiply-add.
* LeakyReLU (``tests/fixtures/leaky_relu.py``), a layer whose forward and
  backward ops are defined in its own file: a model with it trains to the same
  bits through both CPU forms (the ops' compiled loops did run), and both
  kernels compile under NVRTC.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess

import numpy
import pytest

from tests import commands
from tests.conftest import DIGITS, REPO

FIXTURES = REPO / "tests" / "fixtures"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"towers_test_fixture_{name}", FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nvrtc_compiles(kernel) -> None:
    """The generated kernel through NVRTC for sm_80 and sm_90, its machine code free of FMA (skips without NVRTC)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy is not installed")
    from tests.devices import test_kernels_compile as compile_test  # skips this test where NVRTC does not load
    from towers.ops.codegen.cuda_form import OPTIONS

    for arch in compile_test.ARCHS:
        compile_test._rounds_as_numpy(compile_test.compile_cuda(kernel.source, kernel.name, OPTIONS, arch),
                                      kernel.name)


@pytest.fixture(scope="module")
def package_with_lion(tmp_path_factory):
    """A copy of the towers package with the Lion file added to its optimizers: the one change.

    The ``__pycache__`` folders come along: numba's machine code of the kernels the checkout compiled
    before (``towers.ops.numba_jit``: stamped by each source file, so only unchanged ones load) spares the
    copy a cold compile of every kernel (about half the test); Lion's own kernel is compiled anew.
    """
    root = tmp_path_factory.mktemp("with-lion")
    shutil.copytree(REPO / "towers", root / "towers")
    shutil.copy(FIXTURES / "lion.py", root / "towers" / "optim" / "optimizers" / "lion.py")
    return root


def _train(root, logdir, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    return commands.run("towers.train", "--data", DIGITS, "--n-gpu", "2", "--devices", "cpu", "--steps", "40",
                        "--quiet", "--logdir", logdir, *args, cwd=root, env=env, timeout=300)


@pytest.mark.slow
def test_lion_in_one_file_trains_to_the_same_bits_through_both_cpu_forms(package_with_lion, tmp_path):
    pytest.importorskip("numba", reason="numba is not installed: the compiled CPU forms are optional")
    md5 = {}
    for form in ("numpy", "numba"):
        p = _train(package_with_lion, tmp_path / form, "--optimizer", "lion", "--lion-beta1", "0.8",
                   "--cpu-kernels", form)
        assert p.returncode == 0, p.stderr
        ckpt = numpy.load(tmp_path / form / "ckpt-00000040.npz")
        assert str(ckpt["cpu_kernels"]) == form  # what ran the CPU towers' ops
        slot = b"".join(ckpt[k].tobytes() for k in sorted(ckpt.files) if k.startswith("lion_m/"))
        assert slot  # its slot, checkpointed like the weights
        md5[form] = (hashlib.md5((tmp_path / form / "final.npz").read_bytes()).hexdigest(), slot)
    assert md5["numpy"] == md5["numba"]
    # The registry of the unchanged package does not know it: the file is the whole change.
    p = _train(REPO, tmp_path / "without", "--optimizer", "lion")
    assert p.returncode != 0 and "lion" in p.stderr


@pytest.mark.parametrize("with_ema", [False, True], ids=["no-ema", "ema"])
def test_lions_kernel_compiles_without_fma(with_ema):
    from towers.optim.ema import EMA

    lion = _load("lion")
    params = numpy.linspace(-1, 1, 16, dtype=numpy.float32)
    opt = lion.Lion(params, ema=EMA(params, 0.99) if with_ema else None)
    _nvrtc_compiles(opt._op.kernel())


def test_lions_update_is_the_papers():
    """Its forms do what the paper says, on a hand computation (float64 reference, float32 tolerance)."""
    lion = _load("lion")
    rng = numpy.random.default_rng(0)
    p0, m0, g = (rng.standard_normal(1000).astype(numpy.float32) for _ in range(3))
    g[:3] = 0.0
    m0[:3] = [0.0, 1.0, -1.0]
    want_c = 0.9 * m0.astype(numpy.float64) + 0.1 * g
    want_p = p0 - 0.01 * numpy.sign(want_c)
    want_m = 0.99 * m0.astype(numpy.float64) + 0.01 * g
    for form in ("numpy", "numba"):
        if form == "numba":
            pytest.importorskip("numba", reason="numba is not installed")
        from tests.conftest import cpu_form

        opt = lion.Lion(p0.copy())
        opt.state["lion_m"][...] = m0
        with cpu_form(form):
            opt.step(g.copy(), 0.01, 0)
        numpy.testing.assert_allclose(opt.params, want_p, rtol=1e-6, atol=1e-7)
        numpy.testing.assert_allclose(opt.state["lion_m"], want_m, rtol=1e-5, atol=1e-7)
        assert opt.params[0] == p0[0]  # sign(0) = 0: no step


def _leaky_model(leaky):
    import towers

    return [towers.Flatten(), towers.Dense("fc1", 32), leaky.LeakyReLU(0.1), towers.Dense("fc2", 10)]


def test_a_new_activation_in_one_file_trains_to_the_same_bits_through_both_cpu_forms(tmp_path):
    import towers

    leaky = _load("leaky_relu")
    out = {}
    for form in ("numpy", "numba"):
        if form == "numba":
            pytest.importorskip("numba", reason="numba is not installed")
        cfg = towers.Config(devices="cpu", n_gpu=2, steps=30, quiet=True, summary_every=0, log_every=1000,
                            checkpoint_every=0, cpu_kernels=form, logdir=str(tmp_path / form))
        with towers.Trainer(cfg, model=_leaky_model(leaky)) as t:
            t.fit()
            assert t.cpu_kernels == form
            out[form] = {k: v.tobytes() for k, v in t.get_weights().items()}
    assert out["numpy"] == out["numba"]
    for op in (leaky.leaky_relu, leaky.leaky_relu_backward):  # the compiled loops ran, for float32
        assert any("float32" in str(sig) for sig in op.loop().compiled().signatures), op.name


def test_the_new_activations_forms_agree_with_its_definition():
    """Both CPU forms against the definition run directly by NumPy, negative zeros, NaN and infinities too."""
    from tests.conftest import cpu_form

    leaky = _load("leaky_relu")
    x = numpy.concatenate([numpy.array([-0.0, 0.0, numpy.nan, numpy.inf, -numpy.inf, -2.0, 3.0], numpy.float32),
                           numpy.random.default_rng(1).standard_normal(5000).astype(numpy.float32)])
    alpha = numpy.float32(0.1)
    want = numpy.where(x > 0, x, x * alpha)
    for form in ("numpy", "numba"):
        if form == "numba":
            pytest.importorskip("numba", reason="numba is not installed")
        y = numpy.full_like(x, 7.0)
        dy = numpy.ones_like(x)
        with cpu_form(form), numpy.errstate(invalid="ignore"):
            leaky.leaky_relu(x, 0.1, y)
            leaky.leaky_relu_backward(y, dy, 0.1)
        assert y.tobytes() == want.tobytes(), form
        assert dy.tobytes() == numpy.where(y > 0, numpy.float32(1), alpha).tobytes(), form


def test_the_new_activations_kernels_compile_without_fma():
    leaky = _load("leaky_relu")
    for op in (leaky.leaky_relu, leaky.leaky_relu_backward):
        _nvrtc_compiles(op.kernel())
