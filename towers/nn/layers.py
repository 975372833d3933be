"""The layer API: parameters, scratch workspaces, Dense, ReLU, Flatten, Sequential.

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
    Write parameter gradients INTO the views in ``g`` (``kernels.gemm(..., g[k])``
    or ``g[k][...] = ...``); rebinding a name would leave the flat gradient buffer
    untouched and the all-reduce would average stale values.  Return ``dx``, or
    None when ``need_dx`` is False (the first layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from towers.errors import UserError
from towers.nn import kernels


@dataclass(frozen=True)
class Param:
    """A parameter a layer declares: local name, shape, initializer, L2 or not."""

    name: str
    shape: tuple
    init: str = "zeros"  # "zeros", "constant:<value>" or "truncated_normal:<stddev>"
    regularize: bool = False
    trainable: bool = True  # False: a buffer (non-trainable state, e.g. moving statistics)


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
        y = ws.array("y", (x.shape[0], self.units), x.dtype)
        kernels.gemm(x, p["weights"], y)
        kernels.bias_add(y, p["biases"])
        ws.saved["x"] = x
        return y

    def backward(self, p, g, dy, ws, need_dx):
        x = ws.saved["x"]
        kernels.gemm(x, dy, g["weights"], trans_a=True)
        kernels.bias_grad(dy, g["biases"], ws)
        if not need_dx:
            return None
        dx = ws.array("dx", x.shape, x.dtype)
        kernels.gemm(dy, p["weights"], dx, trans_b=True)
        return dx


class ReLU(Layer):
    """max(x, 0); the gradient passes where the output is positive."""

    def forward(self, p, x, ws):
        y = ws.array("y", x.shape, x.dtype)
        kernels.relu(x, y)
        ws.saved["y"] = y
        return y

    def backward(self, p, g, dy, ws, need_dx):
        if not need_dx:
            return None
        y = ws.saved["y"]
        mask = ws.array("mask", y.shape, y.dtype) if kernels.on_host(y) else None
        kernels.relu_backward(y, dy, mask)  # dy is the next layer's scratch: safe in place
        return dy


class Sequential:
    """Layers applied in order.  ``build`` fixes the shapes and parameter list."""

    def __init__(self, layers: list[Layer]):
        self.layers = list(layers)
        self.input_shape: tuple | None = None
        self.output_shape: tuple | None = None
        self.params: list[tuple[int, str, Param]] = []  # (layer index, global name, Param): trainable
        self.buffers: list[tuple[int, str, Param]] = []  # the same for buffers (trainable=False)

    def build(self, input_shape: tuple) -> "Sequential":
        shape = tuple(int(s) for s in input_shape)
        self.input_shape, self.params, self.buffers = shape, [], []
        names = set()
        for li, layer in enumerate(self.layers):
            params, shape = layer.build(shape)
            for prm in params:
                name = f"{layer.scope}/{prm.name}" if layer.scope else prm.name
                if name in names:
                    raise UserError(f"model declares parameter {name!r} twice: give layers distinct scopes")
                names.add(name)
                (self.params if prm.trainable else self.buffers).append((li, name, prm))
        self.output_shape = shape
        return self

    def layout(self) -> list[tuple[str, tuple, int, int]]:
        """(name, shape, offset, size) in flat-buffer order: regularized first."""
        return _layout([e for e in self.params if e[2].regularize] + [e for e in self.params if not e[2].regularize])

    def buffer_layout(self) -> list[tuple[str, tuple, int, int]]:
        """(name, shape, offset, size) of the buffers in their flat buffer, in declaration order."""
        return _layout(self.buffers)

    @property
    def buffer_size(self) -> int:
        return sum(int(numpy.prod(p.shape)) for _, _, p in self.buffers)

    def init_buffers(self) -> numpy.ndarray:
        """The buffers' initial flat float32 values (host)."""
        return _initial(self.buffers, self.buffer_layout(), None)

    @property
    def n_regularized(self) -> int:
        return sum(int(numpy.prod(p.shape)) for _, _, p in self.params if p.regularize)

    @property
    def size(self) -> int:
        return sum(int(numpy.prod(p.shape)) for _, _, p in self.params)

    def init_params(self, seed: int) -> numpy.ndarray:
        """The initial flat float32 buffer (host), the same for every replica of one seed."""
        return _initial(self.params, self.layout(), numpy.random.default_rng(seed))


def _layout(entries) -> list[tuple[str, tuple, int, int]]:
    out, off = [], 0
    for _, name, prm in entries:
        size = int(numpy.prod(prm.shape))
        out.append((name, tuple(prm.shape), off, size))
        off += size
    return out


def _initial(entries, layout, rng) -> numpy.ndarray:
    """A flat float32 buffer with each entry's initializer, in ``layout`` order (reproducible draws)."""
    flat = numpy.zeros(sum(size for *_, size in layout), dtype=numpy.float32)
    inits = {name: prm.init for _, name, prm in entries}
    for name, shape, off, size in layout:
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
