"""Placement: which device each tower runs on.

The rules follow TensorFlow's ``allow_soft_placement``:

* ``--n-gpu N`` asks for N towers on GPUs 0..N-1; ``--devices 0,2`` names the
  GPUs; ``--devices cpu`` puts every tower on the CPU.
* With soft placement (the default) a request that cannot be met exactly is
  bent, and one line says how: with no CUDA device the towers run on the CPU
  with NumPy; with fewer GPUs than towers the towers share GPUs round-robin.
* Without it (``--no-soft-placement``) both cases are a ``UserError`` that says
  what was asked and what exists.

Whatever the flags, the device list is validated here (ids exist, none named
twice) before ``towers.parallel.allreduce`` creates any NCCL communicator.  A
GPU id that does not exist is an error even with soft placement and even with
no GPU at all: soft placement bends how many GPUs a run gets, not which.

CuPy is an extra (``towers[cuda12]``, ``towers[cuda13]``): without it there is
no GPU to place on, and what is said names the extra to install rather than
a missing device.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import sys
from dataclasses import dataclass

import numpy

from towers.errors import UserError


@dataclass(frozen=True)
class Device:
    """One place a tower can live: the CPU, or CUDA device ``index``."""

    kind: str  # "cpu" or "gpu"
    index: int = 0

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    @property
    def xp(self):
        """The array module for this device: NumPy or CuPy."""
        if self.is_gpu:
            import cupy

            return cupy
        return numpy

    def scope(self):
        """Make this device current (a no-op on the CPU)."""
        if self.is_gpu:
            import cupy

            return cupy.cuda.Device(self.index)
        return contextlib.nullcontext()

    def __str__(self) -> str:
        return f"gpu:{self.index}" if self.is_gpu else "cpu"


CPU = Device("cpu")


def on_stream(stream):
    """Enter a tower's CuPy stream; on the CPU (stream None) a no-op."""
    return stream if stream is not None else contextlib.nullcontext()


#: How to get CuPy and NCCL for GPUs: the extras (pyproject.toml), by the CUDA major version of the driver.
GPU_EXTRAS = ("pip install 'towers[cuda12]' or 'towers[cuda13]' (the CUDA version nvidia-smi shows; "
              "in a checkout: pip install -e '.[cuda12]')")


def cupy_installed() -> bool:
    """Whether CuPy is installed (looked up, not imported: importing it costs a second)."""
    try:
        return importlib.util.find_spec("cupy") is not None
    except (ImportError, ValueError):  # a half-removed package: as good as none
        return False


def cuda_driver_absent() -> bool:
    """Whether this Linux machine has no NVIDIA driver library (``libcuda.so.1``): then no CUDA device is usable.

    Looked up by the dynamic loader, without importing CuPy: that import costs
    about a second of CPU (its ``ml_dtypes``), a second each command on a
    machine without a GPU that has CuPy installed.  Other systems: False (not known).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return False


def cuda_device_count() -> int:
    """Number of CUDA devices CuPy can use; 0 without CuPy, a driver or a GPU."""
    if cuda_driver_absent():
        return 0
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: all mean "no GPU here"
        return 0


@dataclass
class Placement:
    """The resolved placement: one device per tower, plus a soft-placement notice."""

    towers: list[Device]
    notice: str | None = None

    @property
    def n_towers(self) -> int:
        return len(self.towers)

    @property
    def gpus(self) -> list[Device]:
        """Distinct GPUs in tower order (ranks of the NCCL communicator)."""
        seen: list[Device] = []
        for d in self.towers:
            if d.is_gpu and d not in seen:
                seen.append(d)
        return seen

    @property
    def cpu_towers(self) -> int:
        """How many towers run on the CPU."""
        return sum(not d.is_gpu for d in self.towers)

    @property
    def groups(self) -> list[list[int]]:
        """Tower indices grouped by device, in order of each device's first tower."""
        order: dict[Device, list[int]] = {}
        for i, d in enumerate(self.towers):
            order.setdefault(d, []).append(i)
        return list(order.values())

    @property
    def ema_device(self) -> Device:
        return self.towers[0]

    def reducer_description(self, allreduce_dtype: str = "fp32", bucket_mib: float = 0.0) -> str:
        """The reducer of these towers, with the gradients' format in it (``allreduce_dtype``) and its buckets
        (``bucket_mib``; 0: one all-reduce after backward)."""
        groups = self.groups
        if self.n_towers == 1:
            return "none (one tower)"
        shared = any(len(g) > 1 for g in groups)
        rounded = ", gradients rounded to bfloat16 first" if allreduce_dtype == "bf16" else ""
        buckets = f", in buckets of about {bucket_mib:g} MiB during backward" if bucket_mib else ""
        if len(groups) == 1:
            return f"on-device mean on {self.towers[0]} ({self.n_towers} towers){rounded}{buckets}"
        text = "NCCL all-reduce (avg, float32) over " + ", ".join(map(str, self.gpus))
        if shared:
            text += ", after an on-device mean of towers that share a GPU"
        return text + rounded + buckets

    def table(self, allreduce_dtype: str = "fp32", bucket_mib: float = 0.0, precision: str = "fp32") -> str:
        """The ``--log-placement`` table (the reducer's line: ``reducer_description``; ``precision``: the towers'
        compute format, said beside them when not fp32)."""
        compute = f" (computes in {precision})" if precision != "fp32" else ""
        rows = [(f"tower {i}", f"{d}{compute}") for i, d in enumerate(self.towers)]
        rows += [
            ("EMA", f"{self.ema_device} (first tower's device)"),
            ("input parsing", "cpu (background thread)"),
            ("reducer", self.reducer_description(allreduce_dtype, bucket_mib)),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _parse_devices(text: str) -> list[int] | None:
    """``"cpu"`` -> None; ``"0,2"`` -> [0, 2]."""
    if text.strip().lower() == "cpu":
        return None
    try:
        ids = [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise UserError(
            f"`devices` {text!r} is not understood: give 'cpu' or GPU ids such as 0,2"
        ) from None
    if not ids or any(i < 0 for i in ids):
        raise UserError(f"`devices` {text!r}: GPU ids are non-negative integers such as 0,2")
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise UserError(
            f"`devices` {text!r} names GPU {dupes[0]} twice: list each GPU once "
            "(use `n_gpu` to put several towers on fewer GPUs)"
        )
    return ids


def _have(count: int, cupy: bool = True) -> str:
    if count == 0 and not cupy:
        return f"CuPy is not installed, so towers cannot use a GPU: {GPU_EXTRAS}"
    if count == 0:
        return "no CUDA device is visible"
    return f"only {count} CUDA device{'s' if count > 1 else ''} exist{'' if count > 1 else 's'} (ids 0-{count - 1})"


def resolve(
    n_towers: int | None = None,
    devices: str | None = None,
    soft: bool = True,
    gpu_count: int | None = None,
) -> Placement:
    """Turn ``--n-gpu``/``--devices``/``--[no-]soft-placement`` into a Placement.

    ``n_towers`` None means "not given": one tower, or one per listed device.
    ``gpu_count`` defaults to what CuPy sees (then, when CuPy is not installed,
    the messages say how to install it); tests pass it explicitly.
    """
    if n_towers is not None and n_towers < 1:
        raise UserError(f"`n_gpu` {n_towers}: the number of towers must be at least 1")
    ids = _parse_devices(devices) if devices is not None else None
    if devices is not None and ids is None:  # --devices cpu
        return Placement([CPU] * (n_towers or 1))
    cupy = True  # a count given by the caller is taken as it is
    if gpu_count is None:
        gpu_count = cuda_device_count()
        cupy = gpu_count > 0 or cupy_installed()

    if ids is None:
        want = n_towers or 1
        ids = list(range(min(want, gpu_count)))
        asked = f"{want} GPU tower{'s' if want > 1 else ''} (`n_gpu` {want})"
    else:
        want = n_towers or len(ids)
        asked = f"GPUs {','.join(map(str, ids))} (`devices`)"
        missing = [i for i in ids if i >= gpu_count]
        if missing:  # before any fallback: soft placement bends counts, never a wrong id
            if not cupy:
                gpus = "GPUs" if len(ids) > 1 else "a GPU"
                raise UserError(f"`devices` {devices} names {gpus}, but {_have(0, cupy)}; or use `devices` cpu")
            raise UserError(
                f"GPU {missing[0]} does not exist: {_have(gpu_count)}; fix `devices`"
                + (" (or `devices` cpu)" if gpu_count == 0 else "")
            )
        if want < len(ids):
            raise UserError(
                f"`n_gpu` {want} is fewer than the {len(ids)} GPUs named by `devices`: "
                "name fewer GPUs or drop `n_gpu`"
            )

    if gpu_count == 0:
        if not soft:
            raise UserError(
                f"asked for {asked} but {_have(0, cupy)}; use `devices` cpu, "
                "or fall back to the CPU (`soft_placement`)"
            )
        why = "no CUDA device found" if cupy else "CuPy is not installed (towers[cuda12] or towers[cuda13] for GPUs)"
        return Placement(
            [CPU] * want,
            notice=f"soft placement: {why}, running {want} tower{'s' if want > 1 else ''} on the CPU with NumPy",
        )
    if want > len(ids):
        if not soft:
            where = f"GPUs {','.join(map(str, ids))} were named" if devices else _have(gpu_count)
            raise UserError(
                f"asked for {want} towers, one per GPU, but {where}; "
                "ask for fewer towers, or share GPUs (`soft_placement`)"
            )
        towers = [Device("gpu", ids[i % len(ids)]) for i in range(want)]
        return Placement(
            towers,
            notice=f"soft placement: {want} towers share {len(ids)} GPU"
            f"{'s' if len(ids) > 1 else ''} round-robin "
            f"({', '.join(f'tower {i} -> {d}' for i, d in enumerate(towers))})",
        )
    return Placement([Device("gpu", i) for i in ids[:want]])
