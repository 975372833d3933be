"""Training throughput of towers against PyTorch and TensorFlow, side by side, on the CPU.

    python tools/bench_train.py                 # everything installed, best of 3
    python tools/bench_train.py --repeats 1 --no-lenet

What is timed (samples/s, MNIST-shaped uint8 data, float32, SGD, L2 1e-4):

* towers MLP 784-500-10 through the real loop (``towers.Trainer.fit``: input
  thread, staging, forward/backward, all-reduce, update+EMA, log lines), with
  1 tower (batch 100) and 2 CPU towers (batch 100 each = global 200), towers
  concurrent in threads (the default) and in sequence;
* towers' bare step math at the same batch: forward/backward + a plain SGD
  update on pre-converted float32 input, towers in the same threads, and
  nothing else (no input pipeline, all-reduce, EMA or logging);
* the input pipeline alone (``BatchSource`` + ``Prefetcher``), global batch 200;
* PyTorch eager (if installed), the same model, L2 and EMA, at batch 100 and 200;
* TensorFlow ``MirroredStrategy`` over 2 logical CPU devices (if installed),
  global batch 200, ``tf.function`` train step;
* LeNet-5: towers with 2 CPU towers against PyTorch's same network, batch 200;
* ResNet-20 (He et al.'s CIFAR network: batch norm, option-A shortcuts) on
  32x32x3 data: towers with 2 CPU towers x 64 against PyTorch eager's same
  network (same initialization scheme, batch norm momentum and epsilon, L2 on
  weights only, SGD momentum 0.9, EMA) at batch 128 on 2 threads.

``--load-rows`` measures only the load rows: one CPU tower (``python -m
towers.train --model lenet5 --steps 20``, the whole command) with every core
in BLAS, with the default BLAS threads and with OpenBLAS's shorter thread
timeout, on the machine as it is and beside one busy process.

``--evaluate-rows`` measures only the evaluation rows: ResNet-20's evaluation
of 500 test images by the Trainer (``Trainer.evaluate``, one CPU tower) and
by a loaded run (``towers.load(run).evaluate()``), each in a process of its
own after a warm-up call, beside one busy process; with ``--compare-root``
another checkout's loaded run too (before a change)::

    python tools/bench_train.py --evaluate-rows --eval-calls 3 --repeats 2 --compare-root ../base

``--kernel-rows`` measures only the kernel rows (ResNet-20 2 x 32, LeNet-5
2 x 50 with Adam, MLP 2 x 100; 2 CPU towers against PyTorch eager on 2
threads), the median of alternating rounds, each printed with its target and
the BLAS setup each Python found, then its fourth row, the MLP from a JPEG
TFRecord against npz (``tools/bench_input.py --jpeg-epochs``; not with
``--no-jpeg-row``); ``--reference-python`` runs the PyTorch rows
in another Python, ``--compare-root`` adds another towers checkout's rows to
the same rounds (``kernel_rows``); ``--cpu-kernels numpy`` runs the towers rows on the
ops' NumPy passes.

Every measurement runs in its own subprocess (``--worker``), so BLAS/OpenMP
thread settings of one library never leak into another, and the figure kept is
the best of ``--repeats`` runs: the machine may be shared, and the best run is
the one least disturbed by others.  Optional dependencies: see
``tools/README_bench.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parents[1]
N_EXAMPLES = 12000


def make_data(path: str, n: int = N_EXAMPLES, shape: tuple = (28, 28)) -> None:
    """MNIST-shaped (or ``shape``) uint8 images with learnable labels (a fixed random projection).

    Learnable labels keep the weights finite at the benchmark's learning rate:
    a diverged run would time NaN/denormal arithmetic instead of training.
    """
    rng = numpy.random.default_rng(0)
    x = rng.integers(0, 256, (n,) + shape, dtype=numpy.uint8)
    proj = rng.standard_normal((int(numpy.prod(shape)), 10)).astype(numpy.float32)
    y = (x.reshape(n, -1).astype(numpy.float32) @ proj).argmax(1).astype(numpy.int32)
    numpy.savez(path, x=x, y=y, x_test=x[:500], y_test=y[:500])


# -- workers: each prints one JSON line {"samples_per_sec": ...} ----------------------


def _towers_loop(a) -> float:
    from towers import Config, Trainer

    extra = {"optimizer": a.optimizer} if a.optimizer else {}
    if a.cpu_kernels:
        extra["cpu_kernels"] = a.cpu_kernels
    cfg = Config(n_gpu=a.towers, devices="cpu", data=a.data, model=a.model, steps=a.steps, lr=a.lr, **extra,
                 batch_size=a.batch_size, cpu_towers=a.cpu_towers, blas_threads=a.blas_threads, quiet=True,
                 log_every=max(1, a.steps // 4), logdir=tempfile.mkdtemp(prefix="bench-"))
    with Trainer(cfg) as trainer:
        return trainer.fit()["examples_per_sec"]


def _towers_bare(a) -> float:
    """Forward/backward + plain SGD, towers in threads as the trainer runs them."""
    from towers.devices.cpu_threads import TowerThreads, blas_threads, set_blas_threads
    from towers.nn.models import build_model
    from towers.nn.replica import Replica

    d = numpy.load(a.data)
    model = build_model(a.model, d["x"].shape[1:], 10, 500)
    threaded = a.towers > 1 and a.cpu_towers == "threads"
    set_blas_threads(a.blas_threads or blas_threads(a.towers, serial=not threaded))  # as the trainer sets it
    reps = [Replica(model, numpy) for _ in range(a.towers)]
    for r in reps:
        r.set_params(model.init_params(0))
    b = 100
    xs = [(d["x"][i * b : (i + 1) * b] * numpy.float32(1 / 255)).astype(numpy.float32) for i in range(a.towers)]
    ys = [d["y"][i * b : (i + 1) * b] for i in range(a.towers)]
    lr = numpy.float32(a.lr)

    def tower(i):
        r = reps[i]
        r.loss_and_grads(xs[i], ys[i], 1e-4, False)
        r.grads *= lr
        r.params -= r.grads

    pool = TowerThreads(a.towers) if threaded else None
    step = (lambda: pool.run(tower)) if pool else (lambda: [tower(i) for i in range(a.towers)])
    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    if pool:
        pool.close()
    return a.steps * b * a.towers / (time.perf_counter() - t0)


def _pipeline(a) -> float:
    from towers.data.batches import BatchSource, Prefetcher
    from towers.data.loading import load_dataset

    ds = load_dataset(a.data)
    steps = 3000
    pf = Prefetcher(BatchSource(ds, 100 * a.towers, 0), steps)
    pf.get()
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        pf.get()
    rate = (steps - 1) * 100 * a.towers / (time.perf_counter() - t0)
    pf.close()
    return rate


def _torch_resnet(torch, n: int):
    """He et al.'s CIFAR ResNet (6n+2 layers, option A) as towers' ``resnet``: same layers, init, BN settings."""
    nn, F = torch.nn, torch.nn.functional

    def conv(cin, cout, stride=1):
        c = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        nn.init.normal_(c.weight, 0.0, (2.0 / (9 * cin)) ** 0.5)
        return c

    def bn(c):  # TF's momentum 0.99 is PyTorch's 0.01; epsilon 1e-3
        return nn.BatchNorm2d(c, eps=1e-3, momentum=0.01)

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1, self.b1, self.c2, self.b2 = conv(cin, cout, stride), bn(cout), conv(cout, cout), bn(cout)
            self.stride, self.pad = stride, cout - cin

        def forward(self, x):
            out = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
            short = x if self.stride == 1 else F.pad(x[:, :, ::self.stride, ::self.stride], (0, 0, 0, 0, 0, self.pad))
            return F.relu(out + short)

    layers, cin = [conv(3, 16), bn(16), nn.ReLU()], 16
    for stage, f in enumerate((16, 32, 64)):
        for b in range(n):
            layers.append(Block(cin, f, 2 if stage and not b else 1))
            cin = f
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def _torch(a) -> float:
    import torch

    nn = torch.nn
    torch.manual_seed(0)
    if a.threads:
        torch.set_num_threads(a.threads)
    d = numpy.load(a.data)
    x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"]).long()
    gb = a.global_batch
    momentum = 0.0
    if a.model == "resnet20":
        m = _torch_resnet(torch, 3).to(memory_format=torch.channels_last)
        shape, momentum = (gb, 32, 32, 3), 0.9
    elif a.model == "mlp":
        m = nn.Sequential(nn.Flatten(), nn.Linear(784, 500), nn.ReLU(), nn.Linear(500, 10))
        shape = (gb, 28, 28)
    else:
        m = nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, 10))
        shape = (gb, 1, 28, 28)
    weights = [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() in (2, 4)
               and (a.model == "resnet20" or p.dim() == 2)]  # L2 on weights, never on biases or BN
    others = [p for p in m.parameters() if all(p is not w for w in weights)]
    groups = [{"params": weights, "weight_decay": 1e-4}, {"params": others}]
    if a.optimizer == "adam":  # towers' Adam: TF's epsilon, L2 added to the gradient (torch's weight_decay)
        opt = torch.optim.Adam(groups, lr=a.lr, eps=1e-8)
    else:
        opt = torch.optim.SGD(groups, lr=a.lr, momentum=momentum)
    params = list(m.parameters())
    ema = [p.detach().clone() for p in params]
    perm = torch.randperm(len(x))
    scale = 1.0 / 255

    def step(k):
        idx = perm[(k * gb) % (len(x) - gb):][:gb]
        xb = x[idx].view(shape).float().mul_(scale)
        if len(shape) == 4 and shape[-1] == 3:  # NHWC data: a channels-last view, as towers' layout
            xb = xb.permute(0, 3, 1, 2)
        loss = nn.functional.cross_entropy(m(xb), y[idx])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        with torch.no_grad():  # the same EMA towers keeps (decay 0.99)
            torch._foreach_lerp_(ema, [p.detach() for p in params], 0.01)

    for k in range(3):
        step(k)
    t0 = time.perf_counter()
    for k in range(a.steps):
        step(k)
    return a.steps * gb / (time.perf_counter() - t0)


def _tf_mirrored(a) -> float:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
    d = numpy.load(a.data)
    gb = a.global_batch
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((28, 28)), tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(500, activation="relu", kernel_regularizer=tf.keras.regularizers.l2(5e-5)),
            tf.keras.layers.Dense(10, kernel_regularizer=tf.keras.regularizers.l2(5e-5)),
        ])
        opt = tf.keras.optimizers.SGD(a.lr, use_ema=True, ema_momentum=0.99)
        opt.build(model.trainable_variables)  # EMA slots made here, not inside tf.function
    ds = (tf.data.Dataset.from_tensor_slices((d["x"], d["y"])).repeat().shuffle(10000).batch(gb, drop_remainder=True)
          .map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y)).prefetch(8))
    it = iter(strategy.experimental_distribute_dataset(ds))
    sce = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(sce(y, model(x, training=True)), global_batch_size=gb)
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    @tf.function
    def step(batch):
        strategy.run(replica_step, args=batch)

    for _ in range(5):
        step(next(it))
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step(next(it))
    return a.steps * gb / (time.perf_counter() - t0)


def blas_setup(torch_threads: int = 0) -> str:
    """One line: the BLAS (and PyTorch's threads and kernels) this Python finds, as threadpoolctl reports them."""
    parts = []
    try:
        import torch

        if torch_threads:
            torch.set_num_threads(torch_threads)
        parts.append(f"torch {torch.__version__} {torch.get_num_threads()} threads, "
                     f"oneDNN {'on' if torch.backends.mkldnn.is_available() else 'off'}, "
                     f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    except ImportError:
        pass
    try:
        from threadpoolctl import threadpool_info

        for i in threadpool_info():
            parts.append(f"{i.get('internal_api')} {i.get('version')} {i.get('architecture') or ''} "
                         f"{i.get('num_threads')} threads".replace("  ", " "))
    except ImportError:
        parts.append("threadpoolctl not installed")
    env = " ".join(f"{k}={os.environ[k]}" for k in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                    "MKL_NUM_THREADS") if k in os.environ)
    return "; ".join(parts) + (f"; {env}" if env else "")


def _blas_info(a) -> str:
    return blas_setup(a.threads)


def _evaluate_calls(evaluate, calls: int) -> float:
    """The median seconds of ``calls`` calls of ``evaluate()`` after one warm-up call."""
    evaluate()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        evaluate()
        times.append(time.perf_counter() - t0)
    return float(numpy.median(times))


def _trainer_evaluate(a) -> float:
    """The Trainer's own evaluation of its test data (one CPU tower, the run's model), seconds a call."""
    from towers import Config, Trainer

    cfg = Config(n_gpu=1, devices="cpu", data=a.data, model=a.model, steps=1, quiet=True, summary_every=0,
                 logdir=tempfile.mkdtemp(prefix="bench-"))
    with Trainer(cfg) as trainer:
        return _evaluate_calls(trainer.evaluate, a.steps)


def _loaded_evaluate(a) -> float:
    """``towers.load(run).evaluate()`` of the run in ``--logdir`` (its test data), seconds a call."""
    import towers

    with towers.load(a.logdir) as model:
        return _evaluate_calls(model.evaluate, a.steps)


WORKERS = {"blas-info": _blas_info, "towers-loop": _towers_loop, "towers-bare": _towers_bare, "pipeline": _pipeline,
           "torch": _torch, "tf-mirrored": _tf_mirrored, "trainer-evaluate": _trainer_evaluate,
           "loaded-evaluate": _loaded_evaluate}


# -- driver ---------------------------------------------------------------------------


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _measure_once(data: str, worker: str, kw: dict):
    """The worker's result (samples/s) from one fresh subprocess; None if it failed.

    ``kw["data"]`` overrides ``data``; ``kw["python"]`` runs the worker with
    another Python (a PyTorch venv), ``kw["root"]`` with another towers
    checkout on ``PYTHONPATH`` (the code before a change, side by side).
    """
    kw = dict(kw)
    python, root = kw.pop("python", sys.executable), kw.pop("root", ROOT)
    args = [python, str(Path(__file__).resolve()), "--worker", worker, "--data", kw.pop("data", data)]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    p = subprocess.run(args, capture_output=True, text=True, cwd=root,
                       env=dict(os.environ, PYTHONPATH=str(root)))
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        print(f"  {worker} {kw} failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])["result"]


def _measure_all(data: str, repeats: int, plan: dict, median: bool = False) -> dict:
    """Samples/s per row over ``repeats`` rounds: the best run's, or with ``median`` the median run's.

    Rounds go over every row in turn (not each row ``repeats`` times in a row),
    so a burst of load from elsewhere on the machine hits all rows alike and the
    ratios stay side by side.
    """
    runs: dict = {name: [] for name in plan}
    for _ in range(repeats):
        for name, (worker, kw) in plan.items():
            v = _measure_once(data, worker, kw)
            if v is not None:
                runs[name].append(v)
    pick = (lambda v: float(numpy.median(v))) if median else max
    return {name: pick(v) if v else None for name, v in runs.items()}


# The kernel rows: (model, towers' per-tower batch, optimizer, lr, data, target towers / PyTorch).
KERNEL_ROWS = (("ResNet-20, 32x32x3, 2 x 32, SGD momentum", "resnet20", 32, "sgd", 0.05, "cifar", 1.2),
               ("LeNet-5, MNIST 28x28, 2 x 50, Adam", "lenet5", 50, "adam", 0.001, "mnist", 1.0),
               ("MLP 784-500-10, MNIST, 2 x 100", "mlp", 100, "sgd", 0.1, "mnist", 1.3))


def kernel_rows(data: dict, a) -> int:
    """The kernel rows alone: each model with 2 CPU towers against PyTorch eager on 2 threads.

    The same network, global batch and optimizer (L2 and EMA on both sides);
    ``a.repeats`` rounds alternating over every row, the median kept;
    ``a.compare_root``, when given, adds each towers row for that checkout
    (the code before a change) to the same rounds.
    """
    ref = a.reference_python or sys.executable
    plan, steps = {}, {"resnet20": a.resnet_steps, "lenet5": a.lenet_steps, "mlp": a.steps}
    for title, model, b, opt, lr, d, _ in KERNEL_ROWS:
        common = dict(steps=steps[model], model=model, lr=lr, optimizer=opt, data=data[d])
        ours = dict(common, towers=2, batch_size=b, **({"cpu_kernels": a.cpu_kernels} if a.cpu_kernels else {}))
        plan[(title, "towers")] = ("towers-loop", ours)
        if a.compare_root:
            plan[(title, "before")] = ("towers-loop", dict(ours, root=a.compare_root))
        if not a.no_torch:
            plan[(title, "torch")] = ("torch", dict(common, global_batch=2 * b, threads=2, python=ref))
    print(f"towers: {_measure_once('', 'blas-info', {})}")
    if a.compare_root:
        print(f"before ({a.compare_root}): {_measure_once('', 'blas-info', dict(root=a.compare_root))}")
    if not a.no_torch:
        print(f"PyTorch ({ref}): {_measure_once('', 'blas-info', dict(python=ref, threads=2))}")
    print(f"measuring (median of {a.repeats} rounds over all rows, {os.cpu_count()} cores, "
          f"towers' cpu_kernels {a.cpu_kernels or 'default'}; "
          f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())})...", flush=True)
    r = _measure_all("", a.repeats, plan, median=True)
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    cols = ["towers", "PyTorch", "towers / PyTorch", "target"] + (["before", "before / PyTorch"] if a.compare_root else [])
    print("| row (samples/s) | " + " | ".join(cols) + " |")
    print("| --- |" + " --- |" * len(cols))

    def fmt(v, f="{:.0f}"):
        return "n/a" if v is None else f.format(v)

    for title, *_, target in KERNEL_ROWS:
        t, p, bf = r[(title, "towers")], r.get((title, "torch")), r.get((title, "before"))
        ratio = t / p if t and p else None
        verdict = "" if ratio is None else (" met" if ratio >= target else " MISSED")
        row = [fmt(t), fmt(p), fmt(ratio, "{:.2f}x") + verdict, f">= {target}x"]
        if a.compare_root:
            row += [fmt(bf), fmt(bf / p if bf and p else None, "{:.2f}x")]
        print(f"| {title} | " + " | ".join(row) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps({" / ".join(k): v for k, v in r.items()}, indent=1))
    if not a.no_jpeg_row:
        # The fourth row (JPEG TFRecord against npz) is the input benchmark's own measurement: run it, not a copy.
        print(flush=True)
        subprocess.run([sys.executable, "-m", "tools.bench_input", "--jpeg-epochs", "--rounds", str(a.repeats)],
                       cwd=ROOT, check=True)
    return 0


def _command_time(args: list, env: dict) -> tuple[float, float]:
    """(wall seconds of ``python -m towers.train args``, the training seconds its done line reports)."""
    import re

    with tempfile.TemporaryDirectory(prefix="bench-load-") as logdir:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "towers.train", *args, "--quiet", "--summary-every", "0",
                            "--logdir", logdir], capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, **env))
        wall = time.perf_counter() - t0
    done = re.search(r"training ([\d.]+) s,", p.stdout)
    if p.returncode != 0 or not done:
        raise SystemExit(f"towers.train {' '.join(args)} failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    return wall, float(done.group(1))


def load_rows(a) -> int:
    """The load rows: one CPU tower (``--model lenet5 --steps 20``, ``--load-data``) with each BLAS setting,
    on the machine as it is and beside one busy process (a Python spinning on a core), ``a.repeats`` rounds
    alternating the settings; the median of the whole command's wall time and of the training time its done
    line reports.  Rounds alternate quiet and busy, so that load from elsewhere falls on both."""
    cores = str(len(os.sched_getaffinity(0)))  # towers' cpu_count (this script runs without towers on its path)
    settings = {
        f"every core (--blas-threads {cores}: the default before)": (["--blas-threads", cores], {}),
        "the default (cores less one: 1 on 2 cores)": ([], {}),
        f"every core, OPENBLAS_THREAD_TIMEOUT=4": (["--blas-threads", cores], {"OPENBLAS_THREAD_TIMEOUT": "4"}),
    }
    command = ["--model", "lenet5", "--steps", "20", *(["--data", a.load_data] if a.load_data else [])]
    print(f"python -m towers.train {' '.join(command)} (one tower), {cores} cores; {_blas_info(a)}")
    runs = {}
    # Each round runs every setting quiet, then beside the busy process: load from elsewhere hits both alike.
    for r in range(a.repeats):
        for load in ("quiet", "busy"):
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
            try:
                print(f"round {r + 1}, {load}: load average before {os.getloadavg()[0]:.2f}", flush=True)
                for name, (args, env) in settings.items():
                    runs.setdefault((name, load), []).append(_command_time(command + args, env))
                    print(f"  {name}: {runs[(name, load)][-1][0]:.1f} s, training {runs[(name, load)][-1][1]:.1f} s",
                          flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    print("\n| BLAS threads | quiet: wall / training (s) | one busy process: wall / training (s) | busy / quiet |")
    print("| --- | --- | --- | --- |")
    for name in settings:
        (qw, qt), (bw, bt) = (numpy.median(numpy.array(runs[(name, load)]), axis=0) for load in ("quiet", "busy"))
        print(f"| {name} | {qw:.1f} / {qt:.1f} | {bw:.1f} / {bt:.1f} | {bw / qw:.1f}x |")
    return 0


def evaluate_rows(cifar: str, a) -> int:
    """The evaluation rows: ResNet-20's evaluation of 500 32x32x3 test images, the Trainer's own
    (``Trainer.evaluate``, one CPU tower) against a loaded run's (``towers.load(logdir).evaluate()``), each in a
    process of its own after a warm-up call, ``--eval-calls`` calls (median), beside one busy process (a Python
    spinning on a core), ``a.repeats`` rounds alternating the rows; with ``--compare-root`` the loaded run of
    that checkout too (the code before a change), on the same run."""
    logdir = tempfile.mkdtemp(prefix="bench-eval-run-")
    subprocess.run([sys.executable, "-m", "towers.train", "--model", "resnet20", "--n-gpu", "1", "--devices", "cpu",
                    "--steps", "1", "--data", cifar, "--logdir", logdir, "--quiet", "--summary-every", "0"],
                   check=True, capture_output=True, cwd=ROOT)
    rows = {"Trainer.evaluate() (one CPU tower)": ("trainer-evaluate", {}),
            "towers.load(run).evaluate()": ("loaded-evaluate", dict(logdir=logdir))}
    if a.compare_root:
        rows["towers.load(run).evaluate(), before"] = ("loaded-evaluate", dict(logdir=logdir, root=a.compare_root))
    cores = len(os.sched_getaffinity(0))
    print(f"ResNet-20, 500 test images of 32x32x3, {a.eval_calls} calls after a warm-up, {cores} cores, one busy process "
          f"beside; {_blas_info(a)}", flush=True)
    runs = {}
    for r in range(a.repeats):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            print(f"round {r + 1}: load average before {os.getloadavg()[0]:.2f}", flush=True)
            for name, (worker, kw) in rows.items():
                runs.setdefault(name, []).append(_measure_once(cifar, worker, dict(kw, model="resnet20",
                                                                                   steps=a.eval_calls)))
                print(f"  {name}: {runs[name][-1]} s a call", flush=True)
        finally:
            busy.kill()
            busy.wait()
    print("\n| evaluation of 500 images, beside one busy process | s a call (median of rounds) | / Trainer |")
    print("| --- | --- | --- |")
    trainer = numpy.median([t for t in runs["Trainer.evaluate() (one CPU tower)"] if t is not None])
    for name, times in runs.items():
        t = numpy.median([v for v in times if v is not None]) if any(v is not None for v in times) else None
        print(f"| {name} | {'n/a' if t is None else f'{t:.2f}'} | {'n/a' if t is None else f'{t / trainer:.2f}x'} |")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1500,
                    help="timed MLP steps per run (the loop's checkpoints and summaries amortize as in real runs)")
    ap.add_argument("--lenet-steps", type=int, default=10)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-tf", action="store_true")
    ap.add_argument("--no-lenet", action="store_true")
    ap.add_argument("--no-resnet", action="store_true")
    ap.add_argument("--resnet-steps", type=int, default=8)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--load-rows", action="store_true",
                    help="only the load rows: one LeNet-5 tower's BLAS threads, quiet and beside a busy process")
    ap.add_argument("--load-data", help="--load-rows: the training data (default: towers' own, the digits)")
    ap.add_argument("--evaluate-rows", action="store_true",
                    help="only the evaluation rows: ResNet-20's Trainer.evaluate against towers.load(run).evaluate(), "
                         "500 images, beside a busy process (--eval-calls calls each; --compare-root: that checkout's "
                         "loaded run too)")
    ap.add_argument("--eval-calls", type=int, default=5, help="--evaluate-rows: timed calls in each process")
    ap.add_argument("--logdir", help=argparse.SUPPRESS)  # worker mode: the run a loaded-evaluate worker loads
    # worker mode (internal)
    ap.add_argument("--worker", choices=sorted(WORKERS))
    ap.add_argument("--data")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--towers", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=200)
    ap.add_argument("--cpu-towers", default="threads")
    ap.add_argument("--blas-threads", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--optimizer", default="")
    ap.add_argument("--cpu-kernels", default="", choices=("", "auto", "numba", "numpy"),
                    help="the towers rows' cpu_kernels setting (--kernel-rows; default: the setting's own, auto): "
                         "numpy times the ops' NumPy passes")
    ap.add_argument("--only-resnet", action="store_true", help="measure the ResNet-20 rows alone")
    ap.add_argument("--kernel-rows", action="store_true",
                    help="the kernel rows alone: ResNet-20, LeNet-5 and MLP, 2 CPU towers against PyTorch eager on "
                         "2 threads, median of --repeats alternating rounds, each with its target")
    ap.add_argument("--no-jpeg-row", action="store_true",
                    help="--kernel-rows without its fourth row (MLP from a JPEG TFRecord against npz, "
                         "tools/bench_input.py --jpeg-epochs)")
    ap.add_argument("--reference-python", help="the Python that runs the PyTorch rows (a venv with torch); "
                                               "default: this one")
    ap.add_argument("--compare-root", help="another towers checkout (the code before a change) measured in the "
                                           "same rounds as this one (--kernel-rows)")
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps({"result": WORKERS[a.worker](a)}), flush=True)
        return 0
    if a.load_rows:
        return load_rows(a)

    tmp = tempfile.mkdtemp(prefix="towers-bench-")
    data = os.path.join(tmp, "mnist_shaped.npz")
    make_data(data)
    cifar = os.path.join(tmp, "cifar_shaped.npz")
    make_data(cifar, 2560, (32, 32, 3))
    if a.kernel_rows:
        return kernel_rows({"mnist": data, "cifar": cifar}, a)
    if a.evaluate_rows:
        return evaluate_rows(cifar, a)
    s = a.steps
    have_torch, ref = bool(a.reference_python) or _have("torch"), a.reference_python or sys.executable
    plan = {
        "towers 1 tower, batch 100 (loop)": ("towers-loop", dict(towers=1, steps=s)),
        "towers 1 tower, batch 100, 1 BLAS thread (loop)": ("towers-loop", dict(towers=1, steps=s, blas_threads=1)),
        "towers 2 towers threads, global 200 (loop)": ("towers-loop", dict(towers=2, steps=s)),
        "towers 2 towers serial, global 200 (loop)": ("towers-loop", dict(towers=2, steps=s, cpu_towers="serial")),
        "towers 2 towers threads, global 200 (bare step)": ("towers-bare", dict(towers=2, steps=s)),
        "towers 1 tower, batch 100 (bare step)": ("towers-bare", dict(towers=1, steps=s)),
        "input pipeline alone, global 200": ("pipeline", dict(towers=2)),
    }
    if a.only_resnet:  # the ResNet-20 rows alone (their own target), without the MLP's and LeNet-5's
        plan, a.no_tf, a.no_lenet = {}, True, True
    if not a.no_torch and have_torch and plan:
        plan["PyTorch eager, batch 100"] = ("torch", dict(global_batch=100, steps=s, python=ref))
        plan["PyTorch eager, batch 200"] = ("torch", dict(global_batch=200, steps=s, python=ref))
    if not a.no_tf and _have("tensorflow"):
        plan["TF MirroredStrategy 2 CPUs, global 200"] = ("tf-mirrored", dict(global_batch=200, steps=s))
    if not a.no_lenet:
        ls = a.lenet_steps
        plan["LeNet-5 towers 2 towers threads, global 200"] = (
            "towers-loop", dict(towers=2, steps=ls, model="lenet5", lr=0.05))
        if not a.no_torch and have_torch:
            plan["LeNet-5 PyTorch eager, batch 200"] = (
                "torch", dict(global_batch=200, steps=ls, model="lenet5", lr=0.05, python=ref))
    if not a.no_resnet:
        rs = a.resnet_steps
        plan["ResNet-20 towers 2 towers threads, 2 x 64, 32x32x3"] = (
            "towers-loop", dict(towers=2, steps=rs, model="resnet20", lr=0.05, batch_size=64, data=cifar))
        if not a.no_torch and have_torch:
            plan["ResNet-20 PyTorch eager, 2 threads, batch 128"] = (
                "torch", dict(global_batch=128, steps=rs, model="resnet20", lr=0.05, threads=2, data=cifar, python=ref))
    print(f"measuring (best of {a.repeats} rounds over all rows, {os.cpu_count()} cores)...", flush=True)
    r = _measure_all(data, a.repeats, plan)

    g = r.get
    two = g("towers 2 towers threads, global 200 (loop)")
    print()
    print(f"| {'what':<50} | {'samples/s':>10} |")
    print(f"| {'-' * 50} | {'-' * 10} |")
    for k, v in r.items():
        print(f"| {k:<50} | {'n/a' if v is None else f'{v:10.0f}'} |")
    print()

    def ratio(name, num, den, target=None, inverse=False):
        if num is None or den is None:
            print(f"{name}: n/a")
            return
        v = num / den
        verdict = "" if target is None else ("  [met]" if (v <= target if inverse else v >= target) else "  [MISSED]")
        want = "" if target is None else f" (target {'<=' if inverse else '>='} {target})"
        print(f"{name}: {v:.2f}{want}{verdict}")

    ratio("2 towers / PyTorch batch 200", two, g("PyTorch eager, batch 200"), 1.3)
    ratio("2 towers / TF MirroredStrategy", two, g("TF MirroredStrategy 2 CPUs, global 200"), 2.5)
    ratio("bare step / full loop (loop overhead factor)", g("towers 2 towers threads, global 200 (bare step)"),
          two, 1.15, inverse=True)
    ratio("input pipeline / trainer consumption", g("input pipeline alone, global 200"), two, 20)
    ratio("2 towers threads / serial", two, g("towers 2 towers serial, global 200 (loop)"))
    one = g("towers 1 tower, batch 100 (loop)")
    if two and one:
        print(f"scaling efficiency (2 towers / (2 x 1 tower)): {two / (2 * one):.2f}")
    ratio("LeNet-5 towers / PyTorch", g("LeNet-5 towers 2 towers threads, global 200"),
          g("LeNet-5 PyTorch eager, batch 200"), 0.7)
    ratio("ResNet-20 towers / PyTorch", g("ResNet-20 towers 2 towers threads, 2 x 64, 32x32x3"),
          g("ResNet-20 PyTorch eager, 2 threads, batch 128"), 0.7)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
