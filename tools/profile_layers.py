"""Where one CPU tower's forward/backward time goes: per layer, and per kind of work.

    python tools/profile_layers.py --model resnet20 --batch 32 --shape 32,32,3
    python tools/profile_layers.py --model lenet5 --batch 50
    python tools/profile_layers.py --model mlp --batch 100

One tower (a ``Replica`` on NumPy), BLAS limited to ``--blas-threads`` (1: what
each of 2 CPU towers gets on a 2-core machine), random input of the model's
shape, ``--steps`` timed steps after 3 warm-up steps.  Printed, in ms per step:

* each top-level layer's forward and backward (a ``Residual`` block is one row:
  its convolutions, batch norms, ReLUs and add together), plus the loss;
* the same step split by kind of work: ``gemm`` (``towers.ops.gemm``: every
  matmul of Dense and Conv2D), ``copies`` (im2col, col2im, pads and crops:
  ``towers.ops.im2col``'s ``im2col``, ``run_im2col``, ``col2im``, ``padded``,
  ``crop``, as the layers call them) and the
  rest (elementwise passes and reductions: bias, ReLU, batch norm, pooling,
  the residual add, softmax).  A kernel called inside another counts once, for
  the outer one.

The phases outside a tower's step (all-reduce, optimizer, EMA) come from the
trainer's own ``--profile``; this tool times what it cannot split.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from towers.devices.cpu_threads import set_blas_threads  # noqa: E402
from towers.nn import conv, layers, normalization, pooling  # noqa: E402
from towers.nn.models import build_model  # noqa: E402
from towers.nn.replica import Replica  # noqa: E402
from towers.ops import forms  # noqa: E402

KINDS = {"gemm": "gemm", "im2col": "copies", "run_im2col": "copies", "col2im": "copies",
         "padded": "copies", "crop": "copies"}


class Clock:
    """Seconds per key; ``nested`` keeps an inner timed kernel from counting twice."""

    def __init__(self):
        self.acc: dict = {}
        self.local = threading.local()

    def add(self, key, dt):
        self.acc[key] = self.acc.get(key, 0.0) + dt

    def wrap(self, fn, key, nested=False):
        def timed(*args, **kw):
            depth = getattr(self.local, "depth", 0)
            if nested and depth:
                return fn(*args, **kw)
            self.local.depth = depth + (1 if nested else 0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.add(key, time.perf_counter() - t0)
                self.local.depth = depth
        return timed


def profile(model_name: str, shape: tuple, batch: int, steps: int, blas_threads: int,
            cpu_kernels: str = "auto") -> tuple[dict, float]:
    """(ms per step per key, ms per whole step) of one tower's ``loss_and_grads``."""
    model = build_model(model_name, shape, 10)
    rep = Replica(model, numpy)
    rep.set_params(model.init_params(0))
    # As CPU towers get them (towers.step.tower.build_towers), except that auto loads them for any model here.
    cpu_forms = forms.host(cpu_kernels)
    rng = numpy.random.default_rng(0)
    x = rng.random((batch,) + shape, dtype=numpy.float32)
    y = rng.integers(0, 10, batch).astype(numpy.int32)
    clock = Clock()
    for i, layer in enumerate(model.layers):
        label = f"{i:2d} {type(layer).__name__} {getattr(layer, 'scope', '') or ''}".rstrip()
        layer.forward = clock.wrap(layer.forward, (label, "forward"))
        layer.backward = clock.wrap(layer.backward, (label, "backward"))
        for inner in getattr(layer, "layers", ()):  # a Residual's body and shortcut: summed by kind of layer
            kind = f"   blocks' {type(inner).__name__}"
            inner.forward = clock.wrap(inner.forward, (kind, "forward"))
            inner.backward = clock.wrap(inner.backward, (kind, "backward"))
    for module in (conv, layers, normalization, pooling):  # the kernels as the layers call them
        for name, kind in KINDS.items():
            if hasattr(module, name):
                setattr(module, name, clock.wrap(getattr(module, name), ("kind", kind), nested=True))
    limit = set_blas_threads(blas_threads)
    with cpu_forms.active():
        for _ in range(3):
            rep.loss_and_grads(x, y, 1e-4, False)
        clock.acc.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            rep.loss_and_grads(x, y, 1e-4, False)
        total = (time.perf_counter() - t0) * 1e3 / steps
    limit.restore_original_limits()
    return {k: v * 1e3 / steps for k, v in clock.acc.items()}, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--shape", default="28,28", help="one example's shape, H,W or H,W,C")
    ap.add_argument("--batch", type=int, default=100, help="one tower's batch")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--blas-threads", type=int, default=1)
    ap.add_argument("--cpu-kernels", default="auto", choices=forms.MODES,
                    help="the ops' compiled numba loops (auto, numba) or NumPy's passes (numpy)")
    a = ap.parse_args(argv)
    shape = tuple(int(s) for s in a.shape.split(","))
    ms, total = profile(a.model, shape, a.batch, a.steps, a.blas_threads, a.cpu_kernels)
    from threadpoolctl import threadpool_info

    blas = [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')}" for i in threadpool_info()
            if i.get("user_api") == "blas"]
    print(f"{a.model}, batch {a.batch} x {shape}, {a.blas_threads} BLAS thread(s), {', '.join(blas)}; "
          f"ms per step over {a.steps} steps")
    print(f"| {'layer':<32} | {'forward':>8} | {'backward':>8} |")
    print(f"| {'-' * 32} | {'-' * 8} | {'-' * 8} |")
    labels = sorted({k[0] for k in ms if k[0] != "kind"})
    for label in labels:
        print(f"| {label:<32} | {ms.get((label, 'forward'), 0):8.2f} | {ms.get((label, 'backward'), 0):8.2f} |")
    if any(label.startswith("   ") for label in labels):  # what the blocks do besides their layers
        own = [sum(ms.get((label, ph), 0) * (-1 if label.startswith("   ") else 1) for label in labels
                   if "Residual" in label or label.startswith("   ")) for ph in ("forward", "backward")]
        print(f"| {'   blocks: the add, ReLU, copies':<32} | {own[0]:8.2f} | {own[1]:8.2f} |")
    in_layers = sum(v for k, v in ms.items() if k[0] != "kind" and not k[0].startswith("   "))
    print(f"| {'loss, L2 and the rest':<32} | {total - in_layers:8.2f} | {'':>8} |")
    gemm, copies = ms.get(("kind", "gemm"), 0.0), ms.get(("kind", "copies"), 0.0)
    print(f"step {total:.2f} ms: gemm {gemm:.2f} ({gemm / total:.0%}), copies {copies:.2f} ({copies / total:.0%}), "
          f"elementwise and the rest {total - gemm - copies:.2f} ({(total - gemm - copies) / total:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
