"""Layer API, the MLP, the loss, and the flat parameter/gradient buffers."""
import numpy as np
import pytest

from towers.errors import UserError
from towers.nn.layers import Dense, Flatten, ReLU, Sequential, Workspace
from towers.nn.loss import softmax_cross_entropy
from towers.nn.models import build_model
from towers.nn.replica import Replica


def numeric_grad_check(model, x, y, l2, seed=0, probes=None):
    """Compare every analytic gradient with central finite differences (float64)."""
    r = Replica(model, np, dtype=np.float64)
    rng = np.random.default_rng(seed)
    r.set_params(rng.normal(0, 0.3, model.size))
    loss = r.loss_and_grads(x, y, l2)
    analytic = r.grads.copy()
    eps = 1e-6
    idx = range(model.size) if probes is None else rng.choice(model.size, probes, replace=False)
    worst = 0.0
    for i in idx:
        old = r.params[i]
        r.params[i] = old + eps
        up = float(r.loss_and_grads(x, y, l2))
        r.params[i] = old - eps
        down = float(r.loss_and_grads(x, y, l2))
        r.params[i] = old
        num = (up - down) / (2 * eps)
        worst = max(worst, abs(num - analytic[i]) / max(1e-6, abs(num) + abs(analytic[i])))
    return float(loss), worst


def test_mlp_every_gradient_matches_finite_differences():
    model = build_model("mlp", (3, 2), 4, hidden=5)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 3, 2))
    y = rng.integers(0, 4, 7)
    loss, worst = numeric_grad_check(model, x, y, l2=0.05)
    assert np.isfinite(loss)
    assert worst < 1e-6, worst


def test_mlp_names_shapes_and_init():
    model = build_model("mlp", (28, 28), 10)
    r = Replica(model, np)
    r.set_params(model.init_params(seed=3))
    assert set(r.param) == {"layer1/weights", "layer1/biases", "layer2/weights", "layer2/biases"}
    assert r.param["layer1/weights"].shape == (784, 500) and r.param["layer2/biases"].shape == (10,)
    assert r.params.dtype == np.float32 and r.grads.dtype == np.float32
    w = r.param["layer1/weights"]
    assert np.abs(w).max() <= 0.2 + 1e-7  # truncated at 2 stddev
    assert abs(float(w.std()) - 0.088) < 0.005  # std of a normal truncated at 2 sigma: 0.88 sigma
    assert not r.param["layer1/biases"].any()
    # Same seed -> identical replicas; another seed -> different.
    assert np.array_equal(model.init_params(3), model.init_params(3))
    assert not np.array_equal(model.init_params(3), model.init_params(4))


def test_views_alias_the_flat_buffers_and_backward_writes_into_them():
    model = build_model("mlp", (4,), 3, hidden=6)
    r = Replica(model, np)
    r.set_params(model.init_params(0))
    for name in r.param:
        assert np.shares_memory(r.param[name], r.params) and np.shares_memory(r.grad[name], r.grads)
    r.grads[...] = np.nan
    r.loss_and_grads(np.ones((2, 4), np.float32), np.array([0, 2]), l2=1e-4)
    assert np.isfinite(r.grads).all()  # every element was written by backward
    r.params[:] = 0
    assert not r.param["layer1/weights"].any()


def test_regularized_weights_come_first_in_the_flat_buffer():
    model = build_model("mlp", (4,), 3, hidden=6)
    names = [name for name, *_ in model.layout()]
    assert names[:2] == ["layer1/weights", "layer2/weights"]
    assert model.n_regularized == 4 * 6 + 6 * 3


def test_loss_is_log_sum_exp_stable_and_includes_l2():
    logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]], np.float32)
    labels = np.array([2, 1])
    loss, d = softmax_cross_entropy(logits, labels, Workspace(np))
    assert np.isfinite(loss) and np.isfinite(d).all()
    assert abs(float(loss) - (2000.0 + np.log(3.0)) / 2) < 1e-2
    # L2 term: l2 * sum(w^2) / 2 over weights only.
    model = build_model("mlp", (2,), 2, hidden=3)
    r = Replica(model, np, dtype=np.float64)
    r.set_params(np.arange(model.size) / model.size)
    x, y = np.zeros((1, 2)), np.array([0])
    base = float(r.loss_and_grads(x, y, 0.0))
    with_l2 = float(r.loss_and_grads(x, y, 0.5))
    w2 = sum(float((r.param[n] ** 2).sum()) for n in ("layer1/weights", "layer2/weights"))
    assert abs(with_l2 - base - 0.5 * w2 / 2) < 1e-12


def my_model(input_shape, num_classes):
    """A user model, loaded by --model tests.nn.test_model:my_model."""
    return [Flatten(), Dense("hidden", 7), ReLU(), Dense("out", num_classes)]


def test_user_model_by_module_path_and_errors():
    model = build_model("tests.nn.test_model:my_model", (2, 2), 3)
    assert [n for _, n, _ in model.params] == ["hidden/weights", "hidden/biases", "out/weights", "out/biases"]
    with pytest.raises(UserError, match="unknown"):
        build_model("resnet", (2,), 2)
    with pytest.raises(UserError, match="cannot load"):
        build_model("no_such_module:f", (2,), 2)
    with pytest.raises(UserError, match="Flatten"):
        Sequential([Dense("a", 3)]).build((2, 2))
    with pytest.raises(UserError, match="outputs per-example shape"):
        build_model("tests.nn.test_model:wrong_classes", (2,), 3)


def wrong_classes(input_shape, num_classes):
    return [Dense("a", num_classes + 1)]


def failing(input_shape, num_classes):
    raise ValueError("no width fits 8x8")


@pytest.mark.parametrize("spec, raised", [
    ("json:loads", "raised TypeError: "),  # (the rest is Python's wording)
    ("tests.nn.test_model:failing", "raised ValueError: no width fits 8x8"),
])
def test_a_callable_that_is_no_model_factory_is_one_line_exit_2(tmp_path, spec, raised):
    """Before: a traceback of the call, exit 1."""
    from tests.conftest import run_cli

    p = run_cli("--model", spec, "--devices", "cpu", "--steps", "1", "--quiet", "--logdir", str(tmp_path / "run"))
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert err[0].startswith(f"towers.train: error: --model {spec}: calling ") and raised in err[0], err
    assert "returns a towers.Sequential or a list of layers" in err[0] and not (tmp_path / "run").exists()


def test_gemm_on_the_host_is_numpys_matmul_of_the_views():
    from towers.ops.gemm import gemm

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((7, 5)).astype(np.float32), rng.standard_normal((7, 4)).astype(np.float32)
    out = np.full((5, 4), 7.0, np.float32)
    gemm(a, b, out, trans_a=True)
    np.testing.assert_array_equal(out, np.matmul(a.T, b))
    out = np.full((7, 7), 7.0, np.float32)
    gemm(a, a, out, trans_b=True)
    np.testing.assert_array_equal(out, np.matmul(a, a.T))
