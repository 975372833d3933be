"""towers on a GPU against PyTorch eager on the same GPU, side by side, in one run.

    python tools/bench_gpu.py                      # on a machine with a CUDA GPU
    python tools/bench_gpu.py --quick              # tiny CPU smoke run (no GPU needed)
    python tools/bench_gpu.py --json OUT.json --verbose

What one run measures (MNIST-shaped synthetic uint8 data, 28x28, 10 classes):

* towers, MLP 784-500-10, batch 100 per tower, the trainer's defaults (lr 0.8,
  L2 1e-4, EMA 0.99): 1 tower on GPU 0; 2 towers sharing GPU 0 (global 200);
  N towers on N GPUs when there are several GPUs (skipped with a note otherwise);
* LeNet-5 the same way (lr 0.01, momentum 0.9, as the README trains it);
* PyTorch eager on the same GPU (a reference, never a dependency: imported only
  in its own subprocess, rows skipped when absent): the same networks,
  truncated-normal weights, SGD with L2 1e-4 on the weights only (SGD's
  ``weight_decay``, which is the gradient of ``S * sum(w**2) / 2``), an EMA of
  every parameter each step (``torch._foreach_lerp_``, one multi-tensor op),
  at batch 100 and 200; cuDNN with ``benchmark=True`` and TF32 off (towers
  computes in plain float32);
* per row: samples/s (``--steps`` steps per round, the stream synchronized only
  at the end of the round, best of ``--rounds``); host microseconds per step
  (``time.thread_time`` of the thread that issues the work, over the same
  steps); kernel launches per tower-step, memory copies per step and summed
  kernel time per step, counted by ``torch.profiler`` (CUPTI sees every CUDA
  kernel of the process, CuPy's included) over ``--profile-steps`` extra
  steps, "n/a" without torch or CUPTI;
* start-up of every towers row: seconds from the launch of a fresh process to
  its first completed step, with an EMPTY CuPy kernel cache (``CUPY_CACHE_DIR``
  a fresh directory: every kernel compiled) and warm (the same directory again);
* the default main job, ``python -m towers.train --n-gpu 2`` (MLP on
  data/digits.npz, 2000 steps), as a subprocess on the GPU with a cold and a
  warm kernel cache, against ``taskset -c 0,1 ... --devices cpu`` (2 cores, a
  developer's machine): wall time of the whole command;
* then the ratios the "Fast on GPUs" issue targets.

Every row runs in its own subprocess (``--worker``), so CuPy's and PyTorch's
memory pools, handles and caches never meet, and start-up is a real cold start.
The timed steps reuse a ring of global batches (their row indices) drawn
before the clock starts and run ``Trainer.train_step_at`` as ``fit`` does: on
a GPU the data set lives on the device and each tower gathers its slice there
(one index copy and one kernel), on the CPU the rows are taken and staged from
host memory.  So the numbers are the trainer's step (staging included), not
the input thread.  PyTorch's rows copy each batch from pinned host memory.  Nothing here is asserted: the figures are printed, with the targets.
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
from towers.output.files import atomic_path  # noqa: E402

BATCH = 100  # per tower, as the issue asks
RING = 32  # global batches drawn before timing, reused in turn
RESULT = "BENCH_RESULT "  # prefix of a worker's one result line
MODELS = {  # name -> (towers --model, lr, momentum): the MLP at the defaults, LeNet-5 as the README trains it
    "MLP": ("mlp", 0.8, 0.0),
    "LeNet-5": ("lenet5", 0.01, 0.9),
}


def make_data(path: str, n: int) -> None:
    """MNIST-shaped uint8 images (about 80% background zeros, as MNIST), learnable labels.

    Labels are a fixed random projection of the pixels, so training at the
    default learning rate stays finite: a diverged run would time NaN
    arithmetic instead of training.
    """
    rng = numpy.random.default_rng(0)
    x = rng.integers(0, 256, (n, 28, 28), dtype=numpy.uint8)
    x[rng.random((n, 28, 28)) < 0.8] = 0
    proj = rng.standard_normal((784, 10)).astype(numpy.float32)
    y = (x.reshape(n, -1).astype(numpy.float32) @ proj).argmax(1).astype(numpy.int32)
    numpy.savez(path, x=x, y=y, x_test=x[:500], y_test=y[:500])


# -- measurements shared by the workers ---------------------------------------------


def time_steps(step, sync, steps: int, warmup: int, rounds: int) -> dict:
    """Wall and host time per step: ``rounds`` rounds of ``steps``, one sync per round.

    Host time is ``time.thread_time`` of this thread (the one that issues the
    GPU work) up to the end of the last launch, before the final sync;
    ``cpu_us_per_step`` is ``time.process_time`` (every thread: PyTorch runs
    backward on a thread of its own, which thread time misses).  Both include any blocking the step does itself (a pinned buffer's event wait,
    a full launch queue), which CUDA may spin on.  The round with the lowest
    wall time is kept: on a shared machine it is the least disturbed one.
    """
    k = 1  # step 0 was the start-up step
    for _ in range(warmup):
        step(k)
        k += 1
    sync()
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


def _towers_worker(spec) -> dict:
    """One towers configuration: start-up, timed steps, launches."""
    t_launch = spec["t_launch"]
    marks = {"imports": _since(t_launch)}
    ds = load_dataset(spec["data"])
    name, lr, momentum = MODELS[spec["model"]]
    cfg = Config(n_gpu=spec["towers"], devices=spec["devices"], model=name, batch_size=BATCH,
                 optimizer="sgd", lr=lr, momentum=momentum, quiet=True)
    trainer = Trainer(cfg, dataset=ds)
    marks["trainer built"] = _since(t_launch)
    try:
        source = BatchSource(ds, trainer.global_batch, cfg.seed)
        # Index batches, as fit() feeds them: gathered on the device when the data
        # set lives there (towers.data.device_data), else taken on the host and staged.
        ring = [source.next_indices() for _ in range(RING)]

        def step(k):
            trainer.train_step_at(ring[k % RING])

        step(0)
        trainer.synchronize()
        marks["first step done"] = _since(t_launch)
        t = time_steps(step, trainer.synchronize, spec["steps"], spec["warmup"], spec["rounds"])
        losses = trainer.train_step_at(ring[0], want_loss=True)
        loss = sum(float(v) for v in losses) / len(losses)
        k = t.pop("next_k") + 1
        if spec["devices"] == "cpu":
            launches = {"na": "CPU towers"}
        elif not spec["profile"]:
            launches = {"na": "not profiled (cold start-up run)"}
        else:
            launches = count_launches(step, trainer.synchronize, spec["profile_steps"], k, spec["towers"])
    finally:
        trainer.close()
    return dict(t, global_batch=trainer.global_batch, loss=loss, startup=marks, launches=launches,
                data_on_device=trainer.device_data is not None)


def _torch_net(torch, model: str):
    """The same networks as towers', in PyTorch (NCHW for LeNet-5), truncated-normal weights."""
    nn = torch.nn
    if model == "MLP":
        net = nn.Sequential(nn.Flatten(), nn.Linear(784, 500), nn.ReLU(), nn.Linear(500, 10))
        regularized = [net[1].weight, net[3].weight]
    else:  # LeNet-5: conv5x5x32 SAME + ReLU, pool 2, conv5x5x64 SAME + ReLU, pool 2, fc512 + ReLU, fc10
        net = nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                            nn.Linear(7 * 7 * 64, 512), nn.ReLU(), nn.Linear(512, 10))
        regularized = [net[7].weight, net[9].weight]  # the book's L2: fully connected weights only
    with torch.no_grad():
        for m in net:
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.trunc_normal_(m.weight, std=0.1, a=-0.2, b=0.2)
                m.bias.fill_(0.0 if model == "MLP" or isinstance(m, nn.Conv2d) else 0.1)
    return net, regularized


def _torch_worker(spec) -> dict:
    """PyTorch eager, the same model, optimizer, L2 and EMA as towers."""
    t_launch = spec["t_launch"]
    import torch

    marks = {"imports": _since(t_launch)}
    gpu = spec["devices"] != "cpu"
    dev = torch.device("cuda:0" if gpu else "cpu")
    torch.backends.cudnn.benchmark = True  # pick the fastest conv algorithms (during warm-up)
    torch.backends.cudnn.allow_tf32 = False  # towers computes in plain float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    name, lr, momentum = MODELS[spec["model"]]
    net, regularized = _torch_net(torch, spec["model"])
    net = net.to(dev)
    reg_ids = {id(p) for p in regularized}
    params = list(net.parameters())
    weights = [p for p in params if id(p) in reg_ids]
    others = [p for p in params if id(p) not in reg_ids]
    # weight_decay S adds S*w to the gradient: the gradient of S * sum(w**2) / 2.
    opt = torch.optim.SGD([{"params": weights, "weight_decay": 1e-4}, {"params": others}],
                          lr=lr, momentum=momentum)
    ema = [p.detach().clone() for p in params]
    d = numpy.load(spec["data"])
    gb = spec["batch"]
    shape = (gb, 28, 28) if spec["model"] == "MLP" else (gb, 1, 28, 28)
    rng = numpy.random.default_rng(0)
    ring = []
    for _ in range(RING):  # pinned host batches, as towers stages through pinned memory
        idx = rng.choice(len(d["x"]), gb, replace=False)
        xh, yh = torch.from_numpy(d["x"][idx]), torch.from_numpy(d["y"][idx].astype(numpy.int64))
        ring.append((xh.pin_memory(), yh.pin_memory()) if gpu else (xh, yh))
    marks["trainer built"] = _since(t_launch)
    loss_fn = torch.nn.functional.cross_entropy
    last = {}

    def step(k):
        xh, yh = ring[k % RING]
        xb = xh.to(dev, non_blocking=True).float().mul_(1.0 / 255).view(shape)
        loss = loss_fn(net(xb), yh.to(dev, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        decay = min(0.99, (1 + k) / (10 + k))  # TF's ExponentialMovingAverage with num_updates
        with torch.no_grad():
            torch._foreach_lerp_(ema, params, 1.0 - decay)
        last["loss"] = loss

    sync = torch.cuda.synchronize if gpu else (lambda: None)
    step(0)
    sync()
    marks["first step done"] = _since(t_launch)
    t = time_steps(step, sync, spec["steps"], spec["warmup"], spec["rounds"])
    loss = float(last["loss"])
    k = t.pop("next_k")
    launches = count_launches(step, sync, spec["profile_steps"], k, 1) if gpu else {"na": "CPU run"}
    return dict(t, global_batch=gb, loss=loss, startup=marks, launches=launches)


WORKERS = {"env": _env_worker, "towers": _towers_worker, "torch": _torch_worker}


# -- driver ---------------------------------------------------------------------------


def _child_env(cache_dir: str | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if cache_dir is not None:
        env["CUPY_CACHE_DIR"] = cache_dir
    return env


def run_worker(kind: str, spec: dict, timeout: float, cache_dir: str | None = None) -> dict:
    """Run one worker in a fresh process; {"error": ...} if it failed."""
    spec = dict(spec, t_launch=time.time())
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_child_env(cache_dir),
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT)]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-6:]
        return {"error": f"exit {p.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1][len(RESULT):])


def run_main_job(where: str, steps: int | None, timeout: float, tmp: str, cache_dir: str | None = None) -> dict:
    """Wall time of ``python -m towers.train --n-gpu 2`` (the default job) in a subprocess."""
    logdir = tempfile.mkdtemp(prefix="main-", dir=tmp)
    cmd = [sys.executable, "-m", "towers.train", "--n-gpu", "2", "--logdir", logdir]
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
    done = re.search(r"done: (\d+) steps .*? in ([\d.]+) s, ([\d.]+) examples/sec", text)
    if done:
        out.update(steps=int(done.group(1)), loop_s=float(done.group(2)), examples_per_sec=float(done.group(3)))
    acc = re.search(r"test accuracy: ([\d.]+) \(raw weights\), ([\d.]+) \(EMA", text)
    if acc:
        out["test_accuracy_ema"] = float(acc.group(2))
    return out


def _fmt(v, spec="{:.0f}", na="n/a"):
    return na if v is None else spec.format(v)


def _plan(gpus: int, torch_ok: bool, quick: bool) -> list[dict]:
    """The rows: towers configurations and PyTorch references."""
    dev = "0" if gpus else "cpu"
    where = "GPU 0" if gpus else "CPU"
    rows = []
    for model in MODELS:
        rows.append(dict(name=f"{model} towers 1 tower, {where}, b100", kind="towers", model=model, towers=1,
                         devices=dev))
        rows.append(dict(name=f"{model} towers 2 towers sharing {where}, global 200", kind="towers", model=model,
                         towers=2, devices=dev))
        if gpus >= 2:
            rows.append(dict(name=f"{model} towers {gpus} towers on {gpus} GPUs, global {100 * gpus}",
                             kind="towers", model=model, towers=gpus, devices=",".join(map(str, range(gpus)))))
        else:
            rows.append(dict(name=f"{model} towers N towers on N GPUs", kind="skip",
                             note="skipped: only one GPU" if gpus == 1 else "skipped: no GPU"))
        for b in (100, 200):
            row = dict(name=f"{model} PyTorch eager, {where}, b{b}", kind="torch", model=model, batch=b, devices=dev)
            rows.append(row if torch_ok else dict(row, kind="skip", note="skipped: torch not installed"))
    return rows


def _print_table(rows: list[dict]) -> None:
    head = ("row", "samples/s", "wall us/step", "host us/step", "all threads us/step", "kernel us/step", "launches/tower-step",
            "copies/step", "last loss")
    print(f"| {head[0]:<50} | " + " | ".join(f"{h:>{max(len(h), 9)}}" for h in head[1:]) + " |")
    print(f"| {'-' * 50} | " + " | ".join("-" * max(len(h), 9) for h in head[1:]) + " |")
    for r in rows:
        res = r.get("result") or {}
        if r["kind"] == "skip" or "error" in res:
            msg = r.get("note") if r["kind"] == "skip" else "FAILED: " + res["error"][:160]
            print(f"| {r['name']:<50} | {msg}")
            continue
        ln = res["launches"]
        vals = [res["samples_per_sec"], res["wall_us_per_step"], res["host_us_per_step"], res.get("cpu_us_per_step"),
                ln.get("kernel_us_per_step"), ln.get("kernels_per_tower_step"), ln.get("copies_per_step"), res["loss"]]
        specs = ["{:.0f}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.1f}", "{:.3f}"]
        cells = [_fmt(v, s) for v, s in zip(vals, specs)]
        print(f"| {r['name']:<50} | " + " | ".join(f"{c:>{max(len(h), 9)}}" for c, h in zip(cells, head[1:])) + " |")


def _print_startup(rows: list[dict]) -> None:
    print("start-up: seconds from process launch to each mark (cold: empty CuPy kernel cache; warm: same cache again)")
    print(f"| {'row':<50} | {'run':<5} | {'imports':>8} | {'built':>8} | {'1st step':>8} |")
    print(f"| {'-' * 50} | ----- | -------- | -------- | -------- |")
    for r in rows:
        for run in ("cold", "warm", "once"):
            res = r.get({"cold": "cold", "warm": "result", "once": "result"}[run]) or {}
            if (run == "once") != (r["kind"] == "torch") or "startup" not in res:
                continue
            s = res["startup"]
            label = "-" if run == "once" else run
            print(f"| {r['name']:<50} | {label:<5} | {s['imports']:8.2f} | {s['trainer built']:8.2f} | "
                  f"{s['first step done']:8.2f} |")


def _ratio(out: dict, name: str, num, den, target: float, below: bool = False) -> None:
    if num is None or den is None:
        print(f"{name}: n/a")
        out[name] = None
        return
    v = num / den
    met = v < target if below else v >= target
    print(f"{name}: {v:.2f} (target {'<' if below else '>='} {target:g}) [{'met' if met else 'MISSED'}]")
    out[name] = v


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + line
        self.exit(2, f"bench_gpu: error: {message} (see --help)\n")


def main(argv=None) -> int:
    ap = _Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="timed MLP steps per round (default 1000; --quick 10)")
    ap.add_argument("--lenet-steps", type=int, default=None, help="timed LeNet-5 steps per round (default 200)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default 30)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per row, best kept (default 3)")
    ap.add_argument("--profile-steps", type=int, default=None, help="steps under torch.profiler (default 10)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, on the CPU when there is no GPU")
    ap.add_argument("--no-main-job", action="store_true", help="skip the default main job comparison")
    ap.add_argument("--verbose", action="store_true", help="print the kernel names counted for each row, with their time per step")
    ap.add_argument("--json", help="also write every figure to this file")
    ap.add_argument("--timeout", type=float, default=300, help="seconds allowed to each subprocess")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(RESULT + json.dumps(WORKERS[a.worker](json.loads(a.spec))), flush=True)
        return 0
    q = a.quick
    steps = a.steps if a.steps is not None else (10 if q else 1000)
    lenet_steps = a.lenet_steps if a.lenet_steps is not None else (2 if q else 200)
    warmup = a.warmup if a.warmup is not None else (2 if q else 30)
    rounds = a.rounds if a.rounds is not None else (1 if q else 3)
    profile_steps = a.profile_steps if a.profile_steps is not None else (2 if q else 10)
    if min(steps, lenet_steps, rounds, profile_steps) < 1 or warmup < 0:
        ap.error("--steps, --lenet-steps, --rounds and --profile-steps must be >= 1, --warmup >= 0")
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        ap.error(f"--json {a.json}: its directory does not exist; create it or pick another path")

    tmp = tempfile.mkdtemp(prefix="towers-bench-gpu-")
    try:
        return _bench(a, tmp, steps, lenet_steps, warmup, rounds, profile_steps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bench(a, tmp, steps, lenet_steps, warmup, rounds, profile_steps) -> int:
    data = os.path.join(tmp, "mnist_shaped.npz")
    make_data(data, 2000 if a.quick else 10000)
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
    print(f"steps per round: MLP {steps}, LeNet-5 {lenet_steps}; {rounds} rounds (best kept) after "
          f"{warmup} warm-up steps; {profile_steps} profiled steps; batch {BATCH} per tower", flush=True)

    rows = _plan(gpus, torch_ok, a.quick)
    failed = False
    for r in rows:
        if r["kind"] == "skip":
            continue
        spec = {k: r[k] for k in ("model", "devices") if k in r}
        spec.update(data=data, steps=steps if r["model"] == "MLP" else lenet_steps, warmup=warmup,
                    rounds=rounds, profile_steps=profile_steps)
        t0 = time.perf_counter()
        if r["kind"] == "towers":
            spec["towers"] = r["towers"]
            cache = tempfile.mkdtemp(prefix="cupy-cache-", dir=tmp)
            # Empty kernel cache: start-up only matters here, so one round and no profiler.
            r["cold"] = run_worker("towers", dict(spec, rounds=1, profile=False), a.timeout, cache)
            r["result"] = run_worker("towers", dict(spec, profile=True), a.timeout, cache)  # the same cache, warm
        else:
            spec["batch"] = r["batch"]
            r["result"] = run_worker("torch", spec, a.timeout)
        res = r["result"]
        if "error" in res:
            failed = True
        else:
            res["samples_per_sec"] = res["global_batch"] / res["wall_us_per_step"] * 1e6
        print(f"  measured {r['name']} in {time.perf_counter() - t0:.1f} s"
              + (f": FAILED {res['error']}" if "error" in res else ""), flush=True)

    main_job = {}
    if not a.no_main_job:
        job_steps = 100 if a.quick else None
        if gpus:
            cache = tempfile.mkdtemp(prefix="cupy-cache-main-", dir=tmp)
            main_job["GPU, cold kernel cache"] = run_main_job("gpu", job_steps, a.timeout, tmp, cache)
            main_job["GPU, warm kernel cache"] = run_main_job("gpu", job_steps, a.timeout, tmp, cache)
        main_job["CPU, 2 cores"] = run_main_job("cpu", job_steps, a.timeout, tmp)
        failed |= any("error" in v for v in main_job.values())

    print()
    _print_table(rows)
    print()
    _print_startup(rows)
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
    g = {r["name"]: (r.get("result") or {}).get("samples_per_sec") for r in rows}
    where = "GPU 0" if gpus else "CPU"
    ratios: dict = {}
    for model, target in (("MLP", 1.0), ("LeNet-5", 0.8)):
        _ratio(ratios, f"{model} towers 1 tower / PyTorch b100", g.get(f"{model} towers 1 tower, {where}, b100"),
               g.get(f"{model} PyTorch eager, {where}, b100"), target)
        _ratio(ratios, f"{model} towers 2 sharing / PyTorch b200",
               g.get(f"{model} towers 2 towers sharing {where}, global 200"),
               g.get(f"{model} PyTorch eager, {where}, b200"), target)
    warm = main_job.get("GPU, warm kernel cache", {}).get("wall_s")
    _ratio(ratios, "main job GPU warm wall / CPU wall", warm, main_job.get("CPU, 2 cores", {}).get("wall_s"),
           1.0, below=True)
    if a.json:
        report = {"env": env, "settings": dict(steps=steps, lenet_steps=lenet_steps, warmup=warmup, rounds=rounds,
                                               profile_steps=profile_steps, batch_per_tower=BATCH, quick=a.quick),
                  "rows": rows, "main_job": main_job, "ratios": ratios}
        with atomic_path(a.json) as path:
            Path(path).write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
