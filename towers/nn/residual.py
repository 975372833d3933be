"""Residual blocks (He et al. 2016): ``Residual(body, shortcut)`` and the option-A shortcut.

``Residual(body, shortcut)`` computes ``relu(body(x) + shortcut(x))``; the body
is a list of layers, the shortcut one of

* ``None``: the identity (the body must keep the shape);
* ``"A"``: He et al.'s option A for CIFAR, ``PadShortcut``: every stride-th
  pixel, zero channels appended up to the body's width (no parameters);
* ``"projection"``: option B, a 1x1 convolution at the stride (no bias) and
  a ``BatchNorm``, scoped ``shortcut`` and ``shortcut_bn``;
* a layer or a list of layers of your own.

Its layers are built, named and run by the block: a nested layer's
parameters are named ``<block scope>/<layer scope>/<name>`` and each nested
layer has its own workspace (``ws.child(i)``), so nested layers follow the
layer API unchanged.  Backward: the ReLU's mask is applied to the incoming
gradient in place; the body and then the shortcut take it (the body a copy
when its last layer may write into its ``dy``: not ``keeps_dy``); the input
gradient is their sum.
"""
from __future__ import annotations

import dataclasses

from towers.errors import UserError
from towers.nn.conv import Conv2D
from towers.nn.layers import Exported, Layer
from towers.nn.normalization import BatchNorm
from towers.nn.windows import nhwc
from towers.ops import activation
from towers.ops.im2col import zeroed


class PadShortcut(Layer):
    """He et al.'s option A: ``x[:, ::stride, ::stride, :]`` with zero channels appended up to ``channels``."""

    def __init__(self, channels: int, stride: int):
        self.channels, self.stride = int(channels), int(stride)

    def build(self, in_shape):
        h, w, c = self.in_hwc = nhwc(tuple(in_shape), "PadShortcut")
        if self.channels < c:
            raise UserError(f"PadShortcut: cannot pad {c} channels down to {self.channels}")
        s = self.stride
        return [], (-(-h // s), -(-w // s), self.channels)

    def forward(self, p, x, ws):
        n, (h, w, c), s = x.shape[0], self.in_hwc, self.stride
        y = zeroed(ws, "y", (n, -(-h // s), -(-w // s), self.channels), x.dtype)
        y[..., :c] = x.reshape(n, h, w, c)[:, ::s, ::s, :]  # the appended channels stay 0
        ws.saved["x_shape"] = x.shape
        return y

    def backward(self, p, g, dy, ws, need_dx):
        if not need_dx:
            return None
        n, (h, w, c), s = dy.shape[0], self.in_hwc, self.stride
        dx = zeroed(ws, "dx", (n, h, w, c), dy.dtype)  # pixels between the strides stay 0
        dx[:, ::s, ::s, :] = dy[..., :c]
        return dx.reshape(ws.saved["x_shape"])


class Residual(Layer):
    """``relu(body(x) + shortcut(x))`` (see the module doc); ``scope`` prefixes its layers' names."""

    def __init__(self, body, shortcut=None, scope: str | None = None):
        body = list(body) if isinstance(body, (list, tuple)) else [body]
        if not body or not all(isinstance(l, Layer) for l in body):
            raise UserError(f"Residual {scope or ''}: the body must be a non-empty list of layers")
        if not (shortcut is None or shortcut in ("A", "projection") or isinstance(shortcut, (Layer, list, tuple))):
            raise UserError(f"Residual {scope or ''}: shortcut must be None, 'A', 'projection', a layer or a "
                            f"list of layers, got {shortcut!r}")
        self.body, self.shortcut, self.scope = body, shortcut, scope

    def build(self, in_shape):
        in_shape = tuple(in_shape)
        who = f"Residual {self.scope or ''}".strip()
        params, names, out = [], [], in_shape
        self._names = []  # per nested layer: [(local name, name inside the block)]
        for layer in self.body:
            out = self._build_child(layer, out, params, names)
        self.short_layers = self._shortcut_layers(in_shape, out, who)
        s_out = in_shape
        for layer in self.short_layers:
            s_out = self._build_child(layer, s_out, params, names)
        if tuple(s_out) != tuple(out):
            raise UserError(f"{who}: the body gives per-example shape {tuple(out)}, the shortcut {tuple(s_out)}: "
                            "use shortcut 'A' or 'projection' where the body changes the shape")
        self.layers = self.body + self.short_layers
        self._has_short_params = any(self._names[len(self.body):])
        return params, tuple(out)

    def compiled_rounding(self, input_grad: bool = True) -> bool:
        """Whether one of its layers (each takes its input gradient) rounds otherwise through the compiled CPU
        forms (``Layer``); built first."""
        return any(layer.compiled_rounding() for layer in self.layers)

    def convolves(self) -> bool:
        return any(layer.convolves() for layer in self.layers)

    def draws_on_host(self) -> bool:
        return any(layer.draws_on_host() for layer in self.layers)

    def exports(self, framework):
        """Its layers' declarations, under their names inside the block (``conv1/weights``).  Each is handed
        the block's input order (``Layer.export_order``): none for image blocks, the only kind towers builds."""
        out = {}
        for layer, names in zip(self.layers, self._names):
            theirs = layer.exports(framework)
            for local, inside in names:
                if local in theirs:
                    found = theirs[local]
                    out[inside] = tuple(Exported(f"{layer.scope}/{e.name}" if layer.scope else e.name, e.convert)
                                        for e in (found if isinstance(found, tuple) else (found,)))
        return out

    def _build_child(self, layer, shape, params, names):
        prms, shape = layer.build(shape)
        local = []
        for prm in prms:
            name = f"{layer.scope}/{prm.name}" if layer.scope else prm.name
            if name in names:
                raise UserError(f"Residual {self.scope or ''}: parameter {name!r} declared twice: give layers "
                                "distinct scopes")
            names.append(name)
            params.append(dataclasses.replace(prm, name=name))
            local.append((prm.name, name))
        self._names.append(local)
        return shape

    def _shortcut_layers(self, in_shape, out, who):
        sc = self.shortcut
        if sc is None:
            return []
        if isinstance(sc, Layer):
            return [sc]
        if isinstance(sc, (list, tuple)):
            return list(sc)
        if len(out) != 3:
            raise UserError(f"{who}: shortcut {sc!r} needs an image-shaped body output, got {tuple(out)}")
        (h, w, _), (ho, wo) = nhwc(in_shape, who), tuple(out[:2])
        s = -(-h // ho)
        if -(-h // s) != ho or -(-w // s) != wo:
            raise UserError(f"{who}: no stride takes {h}x{w} to the body's {ho}x{wo}")
        if sc == "A":
            return [PadShortcut(out[2], s)]
        return [Conv2D("shortcut", out[2], 1, padding="same", stride=s, bias=False, stddev="he", regularize=True),
                BatchNorm("shortcut_bn")]

    def _parts(self, d, ws, key):
        """``d`` (this block's name -> view) split per nested layer, cached per dict."""
        hit = ws.saved.get(key)
        if hit is None or hit[0] is not d:
            hit = ws.saved[key] = (d, [{k: d[n] for k, n in names if n in d} for names in self._names])
        return hit[1]

    def forward(self, p, x, ws):
        parts = self._parts(p, ws, "p_parts")
        nb = len(self.body)
        h = x
        for i, layer in enumerate(self.body):
            h = layer.forward(parts[i], h, ws.child(i))
        s = x
        for i, layer in enumerate(self.short_layers, nb):
            s = layer.forward(parts[i], s, ws.child(i))
        y = ws.array("y", h.shape, h.dtype)
        activation.add_relu(h, s.reshape(h.shape), y)
        ws.saved["y"] = y
        return y

    def backward(self, p, g, dy, ws, need_dx):
        nb = len(self.body)
        pp, gp = self._parts(p, ws, "p_parts"), self._parts(g, ws, "g_parts")
        y = ws.saved["y"]
        activation.relu_backward(y, dy)  # dy is the next layer's scratch: safe in place
        d = dy
        if not self.body[-1].keeps_dy:  # it may write into its dy, which the shortcut reads after it
            d = ws.array("d_body", y.shape, y.dtype)
            d[...] = dy
        for i in range(nb - 1, -1, -1):
            d = self.body[i].backward(pp[i], gp[i], d, ws.child(i), need_dx or i > 0)
        ds = dy
        if need_dx or self._has_short_params:  # a projection's weights need their gradient regardless
            for i in range(len(self.short_layers) - 1, -1, -1):
                j = nb + i
                ds = self.short_layers[i].backward(pp[j], gp[j], ds, ws.child(j), need_dx or i > 0)
        if not need_dx:
            return None
        d += ds.reshape(d.shape)
        return d
