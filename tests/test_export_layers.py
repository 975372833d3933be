"""Layers own their export: a layer declares how each weight maps to PyTorch's and Keras' layouts
(``Layer.exports``, ``Layer.export_order``), and ``towers.export`` asks it.

The proof is a layer defined here, with a layout neither framework uses, that exports correctly by its
own declaration, without a line of ``towers/export.py`` knowing it.  Each exported file is checked by
computing the model's function from it with NumPy in that framework's conventions (PyTorch: NCHW
images flattened in (C, H, W) order, ``y = x @ weight.T + bias``; Keras: NHWC, ``y = x @ kernel + bias``)
against towers' own forward pass on the same images.
"""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from towers.export import main as export_main
from towers.nn.layers import Dense, Exported, Flatten, Layer, Param, ReLU
from towers.nn.models import build_model
from towers.nn.replica import Replica
from towers.output.checkpoint import list_checkpoints
from towers.train import main as train_main

SHAPE, CLASSES = (4, 4, 3), 5


def _columns(a, order):
    return a if order is None else a[:, order]


class PackedLinear(Layer):
    """``y = (x @ w.T) * bs[1] + bs[0]``: the weight kept (out, in), as PyTorch keeps it, and the bias and a
    per-unit scale packed in ONE (2, out) array, which each framework gets as two tensors."""

    def __init__(self, scope: str, units: int):
        self.scope, self.units = scope, units

    def build(self, in_shape):
        return [Param("w", (self.units, in_shape[0]), "truncated_normal:0.3"),
                Param("bs", (2, self.units), "normal:0.5")], (self.units,)

    def exports(self, framework):
        split = (Exported("bias", lambda a, order: a[0]), Exported("scale", lambda a, order: a[1]))
        if framework == "torch":
            return {"w": Exported("weight", _columns), "bs": split}
        if framework == "keras":
            return {"w": Exported("kernel", lambda a, order: _columns(a, order).T), "bs": split}
        return {}

    def export_order(self, framework, in_shape, order):
        return None  # its units, in the same order everywhere

    def forward(self, p, x, ws):
        z = x @ p["w"].T
        ws.saved.update(x=x, z=z)
        return z * p["bs"][1] + p["bs"][0]

    def backward(self, p, g, dy, ws, need_dx):
        x, z = ws.saved["x"], ws.saved["z"]
        dz = dy * p["bs"][1]
        g["w"][...] = dz.T @ x
        g["bs"][0] = dy.sum(0)
        g["bs"][1] = (dy * z).sum(0)
        return dz @ p["w"] if need_dx else None


class Undeclared(PackedLinear):
    """The same layer without its declarations: towers cannot know where its weights go."""

    exports = Layer.exports


def packed(input_shape, num_classes):
    """Flatten of (4, 4, 3) maps -> the packed layer (which gets PyTorch's (C, H, W) order) -> Dense."""
    return [Flatten(), PackedLinear("packed", 6), ReLU(), Dense("out", num_classes)]


def undeclared(input_shape, num_classes):
    return [Flatten(), Undeclared("packed", 6), ReLU(), Dense("out", num_classes)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = np.random.default_rng(0)
    arrays = {"x": rng.integers(0, 256, (40,) + SHAPE).astype(np.uint8), "y": rng.integers(0, CLASSES, 40),
              "x_test": rng.integers(0, 256, (10,) + SHAPE).astype(np.uint8), "y_test": rng.integers(0, CLASSES, 10)}
    arrays["y"][:CLASSES] = np.arange(CLASSES)  # every class present
    path = tmp_path_factory.mktemp("data") / "small.npz"
    np.savez(path, **arrays)
    return path, arrays


def trained(tmp_path, data, model):
    assert train_main(["--devices", "cpu", "--n-gpu", "1", "--batch-size", "10", "--quiet", "--summary-every", "0",
                       "--data", str(data[0]), "--model", model, "--steps", "3", "--logdir", str(tmp_path)]) == 0
    return list_checkpoints(str(tmp_path))[-1][1]


def towers_logits(checkpoint, x):
    with np.load(checkpoint) as z:
        named = {k[len("params/"):]: z[k] for k in z.files if k.startswith("params/")}
    model = build_model("tests.test_export_layers:packed", SHAPE, CLASSES)
    flat = np.zeros(model.size, np.float32)
    for name, shape, off, size in model.layout():
        flat[off: off + size] = named[name].ravel()
    r = Replica(model, np)
    r.set_params(flat)
    return np.asarray(r.forward(x))


def test_a_layer_of_its_own_layout_exports_by_its_declaration(tmp_path, capsys, data):
    """Before: ``export.py`` refused ``packed/w`` (it knew Dense, Conv2D and BatchNorm names only)."""
    checkpoint = trained(tmp_path / "run", data, "tests.test_export_layers:packed")
    x = data[1]["x_test"].astype(np.float32) / 255
    relu = lambda v: np.maximum(v, 0)  # noqa: E731

    assert export_main([checkpoint, "-o", str(tmp_path / "t.safetensors"), "--layout", "torch"]) == 0, \
        capsys.readouterr().err
    t = load_file(str(tmp_path / "t.safetensors"))
    assert sorted(t) == ["out.bias", "out.weight", "packed.bias", "packed.scale", "packed.weight"]
    assert t["packed.weight"].shape == (6, 48) and t["out.weight"].shape == (CLASSES, 6)
    nchw = x.transpose(0, 3, 1, 2).reshape(len(x), -1)  # nn.Flatten of NCHW images
    h = relu((nchw @ t["packed.weight"].T) * t["packed.scale"] + t["packed.bias"])
    torch_logits = h @ t["out.weight"].T + t["out.bias"]

    assert export_main([checkpoint, "-o", str(tmp_path / "k.safetensors"), "--layout", "keras"]) == 0, \
        capsys.readouterr().err
    k = load_file(str(tmp_path / "k.safetensors"))
    assert sorted(k) == ["out/bias", "out/kernel", "packed/bias", "packed/kernel", "packed/scale"]
    assert k["packed/kernel"].shape == (48, 6)
    h = relu((x.reshape(len(x), -1) @ k["packed/kernel"]) * k["packed/scale"] + k["packed/bias"])
    keras_logits = h @ k["out/kernel"] + k["out/bias"]

    ours = towers_logits(checkpoint, x)
    assert np.abs(ours).max() > 0.1  # a function worth comparing
    np.testing.assert_allclose(torch_logits, ours, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(keras_logits, ours, rtol=1e-5, atol=1e-5)


def test_a_weight_no_layer_declares_is_one_line_exit_2_and_no_file(tmp_path, capsys, data):
    checkpoint = trained(tmp_path / "run", data, "tests.test_export_layers:undeclared")
    capsys.readouterr()
    for layout in ("torch", "keras"):
        out = tmp_path / f"{layout}.safetensors"
        assert export_main([checkpoint, "-o", str(out), "--layout", layout]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"weight 'packed/w' (Undeclared) has no {layout} layout" in err[0], err
        assert "--layout towers" in err[0] and not out.exists()
    assert export_main([checkpoint, "-o", str(tmp_path / "raw.safetensors")]) == 0  # as the checkpoint holds it


@pytest.mark.parametrize("model", ["mlp", "lenet5", "resnet20"])
def test_the_keras_layout_is_the_towers_one_under_keras_names(tmp_path, capsys, model):
    """Keras keeps towers' shapes (Dense (in, out), Conv2D HWIO, NHWC flattening): only the names differ."""
    from tests.conftest import DIGITS

    logdir = tmp_path / "run"
    assert train_main(["--devices", "cpu", "--n-gpu", "1", "--batch-size", "10", "--quiet", "--summary-every", "0",
                       "--data", str(DIGITS), "--model", model, "--hidden", "8", "--steps", "2",
                       "--logdir", str(logdir)]) == 0
    checkpoint = list_checkpoints(str(logdir))[-1][1]
    for args in ([], ["--ema"]):
        assert export_main([checkpoint, "-o", str(tmp_path / "k.safetensors"), "--layout", "keras", *args]) == 0
        assert export_main([checkpoint, "-o", str(tmp_path / "t.safetensors"), *args]) == 0
        k, t = load_file(str(tmp_path / "k.safetensors")), load_file(str(tmp_path / "t.safetensors"))
        renamed = {n.replace("/weights", "/kernel").replace("/biases", "/bias"): a for n, a in t.items()}
        assert sorted(k) == sorted(renamed)
        for name, a in renamed.items():
            np.testing.assert_array_equal(k[name], a, err_msg=name)
        (tmp_path / "k.safetensors").unlink()
        (tmp_path / "t.safetensors").unlink()
