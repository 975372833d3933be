"""``profile``: where a training step's time goes, phase by phase and tower by tower.

Phases: ``input wait`` (the loop waiting for the background batch thread),
``stage`` (a tower's slice onto its device, uint8 -> float32), ``forward``
(including the loss), ``backward`` (including the L2 term), ``graph`` (a GPU
tower's forward and backward launched as one CUDA graph: ``cuda_graphs``), ``barrier``
(a CPU tower thread waiting for the slowest tower before the all-reduce),
``all-reduce`` and ``update+EMA``.

Timing is host wall-clock (``time.perf_counter``) per thread.  On the CPU that
is exact.  On a GPU, work is only queued, so when profiling each phase ends by
synchronizing its tower's stream; that serializes the towers and costs
throughput, which is why it happens only with ``--profile``.  Without it the
timer is a shared no-op context and adds nothing to the hot loop.

Concurrent CPU towers run their phases at the same time, so per-tower rows do
not add up to the wall time of a step: compare each row with ``wall / step``.
"""
from __future__ import annotations

import contextlib
import time

PHASES = ("input wait", "stage", "forward", "backward", "graph", "barrier", "all-reduce", "update+EMA")

_NULL = contextlib.nullcontext()


class _Phase:
    __slots__ = ("acc", "key", "sync", "t0")

    def __init__(self, acc, key, sync):
        self.acc, self.key, self.sync = acc, key, sync

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.sync is not None:
            self.sync()
        self.acc[self.key] = self.acc.get(self.key, 0.0) + time.perf_counter() - self.t0
        return False


class PhaseTimer:
    """Accumulates seconds per (phase, tower); ``timer(phase, tower)`` is a context.

    ``syncs[tower]`` (optional) is called at the end of each phase of that tower
    (a GPU stream's ``synchronize``).  Each tower's phases are recorded in their
    own dict, so tower threads never share a key.
    """

    def __init__(self, enabled: bool, n_towers: int, syncs=None):
        self.enabled = enabled
        self.n = n_towers
        self.syncs = list(syncs) if syncs is not None else [None] * n_towers
        self.acc: list[dict] = [{} for _ in range(n_towers)]
        self.steps = 0
        self.t_start: float | None = None

    def __call__(self, phase: str, tower: int = 0):
        if not self.enabled:
            return _NULL
        return _Phase(self.acc[tower], phase, self.syncs[tower])

    def for_tower(self, tower: int):
        """``timer(phase)`` bound to one tower, as ``Replica.loss_and_grads`` takes it."""
        return lambda phase: self(phase, tower)

    def step_done(self) -> None:
        if self.enabled:
            if self.t_start is None:
                self.t_start = time.perf_counter()
            self.steps += 1

    def report(self, global_batch: int) -> str:
        """A table: milliseconds per step for each phase (rows) and tower (columns)."""
        if not self.enabled or self.steps < 2:
            return "profile: fewer than 2 steps, nothing to report"
        steps = self.steps - 1  # the clock starts when the first step ends (warm-up excluded)
        wall = (time.perf_counter() - self.t_start) / steps
        cols = [f"tower {i}" for i in range(self.n)]
        lines = [f"profile: ms per step over {steps} steps (first step excluded); "
                 f"wall {wall * 1e3:.3f} ms/step = {global_batch / wall:.1f} examples/sec",
                 f"  {'phase':<12}" + "".join(f"{c:>10}" for c in cols)]
        for ph in PHASES:
            vals = [self.acc[i].get(ph) for i in range(self.n)]
            if all(v is None for v in vals):
                continue
            lines.append(f"  {ph:<12}" + "".join(
                f"{'-':>10}" if v is None else f"{v / self.steps * 1e3:>10.3f}" for v in vals))
        return "\n".join(lines)


def scaling_efficiency(rate_n: float, n_towers: int, rate_1: float) -> float:
    """(examples/s with N towers) / (N x examples/s with 1 tower); 1 for one tower."""
    return 1.0 if n_towers == 1 else rate_n / (n_towers * rate_1)


__all__ = ["PHASES", "PhaseTimer", "scaling_efficiency"]
