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


def rel(a, b, floor: float = 0.0) -> float:
    """||a - b|| / max(||b||, floor) over float64 copies (0 when both are 0; inf when a holds NaN or inf and b
    does not).  ``floor``: the norm below which ``b`` counts as rounding noise (a gradient that is zero by the
    mathematics, such as a bias before batch norm, is noise on both devices)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if not np.isfinite(a).all():
        return 0.0 if np.array_equal(a, b, equal_nan=True) else float("inf")
    den = max(np.linalg.norm(b), floor)
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


class Training:
    """A Trainer of ``settings`` on ``devices``, stepped one step at a time; ``step`` "run" (``run_steps``: the
    run's own input) or "batch" (``train_step`` with host batches drawn from the same shuffle)."""

    def __init__(self, devices: str, dataset, step: str = "run", **settings):
        from towers.data.batches import BatchSource

        cfg = Config(devices=devices, cpu_kernels="numpy", quiet=True, summary_every=0, **settings)
        self.tr = Trainer(cfg, dataset=dataset)
        self.how = step
        self.src = BatchSource(self.tr.dataset, self.tr.global_batch, self.tr.cfg.seed) if step == "batch" else None
        self.losses = None

    def step(self) -> None:
        if self.how == "run":
            self.losses = self.tr.run_steps(1, want_loss=True)
        else:
            self.losses = self.tr.train_step(*self.src.next_batch(), want_loss=True)

    def weights(self) -> np.ndarray:
        return flat(self.tr.get_weights())

    def result(self) -> Run:
        from towers.arrays import to_host

        tr = self.tr
        tr.finish()
        tr.synchronize()
        return Run(tr.get_weights(), tr.get_weights(ema=True), [float(v) for v in self.losses],
                   [to_host(r.params, copy=True) for r in tr.executor.replicas], tr.evaluate(ema=True)["accuracy"],
                   tr.executor.device_data is not None)

    def close(self) -> None:
        self.tr.close()


def train(devices: str, n_steps: int, dataset, *, step="run", **settings) -> Run:
    """``n_steps`` steps of a ``Training`` of ``settings`` on ``devices``; its ``Run``."""
    t = Training(devices, dataset, step, **settings)
    try:
        for _ in range(n_steps):
            t.step()
        return t.result()
    finally:
        t.close()


def compare(case: str, dataset, n_steps: int, tol: float = 1e-4, *, first: float = 1e-5, accuracy: float = 0.02,
            step="run", same_replicas=True, **settings):
    """The run on the device under test against the CPU run of the same settings, in lockstep; both returned.

    Checks: after the first step the weights within ``first`` (relative:
    one step's rounding, before chaotic training amplifies it); at the end
    the weights, buffers and EMA within ``tol``, the last losses within
    ``tol``, test accuracy within ``accuracy``, and (``same_replicas``) every
    replica bit-identical on each side.  The differences after the first
    step and at the end are recorded (``TOWERS_GPU_REPORT``): a rounding
    difference starts small and grows, a wrong kernel starts large.  Only
    the first step is followed by a host sync (reading the weights): the
    later steps are queued back to back, as in a run, so that what one
    step leaves for the next (index buffers, copies between steps) is
    tested too.
    """
    sides = [Training(DEVICE, dataset, step, **settings), Training("cpu", dataset, step, **settings)]
    try:
        for side in sides:
            side.step()
        growth = [rel(sides[0].weights(), sides[1].weights())]
        for _ in range(n_steps - 1):
            for side in sides:
                side.step()
        gpu, cpu = (side.result() for side in sides)
    finally:
        for side in sides:
            side.close()
    d = {"weights": rel(flat(gpu.weights), flat(cpu.weights)), "ema": rel(flat(gpu.ema), flat(cpu.ema)),
         "loss": rel(gpu.losses, cpu.losses), "accuracy": abs(gpu.accuracy - cpu.accuracy)}
    per_name = {k: rel(gpu.weights[k], cpu.weights[k]) for k in cpu.weights}
    worst = max(per_name, key=per_name.get)
    record(case, steps=n_steps, tol=tol, first_tol=first, first_step=growth[0], worst=worst,
           worst_rel=per_name[worst], on_device=gpu.on_device, **d)
    assert np.isfinite(flat(gpu.weights)).all(), f"{case}: non-finite weights on the device"
    assert growth[0] < first, f"{case}: after one step the weights differ by {growth[0]:.3g} (> {first:g})"
    assert d["weights"] < tol, f"{case}: weights differ by {d['weights']:.3g} (worst {worst}: {per_name[worst]:.3g})"
    assert d["ema"] < tol, f"{case}: EMA differs by {d['ema']:.3g}"
    assert d["loss"] < tol, f"{case}: losses {gpu.losses} against {cpu.losses}"
    assert d["accuracy"] <= accuracy, f"{case}: accuracy {gpu.accuracy} against {cpu.accuracy}"
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
