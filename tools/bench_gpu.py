"""towers on a GPU against PyTorch eager on the same GPU, side by side, in one run.

    python tools/bench_gpu.py                      # on a machine with a CUDA GPU
    python tools/bench_gpu.py --quick              # tiny CPU smoke run (no GPU needed)
    python tools/bench_gpu.py --json OUT.json --verbose
    python tools/bench_gpu.py --models resnet20,resnet56,cifar10 --no-main-job [--torch-compile]

What one run measures (``--models``, default MLP,LeNet-5; synthetic uint8 data
of each model's shape, 10 learnable classes):

* towers, MLP 784-500-10, batch 100 per tower, the trainer's defaults (lr 0.8,
  L2 1e-4, EMA 0.99) on MNIST-shaped data (28x28): 1 tower on GPU 0; 2 towers
  sharing GPU 0 (global 200); N towers on N GPUs when there are several GPUs
  (skipped with a note otherwise);
* LeNet-5 the same way (lr 0.01, momentum 0.9, as the README trains it);
* the convolutional networks (``--models ResNet-20,ResNet-56,CIFAR-10``, not
  in the default run), batch 128 per tower, SGD at towers' defaults for each
  (``towers.nn.models.MODELS``: ResNets lr 0.1, momentum 0.9, L2 1e-4 on
  convolution and fc weights; CIFAR-10 lr 0.1, plain SGD (momentum 0, the
  tutorial's), L2 0.004 on local3 and local4): ResNet-20 and ResNet-56 (He et
  al.: batch norm, option-A shortcuts) on 32x32x3, TensorFlow's CIFAR-10
  tutorial model (LRN, 3x3 max-pools at stride 2) on 24x24x3; towers in
  float32 (towers has no bf16 yet: that row says "not implemented");
  ``--conv-steps`` timed steps per round, 5 warm-up steps, 3 profiled steps;
* PyTorch on the same GPU (a reference, never a dependency: imported only
  in its own subprocess, rows skipped when absent): the same networks (their
  trainable and L2 parameter counts are checked against towers' models when
  each worker starts: a mismatch fails the row), the same initializers,
  SGD with the same L2 on the same weights (SGD's ``weight_decay``, which is
  the gradient of ``S * sum(w**2) / 2``), an EMA of every parameter each step
  (``torch._foreach_lerp_``, one multi-tensor op), at the global batch of 1
  tower and of 2 (100 and 200; 128 and 256 for the conv nets); cuDNN with
  ``benchmark=True`` and TF32 off (towers computes in plain float32):
  eager float32 (NCHW), and for the conv nets also eager AMP bf16
  channels-last (``torch.autocast(dtype=torch.bfloat16)``, model and input
  in ``torch.channels_last``) and, with ``--torch-compile``, ``torch.compile``
  float32 (default mode; compiling takes a minute or more per row: its first
  step, which compiles with empty inductor and Triton caches, is reported as
  compile time, never in the timed steps);
* per row: samples/s (``--steps`` steps per round, the stream synchronized only
  at the end of the round, best of ``--rounds``); host microseconds per step
  (``time.thread_time`` of the thread that issues the work, over the same
  steps); kernel launches per tower-step, memory copies per step and summed
  kernel time per step, counted by ``torch.profiler`` (CUPTI sees every CUDA
  kernel of the process, CuPy's included) over ``--profile-steps`` extra
  steps, "n/a" without torch or CUPTI; peak device memory in MiB: for towers
  the high-water mark of CuPy's default memory pool
  (``cupy.get_default_memory_pool().total_bytes()``, sampled after the first
  step, after the warm-up and after the timed rounds, the largest kept: the
  pool keeps what it once held, and towers never frees it, so this is the
  most the step's arrays held at once, rounded up to the pool's blocks, with
  any freed blocks it keeps cached; it includes the data set, which lives on
  the device: 29 MiB for the 10,000 32x32x3 images; a ``+graphs`` row adds
  its towers' graph memory pools, ``StepGraphs.pool_bytes``), for PyTorch
  ``torch.cuda.max_memory_allocated()`` over the steps after the first (the
  first holds cuDNN's algorithm search, whose trial workspaces are no part of
  a step; the caching allocator's reserved peak goes to ``--json``; its
  batches stay in pinned host memory); neither counts the CUDA context or
  library handles; "n/a" on the CPU;
* start-up of every towers row: seconds from the launch of a fresh process to
  its first completed step; with ``--startup`` also with an EMPTY CuPy kernel
  cache (``CUPY_CACHE_DIR`` a fresh directory: every kernel compiled), a cold
  run of its own before the row (the conv nets' stops after its first step),
  the row then warm in the same directory; without it the rows share one
  kernel cache (the first row compiles);
* the rows of each model in this order: PyTorch's references, then towers';
  ``estimate_seconds`` estimates a run's time before it starts (its constants
  state the measurements they come from);
* the conv nets' towers rows once per ``--gpu-conv`` form (default ``im2col,cudnn``;
  im2col alone without a GPU): "towers" is im2col and cuBLAS, "towers cudnn" the
  convolutions on cuDNN (``towers.devices.cudnn``), whose calls and any shape
  left to im2col the row reports with ``--verbose``; a form ending in
  ``+graphs`` (``im2col+graphs``, ``cudnn+graphs``) runs with ``cuda_graphs``
  (``towers.devices.cuda_graphs``), and then the MLP and LeNet-5 get an
  ``im2col+graphs`` row too; each such row says how many graphs were captured
  and launched (a failed capture always, with its reason: that row measured
  eager steps);
* with ``--host-profile``, each towers row's host time by Python function
  (cProfile over ``--profile-steps`` more steps; printed with ``--verbose``):
  where a host-bound step spends its time, attributed, not measured;
* the default main job, ``python -m towers.train --n-gpu 2`` (MLP on
  data/digits.npz, 2000 steps), as a subprocess on the GPU with a cold and a
  warm kernel cache (and warm with ``--cuda-graphs`` when a form has
  ``+graphs``), against ``taskset -c 0,1 ... --devices cpu`` (2 cores, a
  developer's machine): wall time of the whole command;
* then the ratios the "Fast on GPUs" issue targets: for the conv nets towers
  1 tower / PyTorch eager float32 b128 and towers 2 sharing / PyTorch eager
  float32 b256 (target 1.0 each), and towers float32 / PyTorch AMP bf16
  channels-last (informational: no target until towers has bf16).

Every row runs in its own subprocess (``--worker``), so CuPy's and PyTorch's
memory pools, handles and caches never meet, and start-up is a real cold start.
The timed steps reuse a ring of global batches (their row indices) drawn
before the clock starts and run ``Trainer.train_step_at`` as ``fit`` does: on
a GPU the data set lives on the device and each tower gathers its slice there
(one index copy and one kernel), on the CPU the rows are taken and staged from
host memory.  So the numbers are the trainer's step (staging included), not
the input thread.  PyTorch's rows copy each batch from pinned host memory
(already in the row's layout: NCHW for float32, NHWC viewed as channels-last
for AMP).  Nothing here is asserted: the figures are printed, with the targets.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

# -- towers' API used by this benchmark: the ONE place to edit when towers' modules move.
from towers import Config, Trainer  # noqa: E402
from towers.data.batches import BatchSource  # noqa: E402
from towers.data.loading import load_dataset  # noqa: E402
from towers.nn.models import build_model, model_defaults  # noqa: E402
from towers.files import atomic_path  # noqa: E402

BATCH = 100  # per tower for the MLP and LeNet-5, as the issue asks
CONV_BATCH = 128  # per tower for the conv nets (He et al.'s and the tutorial's batch)
RING = 32  # global batches drawn before timing, reused in turn
RESULT = "BENCH_RESULT "  # prefix of a worker's one result line
# name -> (towers --model, lr, momentum, batch per tower, example shape, data file): the MLP at the defaults,
# LeNet-5 as the README trains it, the conv nets at towers' SGD defaults (model_defaults: lr, momentum, L2).
MODELS = {
    "MLP": ("mlp", 0.8, 0.0, BATCH, (28, 28), "mnist_shaped.npz"),
    "LeNet-5": ("lenet5", 0.01, 0.9, BATCH, (28, 28), "mnist_shaped.npz"),
    "ResNet-20": ("resnet20", 0.1, 0.9, CONV_BATCH, (32, 32, 3), "cifar_shaped.npz"),
    "ResNet-56": ("resnet56", 0.1, 0.9, CONV_BATCH, (32, 32, 3), "cifar_shaped.npz"),
    "CIFAR-10": ("cifar10", 0.1, 0.0, CONV_BATCH, (24, 24, 3), "cifar24_shaped.npz"),
    # tf_cnn_benchmarks' workload: ImageNet-sized synthetic images (towers' `--data synthetic`), 1000 classes,
    # batch 64 a tower (--batch 128 for its other row), Goyal et al.'s SGD (lr 0.1, momentum 0.9).
    "ResNet-50": ("resnet50", 0.1, 0.9, 64, (224, 224, 3), "synthetic:1000"),
}
CONV = ("ResNet-20", "ResNet-56", "CIFAR-10", "ResNet-50")  # the conv nets: --conv-steps, short warm-up, AMP rows
CLASSES = {"ResNet-50": 1000}  # the others: 10
DEFAULT_MODELS = ("MLP", "LeNet-5")
CONV_WARMUP, CONV_PROFILE = 5, 3  # the conv nets' warm-up and profiled steps unless --warmup / --profile-steps


def model_names(text: str) -> list[str]:
    """``--models``: comma-separated names (ours or towers' ``--model`` names, any case) -> our names, in order.

    Raises ValueError naming the unknown ones.
    """
    known = {}
    for name, (tname, *_) in MODELS.items():
        known[name.lower()] = known[tname] = name
    out, bad = [], []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name = known.get(part.lower())
        if name is None:
            bad.append(part)
        elif name not in out:
            out.append(name)
    if bad or not out:
        raise ValueError(f"unknown model {', '.join(map(repr, bad))}" if bad else "no model named")
    return out


def load_data(model: str, path: str):
    """The data set of ``model``'s rows: its npz file, or (ResNet-50) towers' synthetic images of its shape."""
    shape = MODELS[model][4]
    if path.startswith("synthetic"):
        return load_dataset(path, image_size=",".join(map(str, shape)))
    return load_dataset(path)


def l2_of(model: str) -> float:
    """The L2 towers trains ``model`` with under SGD (its default): the PyTorch rows' ``weight_decay``."""
    return float(model_defaults(MODELS[model][0], "sgd")[1]["l2"])


def make_data(path: str, n: int, shape: tuple = (28, 28)) -> None:
    """uint8 images of ``shape`` with learnable labels.

    MNIST-shaped (28, 28) ones have about 80% background zeros, as MNIST;
    colour ones (H, W, 3) are dense, as photographs.  Labels are a fixed
    random projection of the pixels, so training at the default learning
    rate stays finite: a diverged run would time NaN arithmetic instead of
    training.
    """
    rng = numpy.random.default_rng(0)
    shape = tuple(shape)
    x = rng.integers(0, 256, (n,) + shape, dtype=numpy.uint8)
    if len(shape) == 2:
        x[rng.random((n,) + shape) < 0.8] = 0
    proj = rng.standard_normal((int(numpy.prod(shape)), 10)).astype(numpy.float32)
    y = (x.reshape(n, -1).astype(numpy.float32) @ proj).argmax(1).astype(numpy.int32)
    numpy.savez(path, x=x, y=y, x_test=x[:500], y_test=y[:500])


# -- measurements shared by the workers ---------------------------------------------


def time_steps(step, sync, steps: int, warmup: int, rounds: int, on_warm=None) -> dict:
    """Wall and host time per step: ``rounds`` rounds of ``steps``, one sync per round.

    Host time is ``time.thread_time`` of this thread (the one that issues the
    GPU work) up to the end of the last launch, before the final sync;
    ``cpu_us_per_step`` is ``time.process_time`` (every thread: PyTorch runs
    backward on a thread of its own, which thread time misses).  Both include any blocking the step does itself (a pinned buffer's event wait,
    a full launch queue), which CUDA may spin on.  The round with the lowest
    wall time is kept: on a shared machine it is the least disturbed one.
    ``on_warm`` (if given) is called after the warm-up (a memory sample).
    """
    k = 1  # step 0 was the start-up step
    for _ in range(warmup):
        step(k)
        k += 1
    sync()
    if on_warm is not None:
        on_warm()
    best, walls = None, []
    for _ in range(rounds):
        h0, c0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        for _ in range(steps):
            step(k)
            k += 1
        h1, c1 = time.thread_time(), time.process_time()
        sync()
        wall = time.perf_counter() - w0
        walls.append(wall / steps * 1e6)
        if best is None or wall < best[0]:
            best = (wall, h1 - h0, c1 - c0)
    return {"wall_us_per_step": best[0] / steps * 1e6, "host_us_per_step": best[1] / steps * 1e6,
            "cpu_us_per_step": best[2] / steps * 1e6,
            "wall_us_per_step_rounds": walls, "next_k": k}


def host_profile(step, sync, steps: int, k0: int, top: int = 30) -> list:
    """Where the host's time of ``steps`` steps goes, by Python function (cProfile), the ``top`` by own time.

    Rows ``(function, calls per step, own us per step, cumulative us per step)``; the profiler's own cost
    inflates every figure alike, so they attribute the host time, they do not measure it.
    """
    import cProfile
    import pstats

    sync()
    prof = cProfile.Profile()
    prof.enable()
    for k in range(k0, k0 + steps):
        step(k)
    sync()
    prof.disable()
    rows = []
    for (path, line, func), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        where = func if path == "~" else f"{Path(path).name}:{line}({func})"
        rows.append((where, calls / steps, own / steps * 1e6, cum / steps * 1e6))
    return sorted(rows, key=lambda r: -r[2])[:top]


def count_launches(step, sync, steps: int, k0: int, per: int) -> dict:
    """CUDA kernels, copies and kernel time of ``steps`` steps, seen by torch.profiler.

    CUPTI records every kernel of the process whichever library launched it,
    so this counts CuPy's kernels as well as PyTorch's.  ``per`` divides the
    counts (towers per step).  Returns {"na": reason} without torch or CUPTI.
    """
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {"na": "torch not installed"}
    if not torch.cuda.is_available() or ProfilerActivity.CUDA not in torch.profiler.supported_activities():
        return {"na": "no CUDA profiling (CPU run, or CUPTI missing)"}
    torch.cuda.init()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for k in range(k0, k0 + steps):
            step(k)
        sync()
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    names = Counter(e.get("name", "?") for e in kernels)
    busy = Counter()
    for e in kernels:
        busy[e.get("name", "?")] += float(e.get("dur", 0))
    n = steps * per
    return {
        "kernels": len(kernels), "profiled_steps": steps, "towers": per,
        "kernels_per_tower_step": len(kernels) / n,
        "copies_per_step": len(copies) / steps,
        "kernel_us_per_step": sum(float(e.get("dur", 0)) for e in kernels) / steps,
        "whole": len(kernels) % steps == 0,
        "names_per_step": [(name, c / steps, busy[name] / steps) for name, c in names.most_common()],
    }


def _since(t_launch: float) -> float:
    return time.time() - t_launch


# -- workers: each prints one line RESULT + JSON ---------------------------------------


def _env_worker(spec) -> dict:
    """Versions, GPUs and the cost of python + imports + CUDA init (also warms the file cache)."""
    import importlib.metadata as md

    out = {"python": sys.version.split()[0], "numpy": numpy.__version__, "gpus": []}
    try:
        import cupy

        out["cupy"] = cupy.__version__
        n = cupy.cuda.runtime.getDeviceCount()
        for i in range(n):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            out["gpus"].append(p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"]))
        if n:
            with cupy.cuda.Device(0):
                cupy.zeros(1).sum().get()  # context + one kernel (from the cache, if any)
            out["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
            out["driver"] = cupy.cuda.runtime.driverGetVersion()
        try:
            from cupy.cuda import nccl

            out["nccl"] = nccl.get_version()
        except Exception as e:  # NCCL absent: towers needs it only for several GPUs
            out["nccl"] = f"unavailable ({e.__class__.__name__}: {e})"
    except Exception as e:  # no CuPy, no driver, no device
        out["cupy_error"] = f"{e.__class__.__name__}: {e}"
    try:
        out["torch"] = md.version("torch")
    except md.PackageNotFoundError:
        out["torch"] = None
    out["startup_s"] = _since(spec["t_launch"])
    return out


def _pool_bytes(devices: list[int]) -> int:
    """The largest of CuPy's default memory pool's bytes held on each of ``devices`` (what it once held)."""
    import cupy

    pool, most = cupy.get_default_memory_pool(), 0
    for i in devices:
        with cupy.cuda.Device(i):
            most = max(most, pool.total_bytes())
    return most


def _towers_worker(spec) -> dict:
    """One towers configuration: start-up, timed steps, launches, peak device memory."""
    t_launch = spec["t_launch"]
    marks = {"imports": _since(t_launch)}
    ds = load_data(spec["model"], spec["data"])
    name, lr, momentum, batch = MODELS[spec["model"]][:4]
    batch = spec.get("batch") or batch
    conv, graphs = split_form(spec.get("gpu_conv", "im2col"))
    cfg = Config(n_gpu=spec["towers"], devices=spec["devices"], model=name, batch_size=batch,
                 optimizer="sgd", lr=lr, momentum=momentum, quiet=True, gpu_conv=conv, cuda_graphs=graphs,
                 precision=spec.get("precision", "fp32"))
    trainer = Trainer(cfg, dataset=ds)
    marks["trainer built"] = _since(t_launch)
    gpus = [] if spec["devices"] == "cpu" else [int(d) for d in spec["devices"].split(",")]
    peaks = []

    def sample():  # the pools' high-water mark so far (module doc)
        if gpus:
            trainer.synchronize()
            graphs = [t.graphs.pool_bytes() for t in trainer.executor.towers if t.graphs is not None]
            peaks.append(_pool_bytes(gpus) + sum(graphs))  # (one GPU or one tower a GPU: a sum per GPU)

    try:
        source = BatchSource(ds, trainer.global_batch, cfg.seed)
        # Index batches, as fit() feeds them: gathered on the device when the data
        # set lives there (towers.data.device_data), else taken on the host and staged.
        ring = [source.next_indices() for _ in range(RING)]

        def step(k):
            trainer.train_step_at(ring[k % RING])

        if spec.get("forward_only"):  # inference: each tower's forward pass (eval mode) on a batch on its device
            step = _forward_steps(trainer, ds, ring, batch)

        step(0)
        trainer.synchronize()
        marks["first step done"] = _since(t_launch)
        if spec.get("startup_only"):  # a cold start-up run: nothing more is read from it
            return dict(global_batch=trainer.global_batch, startup=marks)
        sample()
        t = time_steps(step, trainer.synchronize, spec["steps"], spec["warmup"], spec["rounds"], on_warm=sample)
        sample()
        loss = None
        if not spec.get("forward_only"):
            losses = trainer.train_step_at(ring[0], want_loss=True)
            loss = sum(float(v) for v in losses) / len(losses)
        k = t.pop("next_k") + 1
        if spec["devices"] == "cpu":
            launches = {"na": "CPU towers"}
        elif not spec["profile"]:
            launches = {"na": "not profiled (cold start-up run)"}
        else:
            launches = count_launches(step, trainer.synchronize, spec["profile_steps"], k, spec["towers"])
        if spec.get("host_profile") and spec["profile"]:
            t["host_profile"] = host_profile(step, trainer.synchronize, spec["profile_steps"],
                                             k + spec["profile_steps"])
    finally:
        trainer.close()
    on_device = trainer.executor.device_data is not None
    if graphs:
        t["graphs"] = [dict(captures=tw.graphs.captures, launches=tw.graphs.launches, refused=tw.graphs.refused,
                            traceback=tw.graphs.refused_traceback)
                       for tw in trainer.executor.towers if tw.graphs is not None]
    if conv != "im2col":
        from towers.devices import cudnn

        t["cudnn"] = dict(calls=dict(cudnn.calls), refused=[str(k) for k in cudnn.refused])
    return dict(t, global_batch=trainer.global_batch, loss=loss, startup=marks, launches=launches,
                data_on_device=on_device, peak_bytes=max(peaks) if peaks else None,
                peak_source="cupy memory pool high-water (total_bytes), largest GPU" if peaks else None,
                data_bytes=int(ds.x.nbytes + ds.y.nbytes) if on_device else 0)


def _forward_steps(trainer, ds, ring, batch: int, kept: int = 4):
    """``step(k)`` of ``--forward-only``: every tower's forward pass in evaluation mode on one of ``kept``
    batches already on its device (float32, scaled as training scales uint8), issued on its stream with its forms
    (``Tower.scope``: cuDNN where the row asks for it)."""
    towers_ = trainer.executor.towers
    batches = []
    for t in towers_:
        with t.device.scope():
            xp = t.replica.xp
            batches.append([xp.asarray((ds.x[ring[j][:batch]] * numpy.float32(1 / 255)).astype(numpy.float32))
                            for j in range(kept)])

    def step(k):
        for t, xs in zip(towers_, batches):
            with t.scope():
                t.replica.forward(xs[k % kept])
    return step


def _trunc_normal(nn, t, std: float) -> None:
    """TF's truncated_normal(std) (re-drawn beyond 2 std), as towers' initializer."""
    nn.init.trunc_normal_(t, std=std, a=-2 * std, b=2 * std)


def _torch_net(torch, model: str):
    """(net, its weights under L2): the same networks as towers', in PyTorch (NCHW), the same initializers.

    MLP and LeNet-5 as towers' ``mlp`` and ``lenet5``; ResNet-20/56 from
    ``tools.bench_train._torch_resnet`` (He et al.'s CIFAR ResNet as towers'
    ``resnet``: option-A shortcuts, BN momentum 0.99 / eps 1e-3, bias-free He
    convolutions padded 1), its fc initialized as towers' (truncated normal
    0.125, bias 0); CIFAR-10 as towers' ``cifar10`` (TF's tutorial).
    """
    nn = torch.nn
    if model == "MLP":
        net = nn.Sequential(nn.Flatten(), nn.Linear(784, 500), nn.ReLU(), nn.Linear(500, 10))
        regularized = [net[1].weight, net[3].weight]
    elif model == "LeNet-5":  # conv5x5x32 SAME + ReLU, pool 2, conv5x5x64 SAME + ReLU, pool 2, fc512 + ReLU, fc10
        net = nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                            nn.Linear(7 * 7 * 64, 512), nn.ReLU(), nn.Linear(512, 10))
        regularized = [net[7].weight, net[9].weight]  # the book's L2: fully connected weights only
    elif model in ("ResNet-20", "ResNet-56"):
        from tools.bench_train import _torch_resnet  # numpy and the standard library only: a cheap import

        depth = int(MODELS[model][0][len("resnet"):])
        net = _torch_resnet(torch, (depth - 2) // 6)
        with torch.no_grad():
            _trunc_normal(nn, net[-1].weight, 0.125)  # towers' Dense("fc", stddev=0.125), bias 0
            net[-1].bias.zero_()
        # L2 on the convolution and fc weights, not on BN's gamma and beta.
        regularized = [p for p in net.parameters() if p.dim() in (2, 4)]
        return net, regularized
    elif model == "ResNet-50":  # torchvision's own: towers' resnet50 is it layer for layer (BN eps 1e-5, 0.1)
        import torchvision

        net = torchvision.models.resnet50(num_classes=CLASSES[model])
        return net, [p for p in net.parameters() if p.dim() in (2, 4)]  # conv and fc weights, as towers
    elif model == "CIFAR-10":
        # TF's cifar10.inference as towers builds it: conv 5x5x64 SAME, max-pool 3x3 stride 2 SAME, ReLU (after
        # the pool: the same function), LRN, conv 5x5x64, ReLU, LRN, max-pool, fc 384, fc 192, fc 10.  TF's
        # SAME pool (24 -> 12 -> 6, padding only at the bottom/right) is PyTorch's ceil_mode with no padding;
        # TF's LRN depth_radius 4 is a window of 9 channels, and PyTorch divides alpha by the window.
        lrn = dict(size=9, alpha=0.001 / 9.0 * 9, beta=0.75, k=1.0)
        conv1, conv2 = nn.Conv2d(3, 64, 5, padding=2), nn.Conv2d(64, 64, 5, padding=2)
        local3, local4, logits = nn.Linear(6 * 6 * 64, 384), nn.Linear(384, 192), nn.Linear(192, 10)
        net = nn.Sequential(conv1, nn.MaxPool2d(3, 2, ceil_mode=True), nn.ReLU(), nn.LocalResponseNorm(**lrn),
                            conv2, nn.ReLU(), nn.LocalResponseNorm(**lrn), nn.MaxPool2d(3, 2, ceil_mode=True),
                            nn.Flatten(), local3, nn.ReLU(), local4, nn.ReLU(), logits)
        with torch.no_grad():
            for m, std, bias in ((conv1, 5e-2, 0.0), (conv2, 5e-2, 0.1), (local3, 0.04, 0.1), (local4, 0.04, 0.1),
                                 (logits, 1 / 192.0, 0.0)):
                _trunc_normal(nn, m.weight, std)
                m.bias.fill_(bias)
        return net, [local3.weight, local4.weight]  # the tutorial's weight decay: local3 and local4 only
    else:
        raise ValueError(f"no PyTorch definition of {model}")
    with torch.no_grad():
        for m in net:
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(m.weight, std=0.1, a=-0.2, b=0.2)
                m.bias.fill_(0.0 if model == "MLP" or isinstance(m, nn.Conv2d) else 0.1)
    return net, regularized


def param_counts(model: str, net=None, regularized=None) -> dict:
    """Trainable and L2 parameter counts of towers' ``model`` and (given) of the PyTorch ``net``.

    A mismatch raises AssertionError: the two rows would not train the same network.
    """
    tname, *_, shape, _ = MODELS[model]
    ours = build_model(tname, shape, CLASSES.get(model, 10))
    out = {"towers": ours.size, "towers_l2": ours.n_regularized}
    if net is not None:
        out.update(torch=sum(p.numel() for p in net.parameters()), torch_l2=sum(p.numel() for p in regularized))
        if (out["towers"], out["towers_l2"]) != (out["torch"], out["torch_l2"]):
            raise AssertionError(f"{model}: PyTorch's network is not towers': trainable parameters {out['torch']} "
                                 f"against towers' {out['towers']}, under L2 {out['torch_l2']} against "
                                 f"{out['towers_l2']}")
    return out


TORCH_VARIANTS = {  # variant -> how its rows are named
    "fp32": "PyTorch eager",
    "amp": "PyTorch AMP bf16 channels-last",
    "compile": "torch.compile fp32",
}


def _torch_worker(spec) -> dict:
    """PyTorch, the same model, optimizer, L2 and EMA as towers: eager fp32, eager AMP bf16, or compiled fp32."""
    t_launch = spec["t_launch"]
    import contextlib

    import torch

    marks = {"imports": _since(t_launch)}
    model, variant = spec["model"], spec.get("variant", "fp32")
    gpu = spec["devices"] != "cpu"
    dev = torch.device("cuda:0" if gpu else "cpu")
    torch.backends.cudnn.benchmark = True  # pick the fastest conv algorithms (during warm-up)
    torch.backends.cudnn.allow_tf32 = False  # towers computes in plain float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    _, lr, momentum, _, example, _ = MODELS[model]
    net, regularized = _torch_net(torch, model)
    counts = param_counts(model, net, regularized)  # before any time is spent: a mismatch fails the row
    print(f"{model}: trainable parameters towers {counts['towers']}, PyTorch {counts['torch']}; "
          f"under L2 towers {counts['towers_l2']}, PyTorch {counts['torch_l2']}", file=sys.stderr)
    amp = variant == "amp"
    net = net.to(dev, memory_format=torch.channels_last) if amp else net.to(dev)
    reg_ids = {id(p) for p in regularized}
    params = list(net.parameters())
    weights = [p for p in params if id(p) in reg_ids]
    others = [p for p in params if id(p) not in reg_ids]
    # weight_decay S adds S*w to the gradient: the gradient of S * sum(w**2) / 2.
    opt = torch.optim.SGD([{"params": weights, "weight_decay": l2_of(model)}, {"params": others}],
                          lr=lr, momentum=momentum)
    ema = [p.detach().clone() for p in params]
    forward_only = bool(spec.get("forward_only"))
    if forward_only:
        net.eval()
    forward = torch.compile(net) if variant == "compile" else net
    if spec["data"].startswith("synthetic"):
        synthetic = load_data(model, spec["data"])
        d = {"x": synthetic.x, "y": synthetic.y}
    else:
        d = numpy.load(spec["data"])
    gb = spec["batch"]
    image = len(example) == 3  # NHWC colour data: the conv nets
    shape = (gb, 28, 28) if model == "MLP" else (gb, 1, 28, 28)
    rng = numpy.random.default_rng(0)
    ring = []
    for _ in range(RING):  # pinned host batches, as towers stages through pinned memory
        idx = rng.choice(len(d["x"]), gb, replace=False)
        xa = d["x"][idx]
        if image and not amp:  # NCHW for the float32 rows, laid out before the clock starts
            xa = numpy.ascontiguousarray(xa.transpose(0, 3, 1, 2))
        xh, yh = torch.from_numpy(xa), torch.from_numpy(d["y"][idx].astype(numpy.int64))
        ring.append((xh.pin_memory(), yh.pin_memory()) if gpu else (xh, yh))

    def prepare(x):  # uint8 on the device -> float32 in [0, 1], in the row's layout
        if not image:
            return x.float().mul_(1.0 / 255).view(shape)
        if amp:  # NHWC viewed as NCHW is channels-last; float() keeps those strides
            x = x.permute(0, 3, 1, 2)
        return x.float().mul_(1.0 / 255)

    autocast = (lambda: torch.autocast(device_type=dev.type, dtype=torch.bfloat16)) if amp else contextlib.nullcontext
    marks["trainer built"] = _since(t_launch)
    loss_fn = torch.nn.functional.cross_entropy
    last = {}

    def step(k):
        xh, yh = ring[k % RING]
        xb = prepare(xh.to(dev, non_blocking=True))
        if forward_only:
            with torch.no_grad(), autocast():
                last["loss"] = forward(xb)
            return
        with autocast():
            loss = loss_fn(forward(xb), yh.to(dev, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        decay = min(0.99, (1 + k) / (10 + k))  # TF's ExponentialMovingAverage with num_updates
        with torch.no_grad():
            torch._foreach_lerp_(ema, params, 1.0 - decay)
        last["loss"] = loss

    sync = torch.cuda.synchronize if gpu else (lambda: None)
    t0 = time.perf_counter()
    step(0)  # torch.compile compiles here (forward and backward), before any timed step
    sync()
    first_step_s = time.perf_counter() - t0
    marks["first step done"] = _since(t_launch)
    if gpu:  # the steps' own peak: not cuDNN's algorithm search (trial workspaces) in the first step
        torch.cuda.reset_peak_memory_stats(dev)
    t = time_steps(step, sync, spec["steps"], spec["warmup"], spec["rounds"])
    peak = torch.cuda.max_memory_allocated(dev) if gpu else None
    reserved = torch.cuda.max_memory_reserved(dev) if gpu else None
    loss = None
    if not forward_only:
        with torch.no_grad():  # towers' loss includes its L2 term, S * sum(w**2) / 2: the same here (untimed)
            loss = float(last["loss"]) + l2_of(model) / 2 * float(sum((w.float() ** 2).sum() for w in weights))
    k = t.pop("next_k")
    launches = count_launches(step, sync, spec["profile_steps"], k, 1) if gpu else {"na": "CPU run"}
    return dict(t, global_batch=gb, loss=loss, startup=marks, launches=launches, peak_bytes=peak,
                peak_source="torch.cuda.max_memory_allocated after the first step" if gpu else None,
                peak_reserved_bytes=reserved, params=counts,
                first_step_s=first_step_s, compile_s=first_step_s if variant == "compile" else None,
                variant=variant)


WORKERS = {"env": _env_worker, "towers": _towers_worker, "torch": _torch_worker}


# -- driver ---------------------------------------------------------------------------


def _child_env(cache_dir: str | None = None, extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if cache_dir is not None:
        env["CUPY_CACHE_DIR"] = cache_dir
    return env


def run_worker(kind: str, spec: dict, timeout: float, cache_dir: str | None = None, env: dict | None = None) -> dict:
    """Run one worker in a fresh process (``env``: variables to add); {"error": ...} if it failed."""
    spec = dict(spec, t_launch=time.time())
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_child_env(cache_dir, env),
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT)]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-6:]
        return {"error": f"exit {p.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1][len(RESULT):])


def run_main_job(where: str, steps: int | None, timeout: float, tmp: str, cache_dir: str | None = None,
                 extra: tuple = ()) -> dict:
    """Wall time of ``python -m towers.train --n-gpu 2`` (the default job) in a subprocess, with ``extra`` flags."""
    logdir = tempfile.mkdtemp(prefix="main-", dir=tmp)
    cmd = [sys.executable, "-m", "towers.train", "--n-gpu", "2", *extra, "--logdir", logdir]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if where == "cpu":
        cmd += ["--devices", "cpu"]
        if shutil.which("taskset") and len(os.sched_getaffinity(0)) >= 2:
            cmd = ["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))] + cmd
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_child_env(cache_dir), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "cmd": cmd}
    wall = time.perf_counter() - t0
    text = p.stdout + p.stderr
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: " + " | ".join(text.strip().splitlines()[-4:]), "cmd": cmd}
    shown = [c for c in cmd if c not in ("--logdir", logdir)]  # the temporary logdir says nothing
    out = {"wall_s": wall, "cmd": " ".join("python" if c == sys.executable else c for c in shown)}
    # the done line: the run's time, its parts (the training loop's among them), then the training rate
    done = re.search(r"done: (\d+) steps .*? training ([\d.]+) s,.*?; training ([\d.]+) examples/sec", text)
    if done:
        out.update(steps=int(done.group(1)), loop_s=float(done.group(2)), examples_per_sec=float(done.group(3)))
    acc = re.search(r"test accuracy: ([\d.]+) \(raw weights\), ([\d.]+) \(EMA", text)
    if acc:
        out["test_accuracy_ema"] = float(acc.group(2))
    return out


def _fmt(v, spec="{:.0f}", na="n/a"):
    return na if v is None else spec.format(v)


def towers_label(form: str) -> str:
    """The towers rows' label for a form: "towers" (im2col), "towers cudnn", "towers cudnn+graphs"."""
    return "towers" if form == "im2col" else f"towers {form}"


FORMS = ("im2col", "cudnn", "im2col+graphs", "cudnn+graphs")


def split_form(form: str) -> tuple[str, bool]:
    """A row's form as settings: (``gpu_conv``, ``cuda_graphs``): "cudnn+graphs" is (cudnn, True)."""
    conv, _, extra = form.partition("+")
    return conv, extra == "graphs"


def model_forms(model: str, forms) -> list[str]:
    """The forms of ``model``'s towers rows: every one for a conv net; for the others (no convolution) im2col,
    and im2col+graphs where a form asks for graphs."""
    if model in CONV:
        return list(forms)
    return ["im2col"] + (["im2col+graphs"] if any(split_form(f)[1] for f in forms) else [])


def _plan(gpus: int, torch_ok: bool, models: list[str], torch_compile: bool, forms=("im2col",),
          batch: int | None = None, bf16: bool = False) -> list[dict]:
    """The rows, model by model: the PyTorch references first (a run cut short keeps them), then towers'
    configurations (the conv nets once per ``gpu_conv`` form, and with ``bf16`` in bf16 too); ``batch``: the
    conv nets' batch per tower instead of their own."""
    dev = "0" if gpus else "cpu"
    where = "GPU 0" if gpus else "CPU"
    rows = []
    for model in models:
        b = (batch if model in CONV else None) or MODELS[model][3]
        variants = ["fp32"] + (["amp", "compile"] if model in CONV else [])
        for variant in variants:
            label = TORCH_VARIANTS[variant] + (" fp32" if variant == "fp32" and model in CONV else "")
            if variant == "compile" and not torch_compile:
                rows.append(dict(name=f"{model} {label}", kind="skip",
                                 note="skipped: pass --torch-compile (a minute or more of compiling per row)"))
                continue
            for bb in (b, 2 * b):
                row = dict(name=f"{model} {label}, {where}, b{bb}", kind="torch", model=model, batch=bb, devices=dev,
                           variant=variant)
                rows.append(row if torch_ok else dict(row, kind="skip", note="skipped: torch not installed"))
        for form in model_forms(model, forms) if gpus else ("im2col",):
            t = towers_label(form)
            rows.append(dict(name=f"{model} {t} 1 tower, {where}, b{b}", kind="towers", model=model, towers=1,
                             devices=dev, gpu_conv=form))
            rows.append(dict(name=f"{model} {t} 2 towers sharing {where}, global {2 * b}", kind="towers",
                             model=model, towers=2, devices=dev, gpu_conv=form))
        if gpus >= 2:
            rows.append(dict(name=f"{model} towers {gpus} towers on {gpus} GPUs, global {b * gpus}",
                             kind="towers", model=model, towers=gpus, devices=",".join(map(str, range(gpus)))))
        else:
            rows.append(dict(name=f"{model} towers N towers on N GPUs", kind="skip",
                             note="skipped: only one GPU" if gpus == 1 else "skipped: no GPU"))
        if model in CONV and bf16:
            form = model_forms(model, forms)[0] if gpus else "im2col"
            rows.append(dict(name=f"{model} {towers_label(form)} bf16 1 tower, {where}, b{b}", kind="towers",
                             model=model, towers=1, devices=dev, gpu_conv=form, precision="bf16"))
    return rows


# -- the time a run takes, estimated before it starts (tools/gpu_check.py budgets its default run with it) ----------
# Seconds of one worker process before its first timed step: Python, imports, CUDA's context, the model, the first
# steps (cuDNN's plans, CuPy's kernels from a warm cache); about 150 s for ResNet-20's 13 processes on an H200
# (2026-11-27: 4 towers rows, their 4 cold start-ups, 4 PyTorch rows, the environment probe): 11.5 s each.
START_S = {"env": 5.0, "towers": 12.0, "torch": 12.0, "cold": 10.0}
GRAPHS_S = 5.0  # a +graphs row's warm-up step before its capture, and the capture
# Milliseconds of one step of one tower at the model's batch on an H100/H200 (docs/performance.md: towers' eager
# im2col rows, the slowest form; 2 towers sharing take twice as long), PyTorch's rows counted the same.
STEP_MS = {"MLP": 0.6, "LeNet-5": 1.0, "ResNet-20": 11.0, "ResNet-56": 30.0, "CIFAR-10": 3.5,
           "ResNet-50": 150.0}  # ResNet-50 at b64, 224x224: a guess (never run on a GPU here)


def estimate_seconds(rows: list[dict], sizes: dict, rounds: int, startup: bool = False,
                     host_profile: bool = False) -> float:
    """The estimated wall seconds of measuring ``rows`` (``_plan``'s) with ``sizes`` (model -> timed, warm-up,
    profiled steps): the environment probe, then per worker ``START_S`` plus its steps at ``STEP_MS`` (the first,
    the warm-up, ``rounds`` timed rounds, the profiled ones and, with ``host_profile``, as many again), a
    ``+graphs`` row ``GRAPHS_S`` more, and with ``startup`` a cold start-up run per towers row.  No main job."""
    total = START_S["env"]
    for r in rows:
        if r["kind"] == "skip":
            continue
        steps, warmup, profile = sizes[r["model"]]
        n = 1 + warmup + rounds * steps + profile * (2 if host_profile and r["kind"] == "towers" else 1)
        width = r["towers"] if r["kind"] == "towers" else r["batch"] / MODELS[r["model"]][3]
        total += START_S[r["kind"]] + n * STEP_MS[r["model"]] * width / 1000
        if r["kind"] == "towers":
            total += GRAPHS_S if split_form(r.get("gpu_conv", "im2col"))[1] else 0.0
            total += START_S["cold"] if startup else 0.0
    return total


def _mib(v):
    return None if v is None else v / 2 ** 20


def _print_table(rows: list[dict]) -> None:
    head = ("row", "samples/s", "wall us/step", "host us/step", "all threads us/step", "kernel us/step", "launches/tower-step",
            "copies/step", "peak MiB", "last loss")
    w = max([50] + [len(r["name"]) for r in rows])
    print(f"| {head[0]:<{w}} | " + " | ".join(f"{h:>{max(len(h), 9)}}" for h in head[1:]) + " |")
    print(f"| {'-' * w} | " + " | ".join("-" * max(len(h), 9) for h in head[1:]) + " |")
    for r in rows:
        res = r.get("result") or {}
        if r["kind"] == "skip" or "error" in res:
            msg = r.get("note") if r["kind"] == "skip" else "FAILED: " + res["error"][:160]
            print(f"| {r['name']:<{w}} | {msg}")
            continue
        ln = res["launches"]
        vals = [res["samples_per_sec"], res["wall_us_per_step"], res["host_us_per_step"], res.get("cpu_us_per_step"),
                ln.get("kernel_us_per_step"), ln.get("kernels_per_tower_step"), ln.get("copies_per_step"),
                _mib(res.get("peak_bytes")), res["loss"]]
        specs = ["{:.0f}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.0f}", "{:.3f}"]
        cells = [_fmt(v, s) for v, s in zip(vals, specs)]
        print(f"| {r['name']:<{w}} | " + " | ".join(f"{c:>{max(len(h), 9)}}" for c, h in zip(cells, head[1:])) + " |")


def _print_startup(rows: list[dict]) -> None:
    print("start-up: seconds from process launch to each mark (cold, with --startup: empty CuPy kernel cache; warm: "
          "the same cache again, or without --startup the cache the run's rows share)")
    w = max([50] + [len(r["name"]) for r in rows])
    print(f"| {'row':<{w}} | {'run':<5} | {'imports':>8} | {'built':>8} | {'1st step':>8} |")
    print(f"| {'-' * w} | ----- | -------- | -------- | -------- |")
    compiled = []
    for r in rows:
        for run in ("cold", "warm", "once"):
            res = r.get({"cold": "cold", "warm": "result", "once": "result"}[run]) or {}
            if (run == "once") != (r["kind"] == "torch") or "startup" not in res:
                continue
            s = res["startup"]
            label = "-" if run == "once" else run
            print(f"| {r['name']:<{w}} | {label:<5} | {s['imports']:8.2f} | {s['trainer built']:8.2f} | "
                  f"{s['first step done']:8.2f} |")
            if res.get("compile_s") is not None:
                compiled.append((r["name"], res["compile_s"]))
    for name, s in compiled:
        print(f"torch.compile: {name}: first step (compiling forward and backward) {s:.1f} s, not in its timed steps")


def _print_params(rows: list[dict], models: list[str]) -> None:
    """Trainable and L2 parameter counts of each model: towers' and, where a PyTorch row ran, PyTorch's."""
    print("parameters (trainable / under L2), towers' models and the PyTorch rows' networks:")
    for model in models:
        ours = param_counts(model)
        theirs = next((r["result"]["params"] for r in rows if r["kind"] == "torch" and r["model"] == model
                       and "params" in (r.get("result") or {})), None)
        line = f"  {model:<10} towers {ours['towers']:>9,} / {ours['towers_l2']:>9,}"
        if theirs is None:
            line += "   PyTorch n/a (no PyTorch row ran)"
        else:
            same = (theirs["torch"], theirs["torch_l2"]) == (ours["towers"], ours["towers_l2"])
            line += f"   PyTorch {theirs['torch']:>9,} / {theirs['torch_l2']:>9,}   [{'equal' if same else 'DIFFERENT'}]"
        print(line)


def _ratio(out: dict, name: str, num, den, target: float | None, below: bool = False) -> None:
    """Print ``num / den`` with its target (``target`` None: informational, no target)."""
    if num is None or den is None:
        print(f"{name}: n/a")
        out[name] = None
        return
    v = num / den
    if target is None:
        print(f"{name}: {v:.2f} (informational, no target)")
    else:
        met = v < target if below else v >= target
        print(f"{name}: {v:.2f} (target {'<' if below else '>='} {target:g}) [{'met' if met else 'MISSED'}]")
    out[name] = v


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + line
        self.exit(2, f"bench_gpu: error: {message} (see --help)\n")


def parse_args(argv=None):
    """The command line, resolved: ``models`` (names), ``gpu_conv`` (forms), ``rounds`` and ``sizes`` (model ->
    timed, warm-up and profiled steps) among the flags; a bad one exits 2 with one line."""
    ap = _Parser(description=__doc__.split("\n")[0],
                 epilog="Models: MLP and LeNet-5 (28x28, batch 100 per tower), ResNet-20 and ResNet-56 (32x32x3, "
                        "batch 128), CIFAR-10 (TF's tutorial model, 24x24x3, batch 128); towers' names (mlp, lenet5, "
                        "resnet20, resnet56, cifar10) work too.  Each conv net gets towers float32 (1 tower, 2 towers "
                        "sharing the GPU), PyTorch eager float32 and eager AMP bf16 channels-last at b128 and b256, "
                        "and with --torch-compile torch.compile float32; per row samples/s, wall, host and kernel "
                        "time per step, launches per step, peak device memory and start-up.  A short run of the conv rows: "
                        "--models resnet20,cifar10 --conv-steps 20 --rounds 2 --no-main-job")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help="comma-separated models to measure, among " + ", ".join(MODELS)
                         + " (any case; towers' names too); default: " + ",".join(DEFAULT_MODELS))
    ap.add_argument("--steps", type=int, default=None, help="timed MLP steps per round (default 1000; --quick 10)")
    ap.add_argument("--lenet-steps", type=int, default=None, help="timed LeNet-5 steps per round (default 200)")
    ap.add_argument("--conv-steps", type=int, default=None,
                    help="timed steps per round of the conv nets, ResNet-20/56 and CIFAR-10 (default 50; --quick 1)")
    ap.add_argument("--warmup", type=int, default=None,
                    help=f"untimed steps after the first (default 30; the conv nets {CONV_WARMUP})")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per row, best kept (default 3)")
    ap.add_argument("--profile-steps", type=int, default=None,
                    help=f"steps under torch.profiler (default 10; the conv nets {CONV_PROFILE})")
    ap.add_argument("--torch-compile", action="store_true",
                    help="add torch.compile float32 rows for the conv nets (each compiles for a minute or more; "
                         "the compile time is reported apart from the timed steps)")
    ap.add_argument("--gpu-conv", default="im2col,cudnn",
                    help="comma-separated forms the towers rows run in, among im2col, cudnn, im2col+graphs, "
                         "cudnn+graphs (gpu_conv, and +graphs for cuda_graphs; default im2col,cudnn; models without "
                         "convolutions take im2col, and im2col+graphs when a form has +graphs; on a machine "
                         "without a GPU only im2col)")
    ap.add_argument("--host-profile", action="store_true",
                    help="also profile the towers rows' host time by Python function (cProfile, over "
                         "--profile-steps more steps; printed with --verbose, and in --json)")
    ap.add_argument("--startup", action="store_true",
                    help="also time each towers row's start-up with an empty CuPy kernel cache (a cold run of its "
                         "own per row; off: the rows share one kernel cache, and their start-up is timed once)")
    ap.add_argument("--forward-only", action="store_true",
                    help="time inference instead of training steps: each tower's forward pass in evaluation mode "
                         "(PyTorch: eval mode, no_grad), as tf_cnn_benchmarks' --forward_only")
    ap.add_argument("--bf16", action="store_true",
                    help="also a towers --precision bf16 row per conv net (bf16 still rounds inside float32 buffers "
                         "on GPUs: it measures that emulation, not bf16 storage)")
    ap.add_argument("--batch", type=int, default=None,
                    help="the conv nets' batch per tower instead of their own (ResNet-50: 64; e.g. --batch 128)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, on the CPU when there is no GPU")
    ap.add_argument("--no-main-job", action="store_true", help="skip the default main job comparison")
    ap.add_argument("--verbose", action="store_true", help="print the kernel names counted for each row, with their time per step")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds allowed to each subprocess (default 300; torch.compile rows twice that)")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return a
    try:
        a.models = model_names(a.models)
    except ValueError as e:
        ap.error(f"--models {a.models!r}: {e}; use names among {', '.join(MODELS)} (or towers' "
                 f"{', '.join(m[0] for m in MODELS.values())}), comma-separated")
    a.gpu_conv = [f.strip() for f in a.gpu_conv.split(",") if f.strip()]
    if not a.gpu_conv or set(a.gpu_conv) - set(FORMS):
        ap.error(f"--gpu-conv {','.join(a.gpu_conv)!r}: use some of {', '.join(FORMS)}, comma-separated")
    q = a.quick
    steps = a.steps if a.steps is not None else (10 if q else 1000)
    lenet_steps = a.lenet_steps if a.lenet_steps is not None else (2 if q else 200)
    conv_steps = a.conv_steps if a.conv_steps is not None else (1 if q else 50)
    warmup = a.warmup if a.warmup is not None else (2 if q else 30)
    rounds = a.rounds if a.rounds is not None else (1 if q else 3)
    profile_steps = a.profile_steps if a.profile_steps is not None else (2 if q else 10)
    if min(steps, lenet_steps, conv_steps, rounds, profile_steps) < 1 or warmup < 0:
        ap.error("--steps, --lenet-steps, --conv-steps, --rounds and --profile-steps must be >= 1, --warmup >= 0")
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        ap.error(f"--json {a.json}: its directory does not exist; create it or pick another path")
    a.sizes = {  # model -> (timed steps, warm-up steps, profiled steps)
        m: (conv_steps, a.warmup if a.warmup is not None else (1 if q else CONV_WARMUP),
            a.profile_steps if a.profile_steps is not None else (1 if q else CONV_PROFILE)) if m in CONV
        else (steps if m == "MLP" else lenet_steps, warmup, profile_steps)
        for m in a.models}
    a.rounds = rounds
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        print(RESULT + json.dumps(WORKERS[a.worker](json.loads(a.spec))), flush=True)
        return 0
    sizes, rounds = a.sizes, a.rounds

    tmp = tempfile.mkdtemp(prefix="towers-bench-gpu-")
    try:
        return _bench(a, tmp, sizes, rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bench(a, tmp, sizes: dict, rounds: int) -> int:
    t_start = time.perf_counter()
    data = {}  # model -> its data file, one per shape
    for model in a.models:
        shape, fname = MODELS[model][4:6]
        if fname.startswith("synthetic"):  # made in each worker (towers' --data synthetic), no file
            data[model] = fname
            continue
        path = os.path.join(tmp, fname)
        if not os.path.exists(path):
            make_data(path, 2000 if a.quick else 10000, shape)
        data[model] = path
    env = run_worker("env", {}, a.timeout)
    if "error" in env:
        print(f"bench_gpu: error: the environment probe failed: {env['error']}", file=sys.stderr)
        return 1
    gpus = len(env["gpus"])
    torch_ok = env.get("torch") is not None
    print(f"python {env['python']}, numpy {env['numpy']}, cupy {env.get('cupy', 'absent')}, "
          f"torch {env['torch'] or 'absent (reference rows skipped)'}, NCCL {env.get('nccl', 'n/a')}, "
          f"CUDA runtime {env.get('cuda_runtime', 'n/a')}, driver {env.get('driver', 'n/a')}, "
          f"{os.cpu_count()} CPU cores")
    print(f"python + imports + CUDA init in a fresh process: {env['startup_s']:.2f} s")
    if gpus:
        print("GPUs: " + ", ".join(f"{i}: {n}" for i, n in enumerate(env["gpus"])))
    else:
        print("NO GPU FOUND (" + env.get("cupy_error", "CuPy sees no CUDA device") + "): "
              "every row below runs on the CPU; these are not GPU figures")
        if not a.quick:
            print("bench_gpu: error: no CUDA GPU is visible; this benchmark measures GPUs. "
                  "Run it on a GPU machine, or pass --quick for a CPU smoke run", file=sys.stderr)
            return 2
    print(f"{rounds} rounds per row (best kept); per model: timed steps per round, warm-up steps, profiled steps, "
          "batch per tower: " + "; ".join(f"{m} {s[0]}, {s[1]}, {s[2]}, {(a.batch if m in CONV else None) or MODELS[m][3]}"
                                          for m, s in sizes.items()),
          flush=True)

    rows = _plan(gpus, torch_ok, a.models, a.torch_compile, a.gpu_conv, a.batch, a.bf16)
    for r in rows:  # every towers row of a conv net at --batch; forward-only rows say so
        if r["kind"] == "towers" and a.batch and r["model"] in CONV:
            r["batch"] = a.batch
        if a.forward_only:
            r["name"] += ", forward only"
    failed = False
    try:
        _measure(a, tmp, rows, sizes, rounds, data)
    except KeyboardInterrupt:
        # Stopped (Ctrl-C, or tools/gpu_check.py at its time limit): the rows measured so far still make the
        # tables and the json; the others say they were not measured.
        print("bench_gpu: stopped (SIGINT): the rows not measured yet are left out", file=sys.stderr, flush=True)
        for r in rows:
            if r["kind"] != "skip" and "result" not in r:
                r["result"] = {"error": "not measured: the benchmark was stopped"}
    for r in rows:
        res = r.get("result") or {}
        failed |= "error" in res or (r.get("cold") or {}).get("error") is not None

    main_job = {}
    if not a.no_main_job and not any("stopped" in (r.get("result") or {}).get("error", "") for r in rows):
        job_steps = 100 if a.quick else None
        if gpus:
            cache = tempfile.mkdtemp(prefix="cupy-cache-main-", dir=tmp)
            main_job["GPU, cold kernel cache"] = run_main_job("gpu", job_steps, a.timeout, tmp, cache)
            main_job["GPU, warm kernel cache"] = run_main_job("gpu", job_steps, a.timeout, tmp, cache)
            if any(split_form(f)[1] for f in a.gpu_conv):
                main_job["GPU, warm, --cuda-graphs"] = run_main_job("gpu", job_steps, a.timeout, tmp, cache,
                                                                    ("--cuda-graphs",))
        main_job["CPU, 2 cores"] = run_main_job("cpu", job_steps, a.timeout, tmp)
        failed |= any("error" in v for v in main_job.values())
    return _report(a, rows, main_job, env, gpus, sizes, rounds, t_start, failed)


def _measure(a, tmp, rows, sizes: dict, rounds: int, data: dict) -> None:
    """Run every row's workers (each in its own subprocess), printing each row's figures as it is measured."""
    shared = tempfile.mkdtemp(prefix="cupy-cache-", dir=tmp)  # without --startup: one kernel cache for every row
    for r in rows:
        if r["kind"] == "skip":
            continue
        model = r["model"]
        steps, warmup, profile_steps = sizes[model]
        spec = {k: r[k] for k in ("model", "devices", "gpu_conv", "precision", "batch") if k in r}
        spec.update(data=data[model], steps=steps, warmup=warmup, rounds=rounds, profile_steps=profile_steps,
                    forward_only=a.forward_only)
        t0 = time.perf_counter()
        if r["kind"] == "towers":
            spec["towers"] = r["towers"]
            cache = shared
            if a.startup:
                cache = tempfile.mkdtemp(prefix="cupy-cache-", dir=tmp)
                # Empty kernel cache: start-up only matters here, so one round and no profiler (the conv nets:
                # the first step alone, as their steps are long).
                cold = dict(spec, rounds=1, profile=False, startup_only=model in CONV)
                r["cold"] = run_worker("towers", cold, a.timeout, cache)
            r["result"] = run_worker("towers", dict(spec, profile=True, host_profile=a.host_profile), a.timeout,
                                     cache)  # the same cache, warm
        else:
            spec.update(batch=r["batch"], variant=r["variant"])
            env = None
            if r["variant"] == "compile":  # empty compile caches: the compile time is a cold one, every run
                cold = tempfile.mkdtemp(prefix="inductor-cache-", dir=tmp)
                env = {"TORCHINDUCTOR_CACHE_DIR": cold, "TRITON_CACHE_DIR": os.path.join(cold, "triton")}
            r["result"] = run_worker("torch", spec, a.timeout * (2 if r["variant"] == "compile" else 1), env=env)
        res = r["result"]
        if "error" not in res:
            res["samples_per_sec"] = res["global_batch"] / res["wall_us_per_step"] * 1e6
        cold_error = (r.get("cold") or {}).get("error")
        # The main figures at once, so that a run cut short still shows what it measured.
        got = "" if "error" in res else (f": {res['samples_per_sec']:.0f} samples/s, peak "
                                         f"{_fmt(_mib(res.get('peak_bytes')))} MiB, loss {_fmt(res['loss'], '{:.3f}')}")
        for g in res.get("graphs") or []:  # a failed capture's traceback, in the log as it happened
            if g.get("traceback"):
                print(f"  {r['name']}: the capture failed ({g['refused']}):\n{g['traceback']}", flush=True)
        print(f"  measured {r['name']} in {time.perf_counter() - t0:.1f} s{got}"
              + (f": FAILED {res['error']}" if "error" in res else "")
              + (f" (its cold start-up run FAILED: {cold_error})" if cold_error else ""), flush=True)


def _report(a, rows, main_job, env, gpus, sizes, rounds, t_start, failed) -> int:
    """The tables, the ratios and the json of the rows measured."""
    print()
    _print_table(rows)
    print()
    _print_startup(rows)
    print()
    _print_params(rows, a.models)
    if a.verbose:
        for r in rows:
            ln = (r.get("result") or {}).get("launches") or {}
            if "names_per_step" in ln:
                print(f"\nkernels per step of {r['name']} ({ln['kernels']} kernels in {ln['profiled_steps']} steps"
                      f"{'' if ln['whole'] else ', NOT a whole number per step'}):")
                for name, c, us in ln["names_per_step"]:
                    print(f"  {c:6.2f}  {us:8.1f} us  {name[:100]}")
            elif ln.get("na"):
                print(f"kernels of {r['name']}: n/a ({ln['na']})")
            hp = (r.get("result") or {}).get("host_profile")
            if hp:
                print(f"\nhost time per step of {r['name']} by function (cProfile: attributes, does not measure):")
                for where, calls, own, cum in hp:
                    print(f"  {calls:8.1f} calls  {own:9.1f} us own  {cum:9.1f} us cum  {where[:90]}")
            cu = (r.get("result") or {}).get("cudnn")
            if cu:
                print(f"cuDNN in {r['name']}: calls {cu['calls']}; shapes left to im2col: {cu['refused'] or 'none'}")
    for r in rows:  # always: a row whose capture failed measured eager steps
        for i, gr in enumerate((r.get("result") or {}).get("graphs") or []):
            if a.verbose or gr["refused"]:
                print(f"CUDA graphs of {r['name']}, tower {i}: {gr['captures']} captured, {gr['launches']} launches"
                      + (f"; CAPTURE FAILED, eager steps measured: {gr['refused']}" if gr["refused"] else ""))
    if main_job:
        print("\nthe default main job (python -m towers.train --n-gpu 2), wall time of the whole command:")
        for k, v in main_job.items():
            if "error" in v:
                print(f"  {k:<24} FAILED: {v['error']}")
                continue
            loop = f", training loop {v['loop_s']:.2f} s ({v['examples_per_sec']:.0f} examples/s)" if "loop_s" in v else ""
            acc = f", EMA test accuracy {v['test_accuracy_ema']:.4f}" if "test_accuracy_ema" in v else ""
            print(f"  {k:<24} {v['wall_s']:6.2f} s{loop}{acc}   [{v['cmd']}]")

    print()
    if not gpus:
        print("NO GPU FOUND: the ratios below compare CPU runs, not the issue's GPU targets")
    # By the rows' names without the forward-only mark: the ratios of a --forward-only run are inference's.
    g = {r["name"].removesuffix(", forward only"): (r.get("result") or {}).get("samples_per_sec") for r in rows}
    where = "GPU 0" if gpus else "CPU"
    ratios: dict = {}
    for model, target in (("MLP", 1.0), ("LeNet-5", 0.8)):
        if model not in a.models:
            continue
        for form in model_forms(model, a.gpu_conv) if gpus else ["im2col"]:
            t = towers_label(form)
            _ratio(ratios, f"{model} {t} 1 tower / PyTorch b100", g.get(f"{model} {t} 1 tower, {where}, b100"),
                   g.get(f"{model} PyTorch eager, {where}, b100"), target)
            _ratio(ratios, f"{model} {t} 2 sharing / PyTorch b200",
                   g.get(f"{model} {t} 2 towers sharing {where}, global 200"),
                   g.get(f"{model} PyTorch eager, {where}, b200"), target)
    for model, form in ((m, f) for m in a.models if m in CONV for f in (a.gpu_conv if gpus else ["im2col"])):
        b, t = (a.batch if model in CONV else None) or MODELS[model][3], towers_label(form)
        one, two = g.get(f"{model} {t} 1 tower, {where}, b{b}"), g.get(f"{model} {t} 2 towers sharing {where}, "
                                                                        f"global {2 * b}")
        for variant, target in (("fp32", 1.0), ("amp", None), ("compile", None)):
            label = TORCH_VARIANTS[variant] + (" fp32" if variant == "fp32" else "")
            if variant == "compile" and not a.torch_compile:
                continue
            _ratio(ratios, f"{model} {t} 1 tower / {label} b{b}", one, g.get(f"{model} {label}, {where}, b{b}"),
                   target)
            _ratio(ratios, f"{model} {t} 2 sharing / {label} b{2 * b}", two,
                   g.get(f"{model} {label}, {where}, b{2 * b}"), target)
    warm = main_job.get("GPU, warm kernel cache", {}).get("wall_s")
    _ratio(ratios, "main job GPU warm wall / CPU wall", warm, main_job.get("CPU, 2 cores", {}).get("wall_s"),
           1.0, below=True)
    if "GPU, warm, --cuda-graphs" in main_job:
        _ratio(ratios, "main job GPU warm --cuda-graphs wall / CPU wall",
               main_job["GPU, warm, --cuda-graphs"].get("wall_s"), main_job.get("CPU, 2 cores", {}).get("wall_s"),
               1.0, below=True)
    total = time.perf_counter() - t_start
    print(f"\ntotal: {total:.0f} s")
    if a.json:
        report = {"env": env, "settings": dict(models=a.models, sizes={m: dict(zip(("steps", "warmup", "profile_steps"),
                                                                                    s)) for m, s in sizes.items()},
                                               rounds=rounds, batch_per_tower={m: (a.batch if m in CONV else None) or MODELS[m][3]
                                                                for m in a.models},
                                               forward_only=a.forward_only,
                                               torch_compile=a.torch_compile, quick=a.quick),
                  "rows": rows, "main_job": main_job, "ratios": ratios, "total_s": total}
        with atomic_path(a.json) as path:
            Path(path).write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
