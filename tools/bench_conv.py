"""One convolution layer at a time on a GPU: towers' im2col form, cuDNN in float32 and bfloat16, and PyTorch.

    python tools/bench_conv.py [--batch 128] [--iters 50] [--json OUT.json]

For each 3x3 convolution shape of ResNet-20 on 32x32x3 images (batch
``--batch``), the time of one forward, one weight gradient and one input
gradient, side by side in one process on GPU 0:

* ``im2col``: towers' ``Conv2D`` forward and backward with ``gpu_conv`` im2col
  (an im2col kernel and cuBLAS GEMMs; backward's split is not separable, so
  its row gives forward and forward + backward);
* ``cudnn fp32``/``cudnn bf16``: ``towers.devices.cudnn`` on float32 or bfloat16
  operands (NHWC activations, KRSC kernels, float32 accumulation; the layer's
  copies between its HWIO kernel and KRSC are not in these figures);
* ``torch fp32``/``torch bf16``: ``torch.nn.functional.conv2d`` and its two
  gradients (``torch.ops.aten.convolution_backward``) on channels-last tensors,
  cuDNN with ``benchmark=True`` (a reference, imported only here; rows skipped
  without torch).

TF32 is off everywhere.  Times are CUDA-event milliseconds per call, the mean
of ``--iters`` calls after 5 warm-up calls; the ratios are towers' cuDNN form
over PyTorch's of the same precision (lower is faster).  Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from towers.devices import cudnn  # noqa: E402
from towers.nn.conv import Conv2D  # noqa: E402
from towers.nn.layers import Workspace  # noqa: E402

# ResNet-20's convolutions: (H, W, C in, F out, stride), each once however often the network repeats it.
SHAPES = [(32, 32, 3, 16, 1), (32, 32, 16, 16, 1), (32, 32, 16, 32, 2), (16, 16, 32, 32, 1),
          (16, 16, 32, 64, 2), (8, 8, 64, 64, 1)]


def timed(cupy, fn, iters: int) -> float:
    for _ in range(5):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / iters


def towers_rows(cupy, shape, batch: int, iters: int) -> dict:
    h, w, c, f, s = shape
    layer = Conv2D("c", f, 3, padding=1, stride=s, bias=False, stddev="he")
    layer.build((h, w, c))
    rng = numpy.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((batch, h, w, c), dtype=numpy.float32))
    wt = cupy.asarray(rng.standard_normal((3, 3, c, f), dtype=numpy.float32) * 0.1)
    ho, wo = layer.out_hw
    dy = cupy.asarray(rng.standard_normal((batch, ho, wo, f), dtype=numpy.float32))
    out = {}  # outside any forms' scope: the im2col form (towers.ops.forms.NUMPY)
    ws, g = Workspace(cupy), {"weights": cupy.empty_like(wt)}
    p = {"weights": wt}
    out["im2col fwd"] = timed(cupy, lambda: layer.forward(p, x, ws), iters)
    out["im2col fwd+bwd"] = timed(cupy, lambda: (layer.forward(p, x, ws), layer.backward(p, g, dy, ws, True)), iters)
    pad, post = layer.pad, layer.post_pad
    for name, dt in (("fp32", numpy.float32), ("bf16", _bf16())):
        if dt is None:
            continue
        try:
            xx, ww, dd = x.astype(dt), cupy.ascontiguousarray(wt.transpose(3, 0, 1, 2)).astype(dt), dy.astype(dt)
        except Exception as e:  # noqa: BLE001 - a CuPy without bfloat16
            out[f"cudnn {name}"] = f"no {name} arrays in CuPy: {type(e).__name__}: {e}"
            continue
        yy, dw, dx = cupy.empty_like(dd), cupy.empty_like(ww), cupy.empty_like(xx)
        try:
            out[f"cudnn {name} fwd"] = timed(cupy, lambda: cudnn.conv_forward(xx, ww, yy, pad, post, s), iters)
            out[f"cudnn {name} wgrad"] = timed(cupy, lambda: cudnn.conv_weight_grad(xx, dd, dw, pad, post, s), iters)
            out[f"cudnn {name} dgrad"] = timed(cupy, lambda: cudnn.conv_data_grad(dd, ww, dx, pad, post, s), iters)
        except cudnn.Unsupported as e:
            out[f"cudnn {name}"] = f"refused: {e}"
    return out


def torch_rows(shape, batch: int, iters: int) -> dict:
    try:
        import torch
    except ImportError:
        return {}
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    h, w, c, f, s = shape
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = torch.randn(batch, c, h, w, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
        wt = torch.randn(f, c, 3, 3, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
        y = torch.nn.functional.conv2d(x, wt, stride=s, padding=1)
        dy = torch.randn_like(y)

        def bwd(mask):
            return lambda: torch.ops.aten.convolution_backward(dy, x, wt, None, [s, s], [1, 1], [1, 1], False, [0, 0],
                                                               1, mask)
        cupy_like = _TorchTimer(torch)
        out[f"torch {name} fwd"] = timed(cupy_like, lambda: torch.nn.functional.conv2d(x, wt, stride=s, padding=1),
                                         iters)
        out[f"torch {name} wgrad"] = timed(cupy_like, bwd([False, True, False]), iters)
        out[f"torch {name} dgrad"] = timed(cupy_like, bwd([True, False, False]), iters)
    return out


class _TorchTimer:
    """The two calls of ``timed`` on torch's CUDA events."""

    def __init__(self, torch):
        self.torch = torch
        self.cuda = self

    def Event(self):  # noqa: N802 - cupy's name
        return self.torch.cuda.Event(enable_timing=True)

    def get_elapsed_time(self, a, b):
        return a.elapsed_time(b)


def _bf16():
    try:
        import ml_dtypes

        return ml_dtypes.bfloat16
    except ImportError:
        return None


def cuda_and_cudnn() -> str | None:
    """Why cuDNN's convolutions cannot run here (no CUDA device, cuDNN not usable), or None."""
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        return f"no CUDA device ({type(e).__name__}: {e}); run it on a GPU machine"
    return cudnn.available() or None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    why = cuda_and_cudnn()
    if why:
        print(f"bench_conv: error: {why}", file=sys.stderr)
        return 2
    import cupy

    results = []
    for shape in SHAPES:
        row = {"shape": "HxWxC->F/s {}x{}x{}->{}/{}".format(*shape)}
        row.update(towers_rows(cupy, shape, a.batch, a.iters))
        row.update(torch_rows(shape, a.batch, a.iters))
        results.append(row)
        print(row["shape"] + ": " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in row.items() if k != "shape"), flush=True)
    print("\nms per call summed over the shapes (each shape once); towers cudnn / torch, same precision:")
    for prec in ("fp32", "bf16"):
        for op in ("fwd", "wgrad", "dgrad"):
            ours = sum(r.get(f"cudnn {prec} {op}", float("nan")) for r in results)
            ref = sum(r.get(f"torch {prec} {op}", float("nan")) for r in results)
            print(f"  {prec} {op}: cudnn {ours:.3f} ms, torch {ref:.3f} ms, ratio {ours / ref:.2f}")
    i2c = sum(r["im2col fwd+bwd"] for r in results)
    cu = sum(r.get(f"cudnn fp32 {op}", float("nan")) for r in results for op in ("fwd", "wgrad", "dgrad"))
    print(f"  fp32 forward + both gradients: im2col {i2c:.3f} ms, cudnn {cu:.3f} ms, ratio {cu / i2c:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
