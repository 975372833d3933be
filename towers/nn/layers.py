"""The layer API: parameters, scratch workspaces, Dense, ReLU, Flatten, Sequential.

Layer API
---------
A model is a ``Sequential`` of layers.  A layer declares its parameters when it
is built for an input shape, then runs forward and backward on arrays of one
array module (NumPy or CuPy, whichever holds the input):

``build(in_shape) -> (params, out_shape)``
    ``in_shape`` excludes the batch dimension.  ``params`` is a list of
    ``Param(name, shape, init, regularize, trainable)``; ``name`` is local
    ("weights") and the layer's ``scope`` ("layer1") is prepended to make the
    global name.  ``trainable=False`` declares a buffer: state the layer keeps
    but no gradient reaches (batch norm's moving statistics).
``forward(p, x, ws) -> y``
    ``p`` maps local names to parameter and buffer views; a layer updates its
    buffers in place while training.  Keep what backward needs in
    ``ws.saved``; get output buffers from ``ws.array(key, shape, dtype)``, which
    allocates once per shape and then hands back the same array, so steady-state
    steps allocate nothing.  ``ws.ctx`` is the replica's ``StepContext``
    (``towers.nn.context``: training or not, step, tower, seed, sync) and
    ``ws.path`` the layer's position in the model.
``backward(p, g, dy, ws, need_dx) -> dx``
    Write parameter gradients INTO the views in ``g`` (``gemm(..., g[k])``
    or ``g[k][...] = ...``); rebinding a name would leave the flat gradient buffer
    untouched and the all-reduce would average stale values.  ``g`` holds the
    trainable parameters only.  Return ``dx``, or None when ``need_dx`` is
    False (the first layer).  ``dy`` is the next layer's scratch: backward may
    overwrite it.
``exports(framework) -> {local name: Exported}``
    How each weight and buffer appears in another framework's layout
    (``"torch"``, ``"keras"``): its name there, relative to the layer's scope,
    and ``convert(array, order)`` from towers' layout to that framework's
    (``towers.export`` asks every layer; a weight left out cannot be exported
    in that layout).  One weight may become several (a packed array split).
``export_order(framework, in_shape, order) -> order``
    The order of the layer's output features in that framework, for the next
    layer's ``convert``: None (towers' order) or an index array (feature j
    there is towers' feature ``order[j]``).  The base passes its input's order
    on (layers that act per feature); Flatten makes one for PyTorch's (C, H, W)
    order, Dense ends it (its units are in the same order everywhere).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy

from towers.errors import UserError
from towers.nn.context import StepContext
from towers.ops import activation
from towers.ops.bias import bias_add, bias_grad
from towers.ops.gemm import gemm


@dataclass(frozen=True)
class Param:
    """A parameter a layer declares: local name, shape, initializer, L2 or not, trainable or a buffer."""

    name: str
    shape: tuple
    init: str = "zeros"  # "zeros", "constant:<value>", "truncated_normal:<stddev>" or "normal:<stddev>"
    regularize: bool = False
    trainable: bool = True
    minimum: float | None = None  # the least value it may hold (a variance: 0); set_weights and loads check it


def _as_is(a, order):
    return a


def rows_in(a, order):
    """``a`` with its first axis (one entry per input feature) in the framework's ``order`` (None: as is)."""
    return a if order is None else a[order]


@dataclass(frozen=True)
class Exported:
    """Where one weight (or buffer) goes in another framework: ``name`` there, relative to the layer's scope
    (``/`` between nested scopes), and ``convert(array, order) -> array``, towers' layout to that one's
    (``order``: the layer's input features' order there, ``Layer.export_order``)."""

    name: str
    convert: Callable = _as_is


class Workspace:
    """Per-layer scratch arrays, allocated on first use and reused afterwards.

    ``ctx`` is the replica's step context, ``path`` the layer's indices in the
    model (a nested layer's workspace is ``child(i)`` of its container's).
    """

    def __init__(self, xp, ctx: StepContext | None = None, path: tuple = ()):
        self.xp = xp
        self.ctx = ctx if ctx is not None else StepContext()
        self.path = tuple(path)
        self.saved: dict = {}
        self._arrays: dict = {}
        self._children: dict = {}

    def constant(self, key: str, host: numpy.ndarray, dtype):
        """``host`` (a NumPy array) on this workspace's device as ``dtype``, copied on first use only."""
        k = ("constant", key, numpy.dtype(dtype).str)
        a = self._arrays.get(k)
        if a is None:
            a = self._arrays[k] = self.xp.asarray(host.astype(dtype))
        return a

    def child(self, i: int) -> "Workspace":
        """The workspace of nested layer ``i`` (same context, path extended by ``i``)."""
        w = self._children.get(i)
        if w is None:
            w = self._children[i] = Workspace(self.xp, self.ctx, self.path + (i,))
        return w

    def array(self, key: str, shape: tuple, dtype):
        k = (key, tuple(shape), numpy.dtype(dtype).str)
        a = self._arrays.get(k)
        if a is None:
            a = self._arrays[k] = self.xp.empty(shape, dtype=dtype)
        return a


class Layer:
    """Base class: a layer without parameters that passes its input through.

    ``keeps_dy``: True where ``backward`` only reads ``dy`` (never writes into
    it), so a container may hand the same ``dy`` to another layer afterwards
    (``Residual``: body and shortcut) instead of a copy.
    """

    scope: str | None = None
    keeps_dy: bool = False

    def compiled_rounding(self, input_grad: bool = True) -> bool:
        """Whether the compiled CPU forms of its ops (``towers.ops.forms``) round this layer otherwise than
        their NumPy passes (batch norm's float64 sums), so that the ``cpu_kernels`` that ran are part of what
        reproduces its results; ``input_grad``: its backward computes the input gradient (not the first
        layer's)."""
        return False

    def convolves(self) -> bool:
        """Whether it (or a layer inside it) is a convolution, whose GPU form ``gpu_conv`` chooses
        (``towers.ops.forms``)."""
        return False

    def draws_on_host(self) -> bool:
        """Whether it (or a layer inside it) draws random values on the host each training step (dropout's
        masks), which a CUDA graph would replay unchanged (``cuda_graphs`` refuses it)."""
        return False

    def build(self, in_shape: tuple) -> tuple[list[Param], tuple]:
        return [], tuple(in_shape)

    def exports(self, framework: str) -> dict:
        """Local weight name -> ``Exported`` (or a tuple of them) in ``framework``: none without weights."""
        return {}

    def export_order(self, framework: str, in_shape: tuple, order):
        """The order of the output features in ``framework``: the input's (a layer that acts per feature)."""
        return order

    def forward(self, p, x, ws):  # pragma: no cover - interface
        raise NotImplementedError

    def backward(self, p, g, dy, ws, need_dx):  # pragma: no cover - interface
        raise NotImplementedError


class Flatten(Layer):
    """(n, ...) -> (n, prod(...)) as a view, so no copy is made.

    Keras flattens NHWC maps in the same (H, W, C) order; PyTorch's ``nn.Flatten`` flattens NCHW maps in
    (C, H, W) order, which the next Dense's ``convert`` gets as ``order``.
    """

    def build(self, in_shape):
        return [], (int(numpy.prod(in_shape)),)

    def export_order(self, framework, in_shape, order):
        if framework == "torch" and len(in_shape) == 3:
            h, w, c = in_shape
            return numpy.arange(h * w * c).reshape(h, w, c).transpose(2, 0, 1).ravel()
        return order

    def forward(self, p, x, ws):
        ws.saved["shape"] = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, p, g, dy, ws, need_dx):
        return dy.reshape(ws.saved["shape"]) if need_dx else None


class Dense(Layer):
    """y = x @ weights + biases, weights truncated-normal(stddev), biases ``bias`` (0); weights under L2 unless not ``regularize``.

    Exported as Keras' ``Dense`` (``kernel`` (in, out), ``bias``) and PyTorch's ``nn.Linear`` (``weight``
    (out, in), ``bias``), its inputs in the framework's order.
    """

    def __init__(self, scope: str, units: int, stddev: float = 0.1, bias: float = 0.0, regularize: bool = True):
        self.scope, self.units, self.stddev, self.bias = scope, int(units), float(stddev), float(bias)
        self.regularize = bool(regularize)

    def build(self, in_shape):
        if len(in_shape) != 1:
            raise UserError(
                f"{self.scope}: Dense takes flat inputs, got per-example shape {in_shape}; "
                "put a Flatten() before it"
            )
        return [
            Param("weights", (in_shape[0], self.units), f"truncated_normal:{self.stddev}", self.regularize),
            Param("biases", (self.units,), f"constant:{self.bias}" if self.bias else "zeros", False),
        ], (self.units,)

    def exports(self, framework):
        return {"torch": {"weights": Exported("weight", lambda a, order: rows_in(a, order).T),
                          "biases": Exported("bias")},
                "keras": {"weights": Exported("kernel", rows_in), "biases": Exported("bias")}}.get(framework, {})

    def export_order(self, framework, in_shape, order):
        return None  # its units: the same order in every framework

    def forward(self, p, x, ws):
        y = ws.array("y", (x.shape[0], self.units), x.dtype)
        gemm(x, p["weights"], y)
        bias_add(y, p["biases"])
        ws.saved["x"] = x
        return y

    def backward(self, p, g, dy, ws, need_dx):
        x = ws.saved["x"]
        gemm(x, dy, g["weights"], trans_a=True)
        bias_grad(dy, g["biases"], ws)
        if not need_dx:
            return None
        dx = ws.array("dx", x.shape, x.dtype)
        gemm(dy, p["weights"], dx, trans_b=True)
        return dx


class ReLU(Layer):
    """max(x, 0); the gradient passes where the output is positive."""

    def forward(self, p, x, ws):
        y = ws.array("y", x.shape, x.dtype)
        activation.relu(x, y)
        ws.saved["y"] = y
        return y

    def backward(self, p, g, dy, ws, need_dx):
        if not need_dx:
            return None
        y = ws.saved["y"]
        activation.relu_backward(y, dy)  # dy is the next layer's scratch: safe in place
        return dy


class Sequential:
    """Layers applied in order.  ``build`` fixes the shapes, parameters and buffers.

    Two flat layouts: ``layout()`` the trainable parameters (what the
    optimizer, the all-reduce and the EMA see), ``buffer_layout()`` the
    buffers (non-trainable state such as moving statistics).
    """

    def __init__(self, layers: list[Layer]):
        self.layers = list(layers)
        self.input_shape: tuple | None = None
        self.output_shape: tuple | None = None
        self.params: list[tuple[int, str, Param]] = []  # (layer index, global name, Param), buffers included

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
                if prm.regularize and not prm.trainable:
                    raise UserError(f"{name}: a buffer (trainable=False) cannot be under L2")
                names.add(name)
                self.params.append((li, name, prm))
        self.output_shape = shape
        return self

    def layout(self) -> list[tuple[str, tuple, int, int]]:
        """(name, shape, offset, size) of the trainable parameters in flat-buffer order: regularized first."""
        trainable = [e for e in self.params if e[2].trainable]
        return _offsets([e for e in trainable if e[2].regularize] + [e for e in trainable if not e[2].regularize])

    def buffer_layout(self) -> list[tuple[str, tuple, int, int]]:
        """(name, shape, offset, size) of the buffers (``trainable=False``), in declaration order."""
        return _offsets([e for e in self.params if not e[2].trainable])

    def minimums(self) -> dict[str, float]:
        """{name: least value} of the parameters and buffers that declare one (``Param.minimum``)."""
        return {name: prm.minimum for _, name, prm in self.params if prm.minimum is not None}

    def layer_spans(self) -> list[list[tuple[int, int]]]:
        """Per layer, the (start, stop) ranges of the flat parameter buffer its trainable parameters fill.

        At most two per layer: ``layout`` puts every regularized parameter
        first, layer by layer, then the others, so a layer's regularized
        parameters are one contiguous range and its others a second one
        (empty ranges are left out; a layer without parameters has none).
        Consecutive layers' ranges in each part are adjacent.
        """
        spans: list[list[tuple[int, int]]] = [[] for _ in self.layers]
        layer_of = {name: li for li, name, _ in self.params}
        for name, _, off, size in self.layout():  # in buffer order: a layer's next range starts where one ended
            mine = spans[layer_of[name]]
            if mine and mine[-1][1] == off:
                mine[-1] = (mine[-1][0], off + size)
            elif size:
                mine.append((off, off + size))
        return spans

    @property
    def n_regularized(self) -> int:
        return sum(_count(p) for _, _, p in self.params if p.regularize)

    @property
    def size(self) -> int:
        """Trainable parameters: the length of the flat parameter buffer."""
        return sum(_count(p) for _, _, p in self.params if p.trainable)

    n_trainable = size

    @property
    def buffer_size(self) -> int:
        return sum(_count(p) for _, _, p in self.params if not p.trainable)

    def init_params(self, seed: int) -> numpy.ndarray:
        """The initial flat float32 buffer (host), the same for every replica of one seed."""
        return self._init(self.layout(), self.size, numpy.random.default_rng(seed))

    def init_buffers(self) -> numpy.ndarray:
        """The initial flat float32 buffers (host): constants (moving variance 1, moving mean 0)."""
        return self._init(self.buffer_layout(), self.buffer_size, None)

    def _init(self, layout, size: int, rng) -> numpy.ndarray:
        flat = numpy.zeros(size, dtype=numpy.float32)
        inits = {name: prm.init for _, name, prm in self.params}
        for name, shape, off, size in layout:  # fixed order: reproducible
            kind, _, arg = inits[name].partition(":")
            if kind in ("truncated_normal", "normal") and rng is not None:
                draw = truncated_normal if kind == "truncated_normal" else _normal
                flat[off : off + size] = draw(rng, size, float(arg))
            elif kind == "constant":
                flat[off : off + size] = float(arg)
            elif kind != "zeros":
                raise UserError(f"parameter {name}: unknown initializer {inits[name]!r}"
                                + (" (buffers take zeros or constant:<value>)" if rng is None else ""))
        return flat


def _count(prm: Param) -> int:
    return int(numpy.prod(prm.shape))


def _offsets(entries) -> list[tuple[str, tuple, int, int]]:
    out, off = [], 0
    for _, name, prm in entries:
        out.append((name, tuple(prm.shape), off, _count(prm)))
        off += _count(prm)
    return out


def _normal(rng: numpy.random.Generator, size: int, stddev: float) -> numpy.ndarray:
    """Normal(0, stddev) samples, not truncated (He et al.'s initialization)."""
    return (rng.standard_normal(size) * stddev).astype(numpy.float32)


def truncated_normal(rng: numpy.random.Generator, size: int, stddev: float) -> numpy.ndarray:
    """Normal(0, stddev) samples, re-drawn while beyond 2 stddev (TF's truncated_normal)."""
    out = rng.standard_normal(size)
    bad = numpy.abs(out) > 2.0
    while bad.any():
        out[bad] = rng.standard_normal(int(bad.sum()))
        bad = numpy.abs(out) > 2.0
    return (out * stddev).astype(numpy.float32)
