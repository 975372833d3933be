"""Models: a small layer API, the built-in models, the loss, and one replica.

Layer API
---------
A model is a ``Sequential`` of layers.  A layer declares its parameters when it
is built for an input shape, then runs forward and backward on arrays of one
array module (NumPy or CuPy, whichever holds the input):

``build(in_shape) -> (params, out_shape)``
    ``in_shape`` excludes the batch dimension.  ``params`` is a list of
    ``Param(name, shape, init, regularize)``; ``name`` is local ("weights") and
    the layer's ``scope`` ("layer1") is prepended to make the global name.
``forward(p, x, ws) -> y``
    ``p`` maps local names to parameter views.  Keep what backward needs in
    ``ws.saved``; get output buffers from ``ws.array(key, shape, dtype)``, which
    allocates once per shape and then hands back the same array, so steady-state
    steps allocate nothing.
``backward(p, g, dy, ws, need_dx) -> dx``
    Write parameter gradients INTO the views in ``g`` (``xp.matmul(..., out=g[k])``
    or ``g[k][...] = ...``); rebinding a name would leave the flat gradient buffer
    untouched and the all-reduce would average stale values.  Return ``dx``, or
    None when ``need_dx`` is False (the first layer).

A replica (``Replica``) owns two contiguous buffers on its device, one for all
parameters and one for all gradients; named parameters are views into them, so
the all-reduce and the optimizer each touch one array per step.  L2-regularized
parameters come first in the buffer so that the L2 term and its gradient are one
operation on a contiguous prefix.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Callable

import numpy

from towers import UserError


@dataclass(frozen=True)
class Param:
    """A parameter a layer declares: local name, shape, initializer, L2 or not."""

    name: str
    shape: tuple
    init: str = "zeros"  # "zeros", "constant:<value>" or "truncated_normal:<stddev>"
    regularize: bool = False


class Workspace:
    """Per-layer scratch arrays, allocated on first use and reused afterwards."""

    def __init__(self, xp):
        self.xp = xp
        self.saved: dict = {}
        self._arrays: dict = {}

    def array(self, key: str, shape: tuple, dtype):
        k = (key, tuple(shape), numpy.dtype(dtype).str)
        a = self._arrays.get(k)
        if a is None:
            a = self._arrays[k] = self.xp.empty(shape, dtype=dtype)
        return a


class Layer:
    """Base class: a layer without parameters that passes its input through."""

    scope: str | None = None

    def build(self, in_shape: tuple) -> tuple[list[Param], tuple]:
        return [], tuple(in_shape)

    def forward(self, p, x, ws):  # pragma: no cover - interface
        raise NotImplementedError

    def backward(self, p, g, dy, ws, need_dx):  # pragma: no cover - interface
        raise NotImplementedError


class Flatten(Layer):
    """(n, ...) -> (n, prod(...)) as a view, so no copy is made."""

    def build(self, in_shape):
        return [], (int(numpy.prod(in_shape)),)

    def forward(self, p, x, ws):
        ws.saved["shape"] = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, p, g, dy, ws, need_dx):
        return dy.reshape(ws.saved["shape"]) if need_dx else None


class Dense(Layer):
    """y = x @ weights + biases, weights truncated-normal(stddev), biases ``bias`` (0)."""

    def __init__(self, scope: str, units: int, stddev: float = 0.1, bias: float = 0.0):
        self.scope, self.units, self.stddev, self.bias = scope, int(units), float(stddev), float(bias)

    def build(self, in_shape):
        if len(in_shape) != 1:
            raise UserError(
                f"{self.scope}: Dense takes flat inputs, got per-example shape {in_shape}; "
                "put a Flatten() before it"
            )
        return [
            Param("weights", (in_shape[0], self.units), f"truncated_normal:{self.stddev}", True),
            Param("biases", (self.units,), f"constant:{self.bias}" if self.bias else "zeros", False),
        ], (self.units,)

    def forward(self, p, x, ws):
        xp = ws.xp
        y = ws.array("y", (x.shape[0], self.units), x.dtype)
        xp.matmul(x, p["weights"], out=y)
        y += p["biases"]
        ws.saved["x"] = x
        return y

    def backward(self, p, g, dy, ws, need_dx):
        xp = ws.xp
        x = ws.saved["x"]
        xp.matmul(x.T, dy, out=g["weights"])
        xp.sum(dy, axis=0, out=g["biases"])
        if not need_dx:
            return None
        dx = ws.array("dx", x.shape, x.dtype)
        xp.matmul(dy, p["weights"].T, out=dx)
        return dx


class ReLU(Layer):
    """max(x, 0); the gradient passes where the output is positive."""

    def forward(self, p, x, ws):
        xp = ws.xp
        y = ws.array("y", x.shape, x.dtype)
        xp.maximum(x, 0, out=y)
        ws.saved["y"] = y
        return y

    def backward(self, p, g, dy, ws, need_dx):
        if not need_dx:
            return None
        xp = ws.xp
        y = ws.saved["y"]
        mask = ws.array("mask", y.shape, y.dtype)
        xp.greater(y, 0, out=mask)  # 1.0 / 0.0 in the float dtype: no bool temp
        xp.multiply(dy, mask, out=dy)  # dy is the next layer's scratch: safe in place
        return dy


class Sequential:
    """Layers applied in order.  ``build`` fixes the shapes and parameter list."""

    def __init__(self, layers: list[Layer]):
        self.layers = list(layers)
        self.input_shape: tuple | None = None
        self.output_shape: tuple | None = None
        self.params: list[tuple[int, str, Param]] = []  # (layer index, global name, Param)

    def build(self, input_shape: tuple) -> "Sequential":
        shape = tuple(int(s) for s in input_shape)
        self.input_shape, self.params = shape, []
        names = set()
        for li, layer in enumerate(self.layers):
            params, shape = layer.build(shape)
            for prm in params:
                name = f"{layer.scope}/{prm.name}" if layer.scope else prm.name
                if name in names:
                    raise UserError(f"model declares parameter {name!r} twice: give layers distinct scopes")
                names.add(name)
                self.params.append((li, name, prm))
        self.output_shape = shape
        return self

    def layout(self) -> list[tuple[str, tuple, int, int]]:
        """(name, shape, offset, size) in flat-buffer order: regularized first."""
        ordered = [e for e in self.params if e[2].regularize] + [
            e for e in self.params if not e[2].regularize
        ]
        out, off = [], 0
        for _, name, prm in ordered:
            size = int(numpy.prod(prm.shape))
            out.append((name, tuple(prm.shape), off, size))
            off += size
        return out

    @property
    def n_regularized(self) -> int:
        return sum(int(numpy.prod(p.shape)) for _, _, p in self.params if p.regularize)

    @property
    def size(self) -> int:
        return sum(int(numpy.prod(p.shape)) for _, _, p in self.params)

    def init_params(self, seed: int) -> numpy.ndarray:
        """The initial flat float32 buffer (host), the same for every replica of one seed."""
        rng = numpy.random.default_rng(seed)
        flat = numpy.zeros(self.size, dtype=numpy.float32)
        inits = {name: prm.init for _, name, prm in self.params}
        for name, shape, off, size in self.layout():  # fixed order: reproducible
            kind, _, arg = inits[name].partition(":")
            if kind == "truncated_normal":
                flat[off : off + size] = truncated_normal(rng, size, float(arg))
            elif kind == "constant":
                flat[off : off + size] = float(arg)
            elif kind != "zeros":
                raise UserError(f"parameter {name}: unknown initializer {inits[name]!r}")
        return flat


def truncated_normal(rng: numpy.random.Generator, size: int, stddev: float) -> numpy.ndarray:
    """Normal(0, stddev) samples, re-drawn while beyond 2 stddev (TF's truncated_normal)."""
    out = rng.standard_normal(size)
    bad = numpy.abs(out) > 2.0
    while bad.any():
        out[bad] = rng.standard_normal(int(bad.sum()))
        bad = numpy.abs(out) > 2.0
    return (out * stddev).astype(numpy.float32)


# -- built-in models --------------------------------------------------------------


def mlp(input_shape: tuple, num_classes: int, hidden: int = 500) -> Sequential:
    """The book's ``mnist_inference``: input -> hidden ReLU -> logits."""
    return Sequential(
        [Flatten(), Dense("layer1", hidden), ReLU(), Dense("layer2", num_classes)]
    )


MODELS: dict[str, Callable[..., Sequential]] = {"mlp": mlp}  # "lenet5" is added at the end


def build_model(spec: str, input_shape: tuple, num_classes: int, hidden: int = 500) -> Sequential:
    """``mlp``, another registered name, or ``package.module:function``.

    A user's function is called as ``function(input_shape, num_classes)`` and
    returns a ``Sequential`` (or a list of layers).
    """
    if spec in MODELS:
        fn = MODELS[spec]
        model = fn(input_shape, num_classes, hidden=hidden) if spec == "mlp" else fn(input_shape, num_classes)
    elif ":" in spec:
        mod_name, _, fn_name = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise UserError(f"--model {spec}: cannot load it ({e}); give package.module:function") from None
        model = fn(tuple(input_shape), num_classes)
        if isinstance(model, (list, tuple)):
            model = Sequential(list(model))
        if not isinstance(model, Sequential):
            raise UserError(f"--model {spec}: the function returned {type(model).__name__}, not a Sequential")
    else:
        raise UserError(
            f"--model {spec!r} is unknown: use one of {', '.join(sorted(MODELS))} or package.module:function"
        )
    model.build(input_shape)
    if model.output_shape != (num_classes,):
        raise UserError(
            f"--model {spec}: it outputs per-example shape {model.output_shape}, "
            f"but the data has {num_classes} classes"
        )
    return model


# -- one replica ------------------------------------------------------------------


class Replica:
    """One tower's copy of the model: flat parameter and gradient buffers on a device.

    ``params`` and ``grads`` are contiguous 1-D arrays; ``param[name]`` and
    ``grad[name]`` are views into them.  All arrays live on ``xp`` (NumPy or CuPy;
    for CuPy the caller makes the right device current).
    """

    def __init__(self, model: Sequential, xp, dtype=numpy.float32):
        self.model, self.xp, self.dtype = model, xp, numpy.dtype(dtype)
        self.params = xp.zeros(model.size, dtype=self.dtype)
        self.grads = xp.zeros(model.size, dtype=self.dtype)
        self.param, self.grad = {}, {}
        for name, shape, off, size in model.layout():
            # copy=False raises rather than silently copying: the views must alias.
            self.param[name] = self.params[off : off + size].reshape(shape, copy=False)
            self.grad[name] = self.grads[off : off + size].reshape(shape, copy=False)
        self._nreg = model.n_regularized
        self._first_param_layer = min((li for li, _, _ in model.params), default=0)
        self._local = []  # per layer: (params dict, grads dict, workspace)
        by_layer: dict[int, list[tuple[str, str]]] = {}
        for li, name, prm in model.params:
            by_layer.setdefault(li, []).append((prm.name, name))
        for li in range(len(model.layers)):
            names = by_layer.get(li, [])
            self._local.append(
                (
                    {k: self.param[n] for k, n in names},
                    {k: self.grad[n] for k, n in names},
                    Workspace(xp),
                )
            )
        self._loss_ws = Workspace(xp)

    def set_params(self, flat) -> None:
        """Copy a flat host or device array into the parameter buffer."""
        self.params[...] = self.xp.asarray(flat, dtype=self.dtype)

    def forward(self, x):
        for layer, (p, _, ws) in zip(self.model.layers, self._local):
            x = layer.forward(p, x, ws)
        return x

    def loss_and_grads(self, x, labels, l2: float, want_loss: bool = True, timer=None):
        """Forward, mean softmax cross-entropy + L2, backward into ``grads``.

        Returns the loss as a 0-d device array when ``want_loss`` (it is not
        fetched to the host here: that would be a sync point), else None.
        ``timer(phase)``, when given, returns a context that times the
        ``forward`` and ``backward`` phases (``towers.profile``).
        """
        timer = timer or _no_timer
        with timer("forward"):
            logits = self.forward(x)
            loss, dy = softmax_cross_entropy(logits, labels, self._loss_ws, want_loss)
        with timer("backward"):
            layers = self.model.layers
            # Backward stops at the first layer with parameters, which needs no
            # input gradient (for the MLP that saves a third of the step's FLOPs).
            for i in range(len(layers) - 1, self._first_param_layer - 1, -1):
                p, g, ws = self._local[i]
                dy = layers[i].backward(p, g, dy, ws, need_dx=i > self._first_param_layer)
            if self._nreg and l2:
                w = self.params[: self._nreg]
                # grads += l2 * w without a temporary: one fused pass would need a
                # kernel, two in-place passes over a scratch buffer are the next best.
                tmp = self._loss_ws.array("l2", w.shape, w.dtype)
                self.xp.multiply(w, self.dtype.type(l2), out=tmp)
                self.grads[: self._nreg] += tmp
                if want_loss:
                    loss = loss + self.dtype.type(l2 / 2) * self.xp.dot(w, w)
        return loss


    def evaluate(self, x, y, batch: int = 250) -> tuple[float, float]:
        """Mean loss (without L2) and accuracy over host arrays ``x``, ``y``.

        Counts real examples only (the last chunk is short, never padded).  Chunks
        are small because a convolution's im2col buffer grows with them.  uint8
        inputs are scaled by 1/255 on the device, as in training.
        """
        xp = self.xp
        total_loss, correct = 0.0, 0
        for start in range(0, len(x), batch):
            xb = xp.asarray(x[start : start + batch])
            yb = xp.asarray(y[start : start + batch])
            xb = xb * numpy.float32(1 / 255) if xb.dtype == numpy.uint8 else xb.astype(self.dtype, copy=False)
            logits = self.forward(xb.astype(self.dtype, copy=False))
            loss, _ = softmax_cross_entropy(logits, yb, self._loss_ws, True)
            total_loss += float(loss) * len(yb)
            correct += accuracy_count(logits, yb)
        n = max(len(x), 1)
        return total_loss / n, correct / n


_NO_TIMER = contextlib.nullcontext()


def _no_timer(phase):
    return _NO_TIMER


def softmax_cross_entropy(logits, labels, ws: Workspace, want_loss: bool = True):
    """Mean sparse softmax cross-entropy from logits and its gradient.

    Uses the log-sum-exp shift (never the log of a softmax, which underflows).
    Returns (loss or None, dlogits); dlogits lives in ``ws``.
    """
    xp = ws.xp
    n, c = logits.shape
    m = ws.array("max", (n, 1), logits.dtype)
    xp.max(logits, axis=1, keepdims=True, out=m)
    z = ws.array("z", (n, c), logits.dtype)
    xp.subtract(logits, m, out=z)
    prob = ws.array("prob", (n, c), logits.dtype)
    xp.exp(z, out=prob)
    s = ws.array("sum", (n, 1), logits.dtype)
    xp.sum(prob, axis=1, keepdims=True, out=s)
    rows = ws.array("rows", (n,), numpy.int64)
    if ws.saved.get("rows_n") != n:
        rows[...] = xp.arange(n)
        ws.saved["rows_n"] = n
    loss = None
    if want_loss:
        loss = (xp.sum(xp.log(s)) - xp.sum(z[rows, labels])) / logits.dtype.type(n)
    xp.divide(prob, s, out=prob)
    prob[rows, labels] -= 1
    prob *= logits.dtype.type(1.0 / n)
    return loss, prob


def accuracy_count(logits, labels) -> int:
    """Number of correct predictions (host int: a sync point, used at eval only)."""
    return int((logits.argmax(axis=1) == labels).sum())


def _lenet5(input_shape: tuple, num_classes: int) -> Sequential:
    """``towers.layers_conv.lenet5``, imported on use (that module imports this one)."""
    from towers.layers_conv import lenet5

    return lenet5(input_shape, num_classes)


MODELS["lenet5"] = _lenet5

__all__ = [
    "Param", "Layer", "Flatten", "Dense", "ReLU", "Sequential", "Workspace",
    "Replica", "build_model", "MODELS", "mlp", "softmax_cross_entropy",
    "truncated_normal", "accuracy_count",
]
