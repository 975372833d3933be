"""What the GPU tests share: the device under test, runs of one seed on it and on the CPU, and their differences.

The device under test is GPU 0 (``DEVICE`` "0").  ``TOWERS_TEST_GPU_AS=cpu``
runs the GPU tests that take their device from here on the CPU instead (a
dry run of the tests themselves on a machine without a GPU: both sides are
then CPU runs and must agree exactly); tests that need CuPy itself still
skip.  ``TOWERS_GPU_REPORT=PATH`` appends each comparison's measured
differences to PATH as JSON lines (``tools/gpu_check.py`` keeps them with
its logs), so a GPU run records how close it came to each tolerance.

The CPU reference runs NumPy's array operations (``cpu_kernels`` numpy):
the GPU kernels round as those do, not as numba's fused loops.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from towers import Config, Trainer

DRY = os.environ.get("TOWERS_TEST_GPU_AS") == "cpu"
DEVICE = "cpu" if DRY else "0"


def xp():
    """The array module of the device under test (NumPy in a dry run)."""
    if DRY:
        return np
    import cupy

    return cupy


def record(case: str, **values) -> None:
    """Append ``case``'s measured values to ``$TOWERS_GPU_REPORT`` (when set) as one JSON line."""
    path = os.environ.get("TOWERS_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case, "dry": DRY, **values}, default=float) + "\n")


def rel(a, b) -> float:
    """||a - b|| / ||b|| over float64 copies (0 when both are 0; inf when a holds NaN or inf and b does not)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if not np.isfinite(a).all():
        return 0.0 if np.array_equal(a, b, equal_nan=True) else float("inf")
    den = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    return float(num / den) if den else float(num)


def flat(named: dict) -> np.ndarray:
    return np.concatenate([np.ravel(v).astype(np.float64) for _, v in sorted(named.items())])


@dataclass
class Run:
    weights: dict  # name -> host array (weights, then buffers)
    ema: dict
    losses: list  # the last step's towers' losses
    replicas: list  # each replica's flat parameter buffer
    accuracy: float  # EMA accuracy on the test split
    on_device: bool  # whether the training set stayed on the device


def train(devices: str, n_steps: int, dataset, *, step="run", **settings) -> Run:
    """``n_steps`` steps of a Trainer of ``settings`` on ``devices``; ``step`` "run" (``run_steps``, the run's
    own input) or "batch" (``train_step`` with host batches drawn from the same shuffle)."""
    cfg = Config(devices=devices, cpu_kernels="numpy", quiet=True, summary_every=0, **settings)
    with Trainer(cfg, dataset=dataset) as tr:
        if step == "run":
            losses = tr.run_steps(n_steps, want_loss=True)
        else:
            from towers.data.batches import BatchSource

            src = BatchSource(tr.dataset, tr.global_batch, tr.cfg.seed)
            for k in range(n_steps):
                losses = tr.train_step(*src.next_batch(), want_loss=k == n_steps - 1)
        tr.finish()
        tr.synchronize()
        from towers.devices.placement import to_host

        return Run(tr.get_weights(), tr.get_weights(ema=True), [float(v) for v in losses],
                   [to_host(r.params, copy=True) for r in tr.replicas], tr.evaluate(ema=True)["accuracy"],
                   tr.device_data is not None)


def compare(case: str, dataset, n_steps: int, tol: float = 1e-4, *, step="run", same_replicas=True, **settings):
    """The run on the device under test against the CPU run of the same settings; both returned.

    Checks: the weights, buffers and EMA within ``tol`` (relative, over all
    values), the last losses within ``tol`` (relative), test accuracy within
    2 points, and (``same_replicas``) every replica bit-identical on each side.
    """
    gpu = train(DEVICE, n_steps, dataset, step=step, **settings)
    cpu = train("cpu", n_steps, dataset, step=step, **settings)
    d = {"weights": rel(flat(gpu.weights), flat(cpu.weights)), "ema": rel(flat(gpu.ema), flat(cpu.ema)),
         "loss": rel(gpu.losses, cpu.losses), "accuracy": abs(gpu.accuracy - cpu.accuracy)}
    per_name = {k: rel(gpu.weights[k], cpu.weights[k]) for k in cpu.weights}
    worst = max(per_name, key=per_name.get)
    record(case, steps=n_steps, tol=tol, worst=worst, worst_rel=per_name[worst], on_device=gpu.on_device, **d)
    assert np.isfinite(flat(gpu.weights)).all(), f"{case}: non-finite weights on the device"
    assert d["weights"] < tol, f"{case}: weights differ by {d['weights']:.3g} (worst {worst}: {per_name[worst]:.3g})"
    assert d["ema"] < tol, f"{case}: EMA differs by {d['ema']:.3g}"
    assert d["loss"] < tol, f"{case}: losses {gpu.losses} against {cpu.losses}"
    assert d["accuracy"] <= 0.02, f"{case}: accuracy {gpu.accuracy} against {cpu.accuracy}"
    if same_replicas:
        for side, run in (("device", gpu), ("cpu", cpu)):
            for i, p in enumerate(run.replicas[1:], 1):
                assert np.array_equal(p, run.replicas[0]), f"{case}: {side} replica {i} differs from replica 0"
    return gpu, cpu


def images(n: int, shape: tuple, classes: int = 10, seed: int = 0, test: int = 60):
    """uint8 images of ``shape`` whose class shows in their mean brightness (a learnable synthetic set),
    with ``test`` more as the test split."""
    from towers import Dataset

    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n + test)
    x = rng.integers(0, 128, (n + test,) + tuple(shape), dtype=np.uint8)
    x += (y * (127 // max(classes - 1, 1))).astype(np.uint8).reshape((-1,) + (1,) * len(shape))
    return Dataset.from_arrays(x[:n], y[:n], x[n:], y[n:])
