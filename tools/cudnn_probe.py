"""cuDNN one operation at a time: every convolution shape of ResNet-20 and the CIFAR-10 model, against im2col.

    python -m tools.cudnn_probe [--models resnet20,cifar10] [--batch 128] [--json OUT.json]   # on a GPU
    python -m tools.cudnn_probe --describe                                                    # anywhere

The shapes come from the models themselves (``conv_shapes``: each ``Conv2D``
of the built model, each distinct shape once, with the layers that have it):
ResNet-20's 3x3 convolutions at stride 1 and 2 (padding 1 on every side) and
the CIFAR-10 model's 5x5 ones (TensorFlow's SAME padding).

On a GPU, for each shape and each of forward (``fprop``), input gradient
(``dgrad``) and weight gradient (``wgrad``): ``towers.devices.cudnn`` on float32
operands (NHWC activations, the KRSC kernel, TF32 off, deterministic engines)
against the layer's im2col form (``Conv2D`` with ``gpu_conv`` im2col: an
im2col kernel and cuBLAS GEMMs, on the same random inputs); the relative error
``max |cudnn - im2col| / max |im2col|``, the engine cuDNN chose and its
workspace in bytes (``cudnn.built``), or the reason cuDNN refused the shape.
One line per operation, a JSON file with ``--json``.  Exit status 0 when every
operation ran on cuDNN within ``TOLERANCE``; 1 when one was refused or off;
2 without a GPU or without cuDNN (one line on stderr).

``--describe`` runs without a GPU: it only describes each graph with the
installed frontend (``cudnn.describe``, up to the handle), which catches a
frontend whose API moved; exit 0 when every description was made, 1 otherwise,
2 when the frontend does not import.  A few seconds on the whole.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from towers.devices import cudnn  # noqa: E402
from towers.nn.conv import Conv2D  # noqa: E402
from towers.nn.layers import Workspace  # noqa: E402
from towers.nn.models import build_model  # noqa: E402

MODELS = {"resnet20": (32, 32, 3), "cifar10": (24, 24, 3)}  # model -> example shape (the benchmark's)
OPS = ("fprop", "dgrad", "wgrad")
TOLERANCE = 1e-4  # relative error allowed: float32 sums in another order (K up to 5*5*64 terms)


def _convs(layers):
    for layer in layers:
        if isinstance(layer, Conv2D):
            yield layer
        yield from _convs(getattr(layer, "layers", ()))


def conv_shapes(model: str, batch: int = 128) -> list:
    """Each distinct convolution of ``model`` (built for its example shape) as a dict: ``x`` (n, h, w, c),
    ``w`` (f, kh, kw, c) KRSC, ``y`` (n, ho, wo, f), ``pre``/``post`` padding, ``stride`` and ``layers`` (the
    scopes of the layers of that shape), in the order the network first meets them."""
    net = build_model(model, MODELS[model], 10)
    net.build(MODELS[model])
    shapes: dict = {}
    for conv in _convs(net.layers):
        h, w, c = conv.in_hwc
        ho, wo = conv.out_hw
        key = ((batch, h, w, c), (conv.filters, conv.k, conv.k, c), (batch, ho, wo, conv.filters),
               tuple(conv.pad), tuple(conv.post_pad), conv.stride)
        shapes.setdefault(key, []).append(conv.scope)
    return [dict(x=x, w=w, y=y, pre=pre, post=post, stride=s, layers=names)
            for (x, w, y, pre, post, s), names in shapes.items()]


def _label(model: str, s: dict) -> str:
    (n, h, w, c), f, k = s["x"], s["w"][0], s["w"][1]
    return f"{model} {h}x{w}x{c} -> {f}, {k}x{k}/{s['stride']}"


def describe_all(models, batch: int = 128) -> list:
    """Every graph description (``cudnn.describe``, no handle) of ``models``' convolutions: a list of dicts
    (``model``, ``shape``, ``op``, ``error``: None or the frontend's error as one line)."""
    out = []
    for model in models:
        for s in conv_shapes(model, batch):
            for op in OPS:
                try:
                    cudnn.describe(op, s["x"], s["w"], s["y"], s["pre"], s["post"], s["stride"], (16, 16, 16),
                                   numpy.float32)
                    error = None
                except Exception as e:  # noqa: BLE001 - reported, one line each
                    error = f"{type(e).__name__}: {e}".splitlines()[0]
                out.append(dict(model=model, shape=_label(model, s), op=op, error=error))
    return out


def _rel(a, b) -> float:
    scale = float(abs(b).max())
    return float(abs(a - b).max()) / (scale or 1.0)


def probe_shape(cupy, model: str, s: dict) -> list:
    """The three operations of one shape on cuDNN against im2col (module doc): one dict per operation."""
    n, h, w, c = s["x"]
    f, k = s["w"][0], s["w"][1]
    layer = Conv2D("probe", f, k, padding=s["pre"][0] if s["pre"] == s["post"] else "SAME", stride=s["stride"],
                   bias=False)
    layer.build((h, w, c))
    assert (tuple(layer.pad), tuple(layer.post_pad)) == (s["pre"], s["post"]), "the probe's layer pads otherwise"
    rng = numpy.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal(s["x"], dtype=numpy.float32))
    hwio = cupy.asarray(rng.standard_normal((k, k, c, f), dtype=numpy.float32) * 0.1)
    dy = cupy.asarray(rng.standard_normal(s["y"], dtype=numpy.float32))
    # The reference: the im2col form, which runs outside any forms' scope (towers.ops.forms.NUMPY).
    ws, g = Workspace(cupy), {"weights": cupy.empty_like(hwio)}
    y_ref = layer.forward({"weights": hwio}, x, ws).copy()
    dx_ref = layer.backward({"weights": hwio}, g, dy, ws, True).copy()
    dw_ref = g["weights"].transpose(3, 0, 1, 2).copy()  # KRSC, as cuDNN's
    krsc = cupy.ascontiguousarray(hwio.transpose(3, 0, 1, 2))
    runs = {"fprop": (cudnn.conv_forward, x, krsc, cupy.empty(s["y"], numpy.float32), y_ref),
            "dgrad": (cudnn.conv_data_grad, dy, krsc, cupy.empty(s["x"], numpy.float32), dx_ref),
            "wgrad": (cudnn.conv_weight_grad, x, dy, cupy.empty(s["w"], numpy.float32), dw_ref)}
    rows = []
    for op, (run, a, b, out, ref) in runs.items():
        row = dict(model=model, shape=_label(model, s), op=op, layers=s["layers"])
        n_built = len(cudnn.built())
        t0 = time.perf_counter()
        try:
            run(a, b, out, s["pre"], s["post"], s["stride"])
            cupy.cuda.get_current_stream().synchronize()
            row["rel_error"] = _rel(out, ref)
            row["ok"] = row["rel_error"] <= TOLERANCE
        except cudnn.Unsupported as e:
            row.update(ok=False, refused=str(e))
        except Exception as e:  # noqa: BLE001 - an execution error: reported, the next operation still runs
            row.update(ok=False, error=f"{type(e).__name__}: {e}".splitlines()[0])
        row["seconds"] = round(time.perf_counter() - t0, 3)  # the first call: the graph's build included
        made = cudnn.built()[n_built:]
        if made and "engine" in made[-1]:
            row.update(engine=made[-1]["engine"], workspace=made[-1]["workspace"])
        rows.append(row)
    return rows


def _line(r: dict) -> str:
    head = f"{r['shape']} {r['op']}: "
    if "refused" in r:
        return head + f"REFUSED {r['refused']}"
    if "rel_error" in r:
        verdict = "ok" if r["ok"] else f"OFF (tolerance {TOLERANCE:g})"
        return (head + f"relative error {r['rel_error']:.2e} {verdict}, engine {r.get('engine', 'n/a')}, "
                f"workspace {r.get('workspace', 'n/a')} B, {r['seconds']:.2f} s")
    return head + (f"FAILED {r['error']}" if r.get("error") else "described")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + line
        self.exit(2, f"cudnn_probe: error: {message} (see --help)\n")


def main(argv=None) -> int:
    ap = _Parser(prog="cudnn_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, among {', '.join(MODELS)}")
    ap.add_argument("--batch", type=int, default=128, help="images per batch (default 128)")
    ap.add_argument("--describe", action="store_true", help="only describe each graph (no GPU needed)")
    ap.add_argument("--json", help="also write every row to this file")
    a = ap.parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    if not models or set(models) - set(MODELS):
        ap.error(f"--models {a.models!r}: use some of {', '.join(MODELS)}")
    try:
        cudnn.frontend()
    except Exception as e:  # noqa: BLE001
        print(f"cudnn_probe: error: the cuDNN frontend does not import ({type(e).__name__}: {e}); "
              "pip install nvidia-cudnn-frontend", file=sys.stderr)
        return 2
    if a.describe:
        rows = describe_all(models, a.batch)
    else:
        from tools.bench_conv import cuda_and_cudnn

        why = cuda_and_cudnn()
        if why:
            print(f"cudnn_probe: error: {why} (or pass --describe)", file=sys.stderr)
            return 2
        import cupy

        rows = []
        for model in models:
            for s in conv_shapes(model, a.batch):
                for r in probe_shape(cupy, model, s):
                    rows.append(r)
                    print(_line(r), flush=True)
    if a.describe:
        for r in rows:
            print(_line(r), flush=True)
    bad = [r for r in rows if not r.get("ok", r.get("error") is None)]
    print(f"cudnn_probe: frontend {cudnn._version()}: {len(rows) - len(bad)} of {len(rows)} operations "
          + ("described" if a.describe else f"on cuDNN within {TOLERANCE:g} of im2col"), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
