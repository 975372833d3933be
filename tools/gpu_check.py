"""The whole GPU check in one command: preflight, machine facts, cuDNN probe, GPU tests, GPU benchmark, one summary.

    python -m tools.gpu_check LOGDIR [--probe-timeout S] [--tests-timeout S] [--bench-timeout S]
                                     [--bench-args "..."] [--cpu-smoke]
    python tools/gpu_check.py LOGDIR ...          # the same, from anywhere

On the lent GPU machine (no network; its image has CuPy, NCCL, cuDNN and
PyTorch, not the cuDNN frontend or nvmath-python), first fill ``.whl/`` here
with ``tools/gpu_wheels.sh``, send it with the checkout, and run there:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit; export PYTHONUNBUFFERED=1; \
        python3 -m tools.gpu_check $OUT/check

What the next GPU run is for (the default run): the preflight, the cuDNN
probe, the cuDNN and CUDA-graph tests first then the other GPU tests, and
ResNet-20's benchmark rows (PyTorch's first, then towers by im2col, cuDNN and
cuDNN in CUDA graphs); bring the LOGDIR back.

What it runs, in this order, each step a subprocess with a time limit (a hung
driver, test or benchmark cannot hang the check):

0. the preflight (``preflight``, ``PREFLIGHT_TIMEOUT`` s at most, seconds in
   practice): CuPy, NCCL, the cuDNN frontend (1.23 to 1.32), nvmath-python,
   cuda-core, cuda-pathfinder and cuda-bindings import or are installed at
   the versions needed, and on a GPU cuDNN and nvmath start; every version
   goes to ``LOGDIR/preflight.json``.  The first missing one stops the check
   at once: one line ``gpu_check: error: preflight: WHAT: WHY; FIX`` on
   stderr, exit status 2 (``--cpu-smoke`` notes it and goes on);
1. machine facts (``probe_machine``): ``nvidia-smi -L`` (when the command
   exists) and one Python process that asks CuPy for the CUDA devices (count
   and names), the CUDA runtime and driver versions, NCCL's and NVRTC's
   versions, and reports CuPy's, NumPy's and Python's versions; both at
   once, ``PROBE_TIMEOUT`` seconds at most.  Then torch's version, imported
   in a process of its own (``TORCH_TIMEOUT`` s; optional: absent is fine).
   Written to ``LOGDIR/machine.txt``.  When CuPy sees no CUDA device the
   check stops here: one line on stderr, exit status 2, nothing else run
   (unless ``--cpu-smoke``);
2. the cuDNN probe: ``python tools/cudnn_probe.py --json
   LOGDIR/cudnn-probe.json`` (every convolution shape of ResNet-20 and the
   CIFAR-10 model, forward and both gradients on cuDNN against im2col: the
   relative error, the engine and the workspace; ``--describe`` without a
   GPU), ``--probe-timeout`` s (default ``CUDNN_PROBE_TIMEOUT``), its output in
   ``LOGDIR/cudnn-probe.log``;
3. the GPU tests: ``python -m pytest -q -n 0 -m gpu -p no:cacheprovider -W
   error::cupy._util.PerformanceWarning -rfEsxX --junitxml
   LOGDIR/gpu-tests.xml`` on ``FIRST_TESTS`` (cuDNN, CUDA graphs) then
   ``tests/`` in the checkout (plus ``--timeout 120`` per test when
   pytest-timeout is installed), output streamed to the console and to
   ``LOGDIR/gpu-tests.log``, each test's measured differences from the CPU in
   ``LOGDIR/gpu-diffs.jsonl`` (``TOWERS_GPU_REPORT``, ``tests/gpu_compare.py``);
   the whole run is stopped after ``--tests-timeout`` seconds (default 100);
4. the benchmark: ``python tools/bench_gpu.py --json LOGDIR/bench.json
   --verbose`` plus the words of ``--bench-args`` (default ``BENCH_ARGS``),
   streamed to the console and to ``LOGDIR/bench.log`` (a failed CUDA-graph
   capture's traceback included), stopped after ``--bench-timeout`` seconds
   (default ``BENCH_TIMEOUT``; the rows measured by then are kept);
   With ``--models resnet50``, more benchmark steps follow (``EXTRA_BENCHES``: not in the default run),
   each under ``--bench-timeout``, written to ``LOGDIR/bench-NAME.json`` and ``.log``, their rows added
   to the summary;
5. the summary (``render_summary``), printed last and written to
   ``LOGDIR/summary.md``: the machine, the preflight's versions, the test
   counts and every failing test with its message's first line
   (``parse_junit``, or ``parse_pytest_log`` when the xml is missing), the
   benchmark's rows in samples/s and its ratios (``read_bench``), the wall
   time of each step and the cuDNN probe's summary line.

A step that passes its limit is interrupted (SIGINT to its process group,
so pytest still writes its summary and xml), then killed ``GRACE`` (5) s
later; the summary says so.  The time budget is explicit (``BUDGET``,
``budget()``): 10 s of preflight and facts, 30 s of cuDNN probe, 100 s of
tests, 145 s of benchmark (``tools/bench_gpu.py`` estimates 144 s for
``BENCH_ARGS``) and 15 s of grace: 300 s, so that a second run fits a
15-minute lease after fixes.

``--cpu-smoke`` runs the same pipeline on a machine without a GPU, to check
the command itself: the preflight and the facts note what is missing, the
probe only describes the graphs, every GPU test skips, and the benchmark
runs ``--quick --no-main-job`` on the CPU.  A minute or three on 2 busy cores.

Exit status: 0 when the tests had no failures or errors, the probe and the
benchmark exited 0 (none stopped at its limit); 1 otherwise; 2 when the
preflight stops, when no CUDA device is visible (without ``--cpu-smoke``) or
for a bad argument (one line ``gpu_check: error: ...`` on stderr); 130 for Ctrl-C.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

# The default run's time budget, explicit: the check, its tests included, fits in BUDGET seconds on one GPU (a
# 15-minute lease has room for a second run after fixes).  ``budget()`` adds it up; tests/tools/test_gpu_check.py
# checks that the sum fits and that the benchmark's estimate (tools/bench_gpu.py ``estimate_seconds``) fits its limit.
BUDGET = 300.0  # seconds
PREFLIGHT_EXPECTED = 10.0  # the preflight and the machine facts, as they take on a GPU machine (limits below)
CUDNN_PROBE_TIMEOUT = 30.0  # seconds for tools/cudnn_probe.py (8 shapes x 3 operations: a graph build each)
TESTS_TIMEOUT = 100.0  # seconds for the whole pytest run (50 s on one H100, 2026-11-26, before the cuDNN/graph tests ran)
BENCH_TIMEOUT = 145.0  # seconds for the whole benchmark (its estimate for BENCH_ARGS: 144 s)
# The first GPU run's rows (``--bench-args`` replaces them): ResNet-20's PyTorch references first, then towers with
# its convolutions by im2col, by cuDNN and by cuDNN in CUDA graphs, each towers row's host time by Python function;
# no cold start-up runs (bench_gpu.py --startup), no main-job comparison.  A benchmark stopped at its limit keeps
# the rows it measured (tools/bench_gpu.py on SIGINT).
BENCH_ARGS = ("--models resnet20 --conv-steps 20 --warmup 5 --rounds 2 --profile-steps 5 --no-main-job "
              "--gpu-conv im2col,cudnn,cudnn+graphs --host-profile")
# The GPU tests that run first: what the next GPU run checks first (a run stopped at its limit has them).
FIRST_TESTS = ("tests/gpu/test_gpu_cudnn.py", "tests/gpu/test_gpu_graphs.py")
# Benchmarks not in the default run, asked for with ``--models``: one benchmark step per entry (its own
# bench-NAME.json and .log, each under --bench-timeout).  ResNet-50: tf_cnn_benchmarks' workload, 224x224x3
# synthetic images, batch 64 and 128 a tower, towers fp32 (cuDNN) and bf16 against PyTorch eager fp32, eager
# AMP bf16 channels-last and torch.compile; then the same forward only (inference).
EXTRA_BENCHES = {
    "resnet50": [(f"resnet50-{tag}", f"--models resnet50 --conv-steps 10 --warmup 3 --rounds 2 --profile-steps 2 "
                  f"--no-main-job --gpu-conv cudnn --torch-compile --bf16 {extra}")
                 for tag, extra in (("b64", "--batch 64"), ("b128", "--batch 128"),
                                    ("b64-forward", "--batch 64 --forward-only"))],
}
PER_TEST_TIMEOUT = 120  # pytest-timeout's --timeout, when it is installed
PROBE_TIMEOUT = 20.0  # nvidia-smi -L and the CuPy probe, run at once
PREFLIGHT_TIMEOUT = 60.0  # the preflight's imports (nvmath imports its fft, linalg, sparse, tensor modules) and handles
TORCH_TIMEOUT = 30.0  # importing torch (slow, optional)
GRACE = 5.0  # seconds between the SIGINT of a step past its limit and its SIGKILL
MESSAGE_CHARS = 150  # a failure message's first line is cut to this in the summary

# The CuPy probe, run as ``python -c``: prints one JSON object.  Every question is asked on its own,
# so one failing call (no driver, no NCCL) leaves the others' answers.
_PROBE = r"""
import json, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable}
def ask(key, fn):
    try:
        out[key] = fn()
    except BaseException as e:
        out[key + "_error"] = (type(e).__name__ + ": " + str(e)).strip()
ask("numpy", lambda: __import__("numpy").__version__)
try:
    import cupy
except BaseException as e:
    out["cupy_error"] = (type(e).__name__ + ": " + str(e)).strip()
else:
    out["cupy"] = cupy.__version__
    rt = cupy.cuda.runtime
    ask("cuda_runtime", rt.runtimeGetVersion)
    ask("cuda_driver", rt.driverGetVersion)
    ask("device_count", rt.getDeviceCount)
    def names():
        found = []
        for i in range(out.get("device_count") or 0):
            n = rt.getDeviceProperties(i)["name"]
            found.append(n.decode() if isinstance(n, bytes) else str(n))
        return found
    ask("gpus", names)
    def nccl():
        from cupy.cuda import nccl
        return nccl.get_version()
    ask("nccl", nccl)
    def nvrtc():
        from cupy_backends.cuda.libs import nvrtc
        return list(nvrtc.getVersion())
    ask("nvrtc", nvrtc)
print(json.dumps(out))
"""

# The preflight, run as ``python -c`` in the checkout: prints one JSON object, {"versions": {...}, "stop": None or
# [what, why, fix]}.  The checks run in ``preflight``'s order and the first that fails stops the rest.
_PREFLIGHT = r"""
import importlib, importlib.metadata as md, json, sys
out = {"versions": {}, "stop": None}
v = out["versions"]
for d in ("cupy-cuda13x", "cupy-cuda12x", "nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-cudnn-cu13",
          "nvidia-cudnn-cu12", "nvidia-cudnn-frontend", "nvmath-python", "cuda-core", "cuda-bindings",
          "cuda-pathfinder"):
    try:
        v[d] = md.version(d)
    except md.PackageNotFoundError:
        pass
def short(e):
    return " ".join((type(e).__name__ + ": " + str(e)).split())[:300]
def at_least(have, need):
    def nums(t):
        return tuple(int(p) for p in (t.split("+")[0].split(".") + ["0", "0"])[:3] if p.isdigit())
    return have is not None and nums(have) >= nums(need)
WHEELS = "carry it: tools/gpu_wheels.sh fills .whl/, which the device command installs"
def need(what, fn, fix):
    if out["stop"] is not None:
        return None
    try:
        r = fn()
    except BaseException as e:
        out["stop"] = [what, short(e), fix]
        return None
    if isinstance(r, str) and r.startswith("!"):
        out["stop"] = [what, r[1:], fix]
        return None
    return r
cupy = need("CuPy", lambda: importlib.import_module("cupy"), "install cupy-cuda13x (or -cuda12x)")
if cupy is not None:
    v["cupy"] = cupy.__version__
def nccl():
    from cupy.cuda import nccl
    return nccl.get_version() if getattr(nccl, "available", True) else "!its library does not load"
v["nccl"] = need("NCCL", nccl, "install nvidia-nccl-cu13 (or -cu12)")
fe = need("the cuDNN frontend", lambda: importlib.import_module("cudnn"), WHEELS)
if fe is not None:
    v["cudnn_frontend"] = getattr(fe, "__version__", "?")
    need("the cuDNN frontend", lambda: None if at_least(v["cudnn_frontend"], "1.23") and not at_least(
        v["cudnn_frontend"], "1.33") else "!version " + v["cudnn_frontend"] + ": towers is written for 1.23 to 1.32",
        WHEELS)
nv = need("nvmath-python", lambda: importlib.import_module("nvmath"), WHEELS)
if nv is not None:
    v["nvmath"] = getattr(nv, "__version__", v.get("nvmath-python", "?"))
for dist, least in (("cuda-core", "0.5.0"), ("cuda-pathfinder", "1.5.1")):
    need(dist, lambda: None if at_least(v.get(dist), least) else "!version " + str(v.get(dist)) + ", nvmath-python "
         "needs >= " + least, "carry " + dist + "==" + least + " (tools/gpu_wheels.sh " + dist + "==" + least + ")")
need("cuda-bindings", lambda: None if "cuda-bindings" in v else "!not installed", "install cuda-bindings")
try:  # no device: the machine facts say so (the check's own refusal); the usability checks need one
    v["gpus"] = cupy.cuda.runtime.getDeviceCount() if cupy is not None else 0
except BaseException:
    v["gpus"] = 0
def cudnn_library():
    return fe.backend_version_string() if hasattr(fe, "backend_version_string") else str(fe.backend_version())
def usable(check):
    def run():
        why = check()
        return None if why is None else "!" + why
    return run
if out["stop"] is None and v["gpus"]:
    from towers.devices import cudnn as towers_cudnn, matmul
    v["cudnn"] = need("the cuDNN library", cudnn_library, "install nvidia-cudnn-cu13 (or -cu12)")
    need("cudnn (towers.devices.cudnn)", usable(towers_cudnn.available), WHEELS)
    need("nvmath (towers.devices.matmul)", usable(matmul.nvmath_available), WHEELS)
try:
    v["cuda_bindings_module"] = importlib.import_module("cuda.bindings").__version__
except BaseException:
    pass
print(json.dumps(out, default=str))
"""

_TORCH_PROBE = "import json, torch; print(json.dumps({'torch': torch.__version__, 'torch_cuda': torch.version.cuda}))"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + line
        self.exit(2, f"gpu_check: error: {message} (see --help)\n")


# -- machine facts ---------------------------------------------------------------------------------


def _cuda_version(v) -> str:
    """CUDA's integer version (12090) as text (12.9); 0 (no driver) as none; anything else as it is."""
    if v == 0:
        return "none"
    if isinstance(v, int) and v >= 1000:
        return f"{v // 1000}.{v % 1000 // 10}"
    return str(v)


def _nccl_version(v) -> str:
    """NCCL's integer version as text: 22703 -> 2.27.3 (2.9 and later), 2708 -> 2.7.8 (before)."""
    if isinstance(v, int):
        if v >= 10000:
            return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
        if v >= 1000:
            return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"
    return str(v)


def _run_quiet(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit status or None when it passed ``timeout`` or did not start, its stdout + stderr)."""
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                           stdin=subprocess.DEVNULL, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"no answer within {timeout:g} s"
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"
    return p.returncode, p.stdout.decode(errors="replace")


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
    return None


def probe_machine(timeout: float = PROBE_TIMEOUT) -> dict:
    """The machine's facts: ``nvidia-smi -L`` and the CuPy probe, run at once within ``timeout`` seconds.

    Returns a dict: ``nvidia_smi`` (its output, or why there is none), the
    probe's answers (``python``, ``numpy``, ``cupy``, ``device_count``,
    ``gpus``, ``cuda_runtime``, ``cuda_driver``, ``nccl``, ``nvrtc``; a
    failed question as ``<key>_error``), ``cuda_visible_devices``, and
    ``no_gpu``: None when CuPy sees a CUDA device, else the reason in words.
    """
    facts: dict = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    smi_out: dict = {}
    smi = shutil.which("nvidia-smi")

    def run_smi():
        rc, text = _run_quiet([smi, "-L"], timeout)
        smi_out["text"] = text.strip() if rc == 0 else f"nvidia-smi -L failed: {text.strip() or f'exit {rc}'}"

    thread = None
    if smi:
        thread = threading.Thread(target=run_smi, daemon=True)
        thread.start()
    else:
        smi_out["text"] = "nvidia-smi: not found"
    rc, text = _run_quiet([sys.executable, "-c", _PROBE], timeout)
    answers = _last_json(text) if rc is not None else None
    if answers is None:
        tail = text.strip().splitlines()[-1:] if text.strip() else [f"exit {rc}"]
        facts["probe_error"] = f"the CuPy probe failed: {tail[0] if rc is not None else text}"
    else:
        facts.update(answers)
    if thread is not None:
        thread.join(timeout + 5)
    facts["nvidia_smi"] = smi_out.get("text", "nvidia-smi -L: no answer")
    facts["no_gpu"] = _no_gpu_reason(facts)
    return facts


def _no_gpu_reason(facts: dict) -> str | None:
    """Why CuPy sees no CUDA device, in one line; None when it sees one."""
    if "probe_error" in facts:
        reason = facts["probe_error"]
    elif "cupy_error" in facts:
        reason = f"CuPy does not import: {facts['cupy_error']}"
    elif "device_count_error" in facts:
        reason = facts["device_count_error"]
    elif not facts.get("device_count"):
        reason = "CuPy counts 0 CUDA devices"
    else:
        return None
    if facts.get("cuda_visible_devices") is not None:
        reason += f"; CUDA_VISIBLE_DEVICES={facts['cuda_visible_devices']!r}"
    return " ".join(reason.split())


def preflight(timeout: float = PREFLIGHT_TIMEOUT) -> dict:
    """What the GPU check relies on, asked in one process of its own within ``timeout`` seconds (``_PREFLIGHT``).

    In order, the first failure stopping the rest: CuPy imports; NCCL's
    library loads; the cuDNN frontend imports, at a version towers is written
    for (1.23 to 1.32); nvmath-python imports; cuda-core >= 0.5.0 and
    cuda-pathfinder >= 1.5.1 (nvmath-python's needs); cuda-bindings is
    installed; then, when CuPy sees a CUDA device, cuDNN's library version,
    ``towers.devices.cudnn.available()`` (a handle on GPU 0) and
    ``towers.devices.matmul.nvmath_available()`` (a cuBLAS handle).  Returns
    {"versions": {...}, "stop": None or [what, why, fix]}: the versions of the
    packages (distribution names) and of CuPy, NCCL, cuDNN, the frontend and
    nvmath as they report them.
    """
    rc, text = _run_quiet([sys.executable, "-c", _PREFLIGHT], timeout)
    answers = _last_json(text) if rc is not None else None
    if answers is None:
        tail = text.strip().splitlines()[-1:] if text.strip() else [f"exit {rc}"]
        return {"versions": {}, "stop": ["the preflight", tail[0], "see the line above"]}
    return answers


def preflight_line(result: dict) -> str:
    """The preflight in one line: each version found, then what stops the check (if anything)."""
    v = result.get("versions") or {}
    keys = (("CuPy", "cupy"), ("NCCL", "nccl"), ("cuDNN", "cudnn"), ("frontend", "cudnn_frontend"),
            ("nvmath", "nvmath"), ("cuda-core", "cuda-core"), ("cuda-bindings", "cuda-bindings"),
            ("cuda-pathfinder", "cuda-pathfinder"))
    line = ", ".join(f"{label} {_nccl_version(v[k]) if k == 'nccl' else v[k]}" if v.get(k) is not None
                     else f"{label} absent" for label, k in keys)
    stop = result.get("stop")
    return line + (f"; STOPS: {stop[0]}: {stop[1]}" if stop else "")


def budget(bench_args: str = BENCH_ARGS) -> dict:
    """The default run's seconds, step by step: {"steps": [(name, seconds)], "total": s, "bench_estimate": s}.

    The steps: the preflight and machine facts as expected (``PREFLIGHT_EXPECTED``), the cuDNN probe, the
    tests and the benchmark at their limits, and ``GRACE`` for each stopped step.  ``bench_estimate``: what
    ``tools/bench_gpu.py`` estimates for ``bench_args`` on one GPU with torch (``estimate_seconds``).
    """
    from tools import bench_gpu

    a = bench_gpu.parse_args(shlex.split(bench_args))
    rows = bench_gpu._plan(1, True, a.models, a.torch_compile, a.gpu_conv)
    estimate = bench_gpu.estimate_seconds(rows, a.sizes, a.rounds, a.startup, a.host_profile)
    steps = [("preflight and machine facts", PREFLIGHT_EXPECTED), ("cuDNN probe", CUDNN_PROBE_TIMEOUT),
             ("GPU tests", TESTS_TIMEOUT), ("benchmark", BENCH_TIMEOUT), ("grace of stopped steps", 3 * GRACE)]
    return {"steps": steps, "total": sum(s for _, s in steps), "bench_estimate": estimate, "rows": rows}


def probe_torch(timeout: float = TORCH_TIMEOUT) -> dict:
    """torch's version and its CUDA version, imported in a process of its own; ``torch_error`` when it does not."""
    rc, text = _run_quiet([sys.executable, "-c", _TORCH_PROBE], timeout)
    answers = _last_json(text) if rc == 0 else None
    if answers is not None:
        return answers
    lines = text.strip().splitlines()
    return {"torch_error": lines[-1] if lines else f"exit {rc}"}


def machine_text(facts: dict) -> str:
    """``machine.txt``: every fact, one per line, then ``nvidia-smi -L``'s output."""
    keys = ("no_gpu", "device_count", "gpus", "cuda_visible_devices", "cupy", "nccl", "cuda_runtime",
            "cuda_driver", "nvrtc", "numpy", "torch", "torch_cuda", "python", "executable", "preflight")
    lines = []
    for k in keys:
        if k in facts:
            v = facts[k]
            if k in ("cuda_runtime", "cuda_driver"):
                v = f"{_cuda_version(v)} ({v})"
            elif k == "nccl":
                v = f"{_nccl_version(v)} ({v})"
            elif k == "nvrtc" and isinstance(v, list):
                v = ".".join(map(str, v))
            lines.append(f"{k}: {v}")
    lines += [f"{k}: {v}" for k, v in sorted(facts.items()) if k.endswith("_error")]
    lines += ["", "nvidia-smi -L:", facts.get("nvidia_smi", "")]
    return "\n".join(lines) + "\n"


def machine_line(facts: dict) -> str:
    """One line: the GPUs, then CuPy, NCCL, CUDA (runtime, driver), NVRTC, NumPy, torch and Python versions."""
    gpus = facts.get("gpus") or []
    if facts.get("no_gpu"):
        head = f"no CUDA device ({facts['no_gpu']})"
    elif gpus and all(g == gpus[0] for g in gpus):
        head = f"{len(gpus)} x {gpus[0]}"
    else:
        head = ", ".join(gpus) or f"{facts.get('device_count')} CUDA devices"

    def v(key, fmt=str):
        return fmt(facts[key]) if key in facts else "n/a"

    nvrtc = ".".join(map(str, facts["nvrtc"])) if isinstance(facts.get("nvrtc"), list) else "n/a"
    torch = facts.get("torch") or "absent"
    return (f"{head}; CuPy {v('cupy')}, NCCL {v('nccl', _nccl_version)}, CUDA runtime "
            f"{v('cuda_runtime', _cuda_version)}, driver {v('cuda_driver', _cuda_version)}, NVRTC {nvrtc}, "
            f"NumPy {v('numpy')}, torch {torch}, Python {v('python')}")


# -- the test suite's results ----------------------------------------------------------------------


@dataclass
class SuiteResult:
    """Counts of a pytest run, its seconds, and ``failures``: (test id, first line of its message)."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    xfailed: int = 0
    seconds: float | None = None
    failures: list = field(default_factory=list)
    source: str = "none"  # where the figures come from: "junit xml", "log" or "none"
    complete: bool = True  # False: the log ends before pytest's summary line (killed)

    def line(self) -> str:
        """``61 passed, 2 failed, 0 errors, 3 skipped, 1 xfailed in 143 s``."""
        secs = f" in {self.seconds:.0f} s" if self.seconds is not None else ""
        return (f"{self.passed} passed, {self.failed} failed, {self.errors} errors, {self.skipped} skipped, "
                f"{self.xfailed} xfailed{secs}")


def _first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def _test_id(classname: str, name: str, root: Path | None) -> str:
    """pytest's node id from junit's classname (``tests.test_gpu`` or ``tests.test_x.TestY``) and name.

    The module is the longest dotted prefix that is a ``.py`` file under
    ``root``; without ``root`` (or no such file), the parts up to the first
    one that starts with a capital letter (a test class).
    """
    parts = classname.split(".") if classname else []
    if not parts:  # a collection error: name is the module's dotted path
        parts, name = name.split("."), ""
    cut = None
    if root is not None:
        for i in range(len(parts), 0, -1):
            if (root / Path(*parts[:i])).with_suffix(".py").is_file():
                cut = i
                break
    if cut is None:
        cut = next((i for i, p in enumerate(parts) if p[:1].isupper()), len(parts))
    node = "/".join(parts[:cut]) + ".py"
    return "::".join([node, *parts[cut:], *([name] if name else [])])


def parse_junit(path, root: Path | None = ROOT) -> SuiteResult:
    """Counts, seconds and failures of pytest's ``--junitxml`` file (``ValueError`` when it is not one).

    Each ``testcase`` counts once per outcome element: ``failure`` as failed,
    ``error`` as an error (a test that fails and then errors in teardown counts
    in both, as pytest's own summary does), ``skipped`` of type
    ``pytest.xfail`` as xfailed, other ``skipped`` as skipped, none as passed.
    ``failures`` lists (node id, first line of the message) of every failure
    and error, in file order.  The nameless ``testcase`` pytest writes for the
    test it was running when interrupted (SIGINT) is not counted.
    """
    try:
        tree = ET.parse(path)
    except ET.ParseError as e:
        raise ValueError(f"{path}: not a junit xml file ({e})") from None
    top = tree.getroot()
    suites = [top] if top.tag == "testsuite" else top.findall("testsuite")
    if top.tag not in ("testsuite", "testsuites"):
        raise ValueError(f"{path}: not a junit xml file (its root is <{top.tag}>)")
    r = SuiteResult(source="junit xml")
    seconds = [float(s.get("time")) for s in suites if _is_number(s.get("time"))]
    r.seconds = sum(seconds) if seconds else None
    for case in top.iter("testcase"):
        if case.get("name") is None:  # the test running when pytest was interrupted: no outcome
            continue
        outcomes = [c for c in case if c.tag in ("failure", "error", "skipped")]
        if not outcomes:
            r.passed += 1
        for c in outcomes:
            if c.tag == "skipped":
                if c.get("type") == "pytest.xfail":
                    r.xfailed += 1
                else:
                    r.skipped += 1
                continue
            if c.tag == "failure":
                r.failed += 1
            else:
                r.errors += 1
            tid = _test_id(case.get("classname", ""), case.get("name", ""), root)
            msg = _first_line(c.get("message")) or _first_line(c.text)
            r.failures.append((tid if c.tag == "failure" else f"{tid} (error)", msg))
    return r


def _is_number(text) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)")
_SUMMARY = re.compile(r"^=* ?(.*\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected).*?) in "
                      r"([\d.]+)s(?: \([^)]*\))? ?=*$")
_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$")


def parse_pytest_log(text: str) -> SuiteResult:
    """The figures of a pytest console log, for when its junit xml is missing.

    Counts and seconds come from pytest's last summary line (``== 2 failed,
    61 passed in 143.2s ==``); failures from the ``FAILED id - message`` and
    ``ERROR id - message`` lines of ``-rfE``.  Without a summary line (the run
    was killed) ``complete`` is False and only the failures listed so far count.
    """
    r = SuiteResult(source="log", complete=False)
    lines = text.splitlines()
    for line in lines:
        m = _FAILED.match(line.strip())
        if m:
            tid = m.group(2) if m.group(1) == "FAILED" else f"{m.group(2)} (error)"
            r.failures.append((tid, (m.group(3) or "").strip()))
    for line in reversed(lines):
        m = _SUMMARY.match(line.strip())
        if m:
            r.complete = True
            r.seconds = float(m.group(2))
            for n, word in _COUNT.findall(m.group(1)):
                key = {"error": "errors", "errors": "errors"}.get(word, word)
                if hasattr(r, key) and key not in ("source", "complete", "seconds", "failures"):
                    setattr(r, key, int(n))
            break
    if not r.complete:
        r.failed = sum(1 for tid, _ in r.failures if not tid.endswith("(error)"))
        r.errors = len(r.failures) - r.failed
    return r


# -- the benchmark's figures -----------------------------------------------------------------------


@dataclass
class BenchRow:
    """One row of ``bench.json``: its name and samples/s, or ``note`` (skipped, failed, no result)."""

    name: str
    samples_per_sec: float | None = None
    note: str = ""


def read_bench(path) -> dict:
    """``tools/bench_gpu.py``'s ``--json`` file as {"rows": [BenchRow], "ratios": {name: float|None},
    "main_job": {name: wall seconds|None}}.

    Read defensively (the benchmark gains rows and keys): a row without a
    name is left out, unknown keys are ignored, a skipped row (``kind``
    ``skip``) keeps its ``note``, a failed one (``result.error``) the first
    line of its error.  A missing or unreadable file raises ``ValueError``.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    rows = []
    for r in data.get("rows") or []:
        if not isinstance(r, dict) or not isinstance(r.get("name"), str):
            continue
        res = r.get("result") if isinstance(r.get("result"), dict) else {}
        sps = res.get("samples_per_sec")
        if r.get("kind") == "skip":
            rows.append(BenchRow(r["name"], note=str(r.get("note") or "skipped")))
        elif res.get("error"):
            rows.append(BenchRow(r["name"], note="FAILED: " + _first_line(str(res["error"]))[:MESSAGE_CHARS]))
        elif isinstance(sps, (int, float)) and not isinstance(sps, bool):
            rows.append(BenchRow(r["name"], float(sps)))
        else:
            rows.append(BenchRow(r["name"], note="no result"))
    ratios = {}
    raw = data.get("ratios") if isinstance(data.get("ratios"), dict) else {}
    for k, v in raw.items():
        ratios[str(k)] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    main_job = {}
    raw = data.get("main_job") if isinstance(data.get("main_job"), dict) else {}
    for k, v in raw.items():
        wall = v.get("wall_s") if isinstance(v, dict) else None
        main_job[str(k)] = float(wall) if isinstance(wall, (int, float)) and not isinstance(wall, bool) else None
    return {"rows": rows, "ratios": ratios, "main_job": main_job}


# -- running a step --------------------------------------------------------------------------------


@dataclass
class Step:
    """A step's outcome: its exit status (None: it did not run to the end), wall seconds and status words."""

    name: str
    rc: int | None = None
    seconds: float = 0.0
    killed: bool = False  # stopped at its time limit
    limit: float | None = None  # its time limit, seconds
    status: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.killed


def run_logged(name: str, cmd: list[str], log_path: Path, timeout: float, env: dict | None = None,
               echo=None) -> Step:
    """Run ``cmd`` in the checkout with its stdout and stderr written, line by line, to ``log_path`` and ``echo``.

    It runs in a session of its own; past ``timeout`` seconds the whole
    process group gets SIGINT (pytest then still writes its summary and
    xml), and SIGKILL ``GRACE`` seconds later.
    """
    echo = echo if echo is not None else sys.stdout
    t0 = time.perf_counter()
    step = Step(name, limit=timeout)
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)

        def pump():
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode(errors="replace")
                log.write(line)
                log.flush()
                echo.write(line)
                echo.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            try:
                step.rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                step.killed = True
                _signal_group(proc, signal.SIGINT)
                try:
                    proc.wait(timeout=GRACE)
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait()
                step.rc = proc.returncode
            reader.join(GRACE)
            if reader.is_alive():  # a leftover child of the group still holds the pipe
                _signal_group(proc, signal.SIGKILL)
                reader.join(GRACE)
        except BaseException:  # Ctrl-C here: the step's session does not get the terminal's SIGINT
            _signal_group(proc, signal.SIGKILL)
            raise
        finally:
            proc.stdout.close()
        step.seconds = time.perf_counter() - t0
        step.status = (f"stopped at its {timeout:g} s limit" if step.killed else
                       "ok" if step.rc == 0 else f"exit {step.rc}")
        log.write(f"\n[gpu_check: {name}: {step.status}, {step.seconds:.1f} s]\n")
    return step


def _signal_group(proc: subprocess.Popen, sig) -> None:
    try:
        os.killpg(proc.pid, sig)  # the step's own session (start_new_session): its pid is the group's id
    except (ProcessLookupError, PermissionError):
        pass


# -- the summary -----------------------------------------------------------------------------------


def _fmt_rate(v: float) -> str:
    return f"{v:,.0f}"


def render_summary(facts: dict, suite: SuiteResult | None, suite_step: Step | None, bench: dict | None,
                   bench_step: Step | None, steps: list, logdir: str, cpu_smoke: bool = False,
                   bench_error: str = "") -> str:
    """The summary, as markdown: machine line, test line, failures, bench table, ratios, step times, verdict."""
    out = ["## GPU check" + (" (--cpu-smoke: no GPU, the command itself checked)" if cpu_smoke else ""), "",
           f"machine: {machine_line(facts)}"]
    if facts.get("preflight"):
        out.append(f"preflight: {facts['preflight']}")
    out.append("")
    if suite_step is None:
        out.append("GPU tests: not run")
    else:
        if suite is None or suite.source == "none":
            line = "GPU tests: no results (no junit xml and no pytest summary in the log)"
        else:
            line = f"GPU tests: {suite.line()}"
            if suite.source == "log":
                line += " (from the log: the junit xml is missing)"
            if not suite.complete:
                line += " (incomplete: the log ends before pytest's summary)"
        if suite_step.killed:
            line += f"; STOPPED at its {suite_step.limit:g} s limit"
        elif suite_step.rc not in (0, 1):
            line += f"; pytest exit status {suite_step.rc}"
        if cpu_smoke and suite is not None and suite.passed + suite.failed + suite.errors == 0 and suite.skipped:
            line += " (no GPU: every GPU test skips)"
        out.append(line)
        for tid, msg in (suite.failures if suite is not None else []):
            msg = msg if len(msg) <= MESSAGE_CHARS else msg[:MESSAGE_CHARS - 3] + "..."
            kind, tid = ("ERROR", tid[:-len(" (error)")]) if tid.endswith(" (error)") else ("FAILED", tid)
            out.append(f"- {kind} {tid}" + (f": {msg}" if msg else ""))
    out.append("")
    if bench_step is None:
        out.append("benchmark: not run")
    else:
        out.append(f"benchmark (tools/bench_gpu.py): {bench_step.status}"
                   + (" (--quick on the CPU: not GPU figures)" if cpu_smoke else ""))
        if bench is None:
            out.append(f"no figures: {bench_error or 'bench.json is missing'}")
        else:
            out += ["", "| row | samples/s |", "| --- | ---: |"]
            out += [f"| {r.name} | {_fmt_rate(r.samples_per_sec) if r.samples_per_sec is not None else r.note} |"
                    for r in bench["rows"]]
            if not bench["rows"]:
                out.append("| (no rows) | |")
            if bench["main_job"]:
                out += ["", "main job wall: " + "; ".join(
                    f"{k} {v:.2f} s" if v is not None else f"{k} n/a" for k, v in bench["main_job"].items())]
            if bench["ratios"]:
                out += ["", "ratios:"] + [f"- {k}: {v:.2f}" if v is not None else f"- {k}: n/a"
                               for k, v in bench["ratios"].items()]
    out += ["", "steps: " + "; ".join(f"{s.name} {s.seconds:.1f} s ({s.status})" for s in steps)
            + f"; total {sum(s.seconds for s in steps):.0f} s"]
    out.append(f"logs: {logdir}")
    return "\n".join(out) + "\n"


def verdict(suite: SuiteResult | None, suite_step: Step | None, bench_step: Step | None,
            cpu_smoke: bool = False) -> int:
    """0 when the tests ran to the end without failures or errors, at least one passed (a GPU check whose
    tests all skipped checked nothing; ``cpu_smoke``: they skip by design), and the benchmark exited 0; else 1."""
    if suite_step is None or bench_step is None or not suite_step.ok or not bench_step.ok:
        return 1
    if suite is None or suite.source == "none" or suite.failed or suite.errors:
        return 1
    if not suite.passed and not cpu_smoke:
        return 1
    return 0


# -- the command -----------------------------------------------------------------------------------


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0 seconds")
    return v


def main(argv=None) -> int:
    ap = _Parser(prog="gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("logdir", metavar="LOGDIR", help="folder for the logs and summary.md (created if missing)")
    ap.add_argument("--tests-timeout", type=_positive, default=TESTS_TIMEOUT, metavar="S",
                    help=f"seconds for the whole GPU test run (default {TESTS_TIMEOUT:g})")
    ap.add_argument("--probe-timeout", type=_positive, default=CUDNN_PROBE_TIMEOUT, metavar="S",
                    help=f"seconds for the cuDNN probe, tools/cudnn_probe.py (default {CUDNN_PROBE_TIMEOUT:g})")
    ap.add_argument("--bench-timeout", type=_positive, default=BENCH_TIMEOUT, metavar="S",
                    help=f"seconds for the whole benchmark (default {BENCH_TIMEOUT:g})")
    ap.add_argument("--bench-args", default=None, metavar='"..."',
                    help="the words for tools/bench_gpu.py, one string, instead of the default "
                    f"\"{BENCH_ARGS}\" (--bench-args=--quick for one word)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the pipeline without a GPU (tests skip, the benchmark runs --quick on the CPU)")
    ap.add_argument("--models", default="", metavar="LIST",
                    help="benchmarks not in the default run, after it, each under --bench-timeout: "
                         + ", ".join(EXTRA_BENCHES) + " (ResNet-50 at 224x224 on synthetic data, batch 64 and 128 "
                         "a tower, and forward only)")
    a = ap.parse_args(argv)
    a.models = [m.strip().lower() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in a.models if m not in EXTRA_BENCHES]
    if unknown:
        ap.error(f"--models {','.join(unknown)}: use some of {', '.join(EXTRA_BENCHES)}")
    try:
        bench_extra = shlex.split(a.bench_args if a.bench_args is not None else "" if a.cpu_smoke else BENCH_ARGS)
    except ValueError as e:
        ap.error(f"--bench-args {a.bench_args!r}: {e}")
    logdir = Path(a.logdir)
    if logdir.exists() and not logdir.is_dir():
        ap.error(f"LOGDIR {a.logdir} is a file, not a folder; choose another path")
    try:
        logdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"cannot create LOGDIR {a.logdir}: {e.strerror or e}")
    try:
        return _check(a, logdir, bench_extra)
    except KeyboardInterrupt:
        print("gpu_check: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _check(a, logdir: Path, bench_extra: list[str]) -> int:
    steps = []
    t0 = time.perf_counter()
    pre = preflight()
    (logdir / "preflight.json").write_text(json.dumps(pre, indent=1, default=str) + "\n")
    stop = pre.get("stop")
    if stop and not a.cpu_smoke:
        print(f"gpu_check: error: preflight: {stop[0]}: {stop[1]}; {stop[2]} (versions in "
              f"{logdir / 'preflight.json'})", file=sys.stderr)
        return 2
    facts = probe_machine()
    facts["preflight"] = preflight_line(pre)
    machine = Step("machine facts")
    steps.append(machine)
    if facts["no_gpu"] and not a.cpu_smoke:
        (logdir / "machine.txt").write_text(machine_text(facts))
        print(f"gpu_check: error: no CUDA device is visible to CuPy ({facts['no_gpu']}): run this on a GPU "
              "machine, or pass --cpu-smoke to check the command itself", file=sys.stderr)
        return 2
    facts.update(probe_torch())
    (logdir / "machine.txt").write_text(machine_text(facts))
    machine.seconds, machine.status, machine.rc = time.perf_counter() - t0, "ok", 0
    print(f"gpu_check: machine: {machine_line(facts)}", flush=True)
    print(f"gpu_check: preflight: {facts['preflight']}", flush=True)

    # The GPU tests record each measured difference from the CPU there (tests/gpu_compare.py).
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOWERS_GPU_REPORT=str((logdir / "gpu-diffs.jsonl").resolve()))
    env.pop("TOWERS_TEST_GPU_AS", None)  # a dry run's switch would turn every GPU comparison into CPU against CPU

    # cuDNN one operation at a time (on the CPU, --cpu-smoke: the graph descriptions only).
    probe_json = logdir / "cudnn-probe.json"
    probe_json.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "tools" / "cudnn_probe.py"), "--json", str(probe_json.resolve())]
    cmd += ["--describe"] if facts["no_gpu"] else []
    print(f"\ngpu_check: cuDNN probe (at most {a.probe_timeout:g} s): {shlex.join(cmd)}", flush=True)
    probe_step = run_logged("cuDNN probe", cmd, logdir / "cudnn-probe.log", a.probe_timeout, env)
    steps.append(probe_step)
    (logdir / "gpu-diffs.jsonl").unlink(missing_ok=True)
    xml, tests_log = logdir / "gpu-tests.xml", logdir / "gpu-tests.log"
    xml.unlink(missing_ok=True)  # a file of an earlier run must not pass for this one's
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "gpu", "-p", "no:cacheprovider"]
    if "cupy" in facts:  # the warning class lives in CuPy
        cmd += ["-W", "error::cupy._util.PerformanceWarning"]
    cmd += ["-rfEsxX", "--junitxml", str(xml.resolve())]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", str(PER_TEST_TIMEOUT)]
    cmd += [*FIRST_TESTS, "tests/"]  # pytest runs each file once, these first
    print(f"\ngpu_check: GPU tests (at most {a.tests_timeout:g} s): {shlex.join(cmd)}", flush=True)
    suite_step = run_logged("GPU tests", cmd, tests_log, a.tests_timeout, env)
    steps.append(suite_step)
    suite = None
    if xml.is_file():
        try:
            suite = parse_junit(xml)
        except ValueError:
            suite = None
    if suite is None:
        suite = parse_pytest_log(tests_log.read_text(errors="replace"))
        if not suite.complete and not suite.failures:
            suite.source = "none"

    bench_json, bench_log = logdir / "bench.json", logdir / "bench.log"
    bench_json.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--json", str(bench_json.resolve()), "--verbose"]
    if a.cpu_smoke:
        cmd += ["--quick", "--no-main-job"]
    cmd += bench_extra
    print(f"\ngpu_check: benchmark (at most {a.bench_timeout:g} s): {shlex.join(cmd)}", flush=True)
    bench_step = run_logged("benchmark", cmd, bench_log, a.bench_timeout, env)
    steps.append(bench_step)
    bench, bench_error = None, ""
    try:
        bench = read_bench(bench_json)
    except ValueError as e:
        bench_error = (f"bench.json is missing (the benchmark was stopped before writing it; see {bench_log})"
                       if not bench_json.exists() else str(e))

    extra_ok, extra_text = True, ""
    for name, words in (e for m in a.models for e in EXTRA_BENCHES[m]):
        out_json, out_log = logdir / f"bench-{name}.json", logdir / f"bench-{name}.log"
        out_json.unlink(missing_ok=True)
        cmd = [sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--json", str(out_json.resolve()), "--verbose"]
        cmd += (["--quick"] if a.cpu_smoke else []) + shlex.split(words)
        print(f"\ngpu_check: benchmark {name} (at most {a.bench_timeout:g} s): {shlex.join(cmd)}", flush=True)
        step = run_logged(f"benchmark {name}", cmd, out_log, a.bench_timeout, env)
        steps.append(step)
        extra_ok &= step.ok
        try:
            rows = read_bench(out_json)["rows"]
        except ValueError as e:
            rows, extra_text = [], extra_text + f"\nbenchmark {name}: {step.status}; no figures ({e})\n"
        if rows:
            extra_text += f"\nbenchmark {name}: {step.status}\n\n| row | samples/s |\n| --- | --- |\n" + "".join(
                f"| {r.name} | {_fmt_rate(r.samples_per_sec) if r.samples_per_sec is not None else r.note} |\n"
                for r in rows)
    text = render_summary(facts, suite, suite_step, bench, bench_step, steps, str(logdir), a.cpu_smoke,
                          bench_error) + extra_text
    status = verdict(suite, suite_step, bench_step, a.cpu_smoke) or (0 if extra_ok else 1)
    said = [ln for ln in (logdir / "cudnn-probe.log").read_text(errors="replace").splitlines()
            if ln.startswith("cudnn_probe: ")]
    text += f"cuDNN probe: {said[-1] if said else 'no summary line'} ({probe_step.status}; {logdir / 'cudnn-probe.log'})\n"
    if not probe_step.ok:
        status = 1
    text += f"result: {'OK' if status == 0 else 'FAILED'} (exit {status})\n"
    (logdir / "summary.md").write_text(text)
    print("\n" + text, end="", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
