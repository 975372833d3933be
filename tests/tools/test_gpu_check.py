"""tools/gpu_check.py, the one command of the GPU check, on a machine without a GPU.

Its refusal without a GPU (fast, one line, status 2), its one-line flag errors,
the time limit of a step, and the library under its summary: the junit xml of
a real pytest run, pytest's console log, and the benchmark's json.  The whole
pipeline (``--cpu-smoke``) takes 15 s to a minute and is not run here.
"""
import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, cuda_count
from tools import gpu_check

TINY_TESTS = '''
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 2 + 2 == 5, "arithmetic is broken here"

def test_skips():
    pytest.skip("not today")

@pytest.mark.xfail(reason="known to fail")
def test_xfails():
    assert False

@pytest.fixture
def broken():
    raise RuntimeError("the fixture cannot start")

def test_errors(broken):
    pass

class TestGroup:
    @pytest.mark.parametrize("n", [1, 2])
    def test_param(self, n):
        assert n == 1, f"n is {n}"
'''


def _run(args, cwd=REPO, timeout=60):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_without_a_gpu_it_refuses_fast_with_one_line(tmp_path):
    if cuda_count() > 0:
        pytest.skip("a CUDA device is visible: the command would run the whole GPU check")
    logs = tmp_path / "logs"
    t0 = time.monotonic()
    p = _run(["-m", "tools.gpu_check", str(logs)])
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    # The preflight stops first where a package the check needs is missing; else the machine facts find no GPU.
    assert (lines[0].startswith("gpu_check: error: no CUDA device is visible to CuPy (") and "--cpu-smoke" in lines[0]
            or lines[0].startswith("gpu_check: error: preflight: ")), lines[0]
    assert took < 30, f"the refusal took {took:.1f} s"
    assert {f.name for f in logs.iterdir()} <= {"machine.txt", "preflight.json"}
    assert p.stdout == ""


def test_the_preflight_stops_in_seconds_with_one_line_naming_what_is_missing(tmp_path):
    """nvmath-python made unimportable (a package of that name that raises, first on the path): the check stops
    before any step, with one line naming it and how to bring it, and the versions it found in preflight.json."""
    pytest.importorskip("cupy")
    pytest.importorskip("cudnn", reason="the cuDNN frontend would stop the preflight first")
    hide = tmp_path / "hide" / "nvmath"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide.parent), str(REPO)]))
    logs = tmp_path / "logs"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "tools.gpu_check", str(logs)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: error: preflight: nvmath-python: ImportError: "
                                                   "hidden by the test; carry it: tools/gpu_wheels.sh"), p.stderr
    assert took < 30, f"the preflight took {took:.1f} s"
    found = json.loads((logs / "preflight.json").read_text())
    assert found["stop"][0] == "nvmath-python" and found["versions"]["cudnn_frontend"]
    assert "nvmath absent" in gpu_check.preflight_line(found) and "STOPS: nvmath-python" in gpu_check.preflight_line(found)


def test_a_bad_flag_is_one_line_and_status_2(tmp_path):
    p = _run(["tools/gpu_check.py", str(tmp_path / "logs"), "--tests-timout", "5"])
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("gpu_check: error: "), p.stderr
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("args, words", [
    (["--bench-timeout", "0"], "must be > 0"),
    (["--bench-args", "--rounds 'unclosed"], "--bench-args"),
    (["--models", "vgg16"], "--models vgg16: use some of resnet50"),
    ([], "is a file"),
])
def test_bad_arguments_are_one_line_and_status_2(tmp_path, capsys, args, words):
    logdir = tmp_path / "logs"
    if not args:
        logdir.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        gpu_check.main([str(logdir), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpu_check: error: ") and words in err, err


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A real pytest run of a generated test file: (its junit xml, its console output, the folder)."""
    d = tmp_path_factory.mktemp("tiny")
    (d / "test_tiny.py").write_text(TINY_TESTS)
    xml = d / "out.xml"
    p = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEsxX", "--junitxml", str(xml), "test_tiny.py"],
             cwd=d)
    assert p.returncode == 1, p.stdout + p.stderr
    return xml, p.stdout, d


def test_junit_xml_of_a_real_run_gives_counts_and_failures(tiny_run):
    xml, _, d = tiny_run
    r = gpu_check.parse_junit(xml, root=d)
    assert (r.passed, r.failed, r.errors, r.skipped, r.xfailed) == (2, 2, 1, 1, 1), r
    assert r.source == "junit xml" and r.seconds is not None and r.seconds >= 0
    assert r.failures == [
        ("test_tiny.py::test_fails", "AssertionError: arithmetic is broken here"),
        ("test_tiny.py::test_errors (error)", 'failed on setup with "RuntimeError: the fixture cannot start"'),
        ("test_tiny.py::TestGroup::test_param[2]", "AssertionError: n is 2"),
    ], r.failures
    assert r.line().startswith("2 passed, 2 failed, 1 errors, 1 skipped, 1 xfailed in ")


def test_the_console_log_gives_the_same_figures_when_the_xml_is_missing(tiny_run):
    xml, out, d = tiny_run
    from_xml, from_log = gpu_check.parse_junit(xml, root=d), gpu_check.parse_pytest_log(out)
    assert from_log.complete and from_log.source == "log"
    counts = ("passed", "failed", "errors", "skipped", "xfailed")
    assert [getattr(from_log, k) for k in counts] == [getattr(from_xml, k) for k in counts]
    assert sorted(t for t, _ in from_log.failures) == sorted(t for t, _ in from_xml.failures)  # -rfE: failures first
    cut = gpu_check.parse_pytest_log(out.split("short test summary")[0] + "\nFAILED t.py::x - boom\n")
    assert not cut.complete and (cut.failed, cut.failures) == (1, [("t.py::x", "boom")])


def test_junit_without_a_name_and_not_junit(tmp_path):
    """The testcase pytest writes for the test it was in when interrupted counts for nothing; other xml is refused."""
    xml = tmp_path / "x.xml"
    xml.write_text('<testsuites><testsuite time="1.5"><testcase classname="tests.test_a" name="test_ok" />'
                   '<testcase time="0.000" /></testsuite></testsuites>')
    r = gpu_check.parse_junit(xml, root=None)
    assert (r.passed, r.failed, r.seconds) == (1, 0, 1.5)
    xml.write_text("<html/>")
    with pytest.raises(ValueError, match="not a junit xml"):
        gpu_check.parse_junit(xml)
    xml.write_text("<testsuites><testsuite")
    with pytest.raises(ValueError, match="not a junit xml"):
        gpu_check.parse_junit(xml)


BENCH = {
    "env": {"gpus": ["NVIDIA H200"], "cupy": "14.2.0"},
    "settings": {"steps": 1000},
    "rows": [
        {"name": "MLP towers 1 tower, GPU 0, b100", "kind": "towers", "model": "MLP",
         "cold": {"wall_us_per_step": 300.0}, "result": {"samples_per_sec": 453121.4, "wall_us_per_step": 220.7,
                                                        "launches": {"kernels_per_tower_step": 17.0}}},
        {"name": "MLP towers N towers on N GPUs", "kind": "skip", "note": "skipped: only one GPU"},
        {"name": "MLP PyTorch eager, GPU 0, b100", "kind": "torch", "result": {"error": "CUDA OOM\nTraceback..."}},
        {"name": "LeNet-5 some new row", "kind": "something-new", "result": {"samples_per_sec": 162086}},
        {"name": "a row still running", "kind": "towers"},
        {"kind": "towers", "result": {"samples_per_sec": 1.0}},
        "not a row",
    ],
    "main_job": {"GPU, warm kernel cache": {"wall_s": 2.61, "cmd": "..."}, "CPU, 2 cores": {"error": "timed out"}},
    "ratios": {"MLP towers 1 tower / PyTorch b100": 3.5866, "main job GPU warm wall / CPU wall": None},
    "a key from tomorrow": [1, 2, 3],
}


def test_bench_json_rows_ratios_and_the_summary(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(BENCH))
    b = gpu_check.read_bench(path)
    assert [(r.name, r.samples_per_sec, r.note) for r in b["rows"]] == [
        ("MLP towers 1 tower, GPU 0, b100", 453121.4, ""),
        ("MLP towers N towers on N GPUs", None, "skipped: only one GPU"),
        ("MLP PyTorch eager, GPU 0, b100", None, "FAILED: CUDA OOM"),
        ("LeNet-5 some new row", 162086.0, ""),
        ("a row still running", None, "no result"),
    ]
    assert b["ratios"] == {"MLP towers 1 tower / PyTorch b100": 3.5866, "main job GPU warm wall / CPU wall": None}
    assert b["main_job"] == {"GPU, warm kernel cache": 2.61, "CPU, 2 cores": None}

    facts = {"gpus": ["NVIDIA H200"], "device_count": 1, "cupy": "14.2.0", "nccl": 22703, "cuda_runtime": 13000,
             "cuda_driver": 13000, "nvrtc": [13, 0], "numpy": "2.5.0", "python": "3.12.3", "no_gpu": None}
    suite = gpu_check.SuiteResult(passed=61, failed=1, skipped=3, xfailed=1, seconds=143.2, source="junit xml",
                                  failures=[("tests/gpu/test_gpu.py::test_x", "AssertionError: " + "y" * 300),
                                            ("tests/gpu/test_gpu.py::test_y (error)", "failed on setup")])
    tests = gpu_check.Step("GPU tests", rc=1, seconds=150.0, status="exit 1")
    bench = gpu_check.Step("benchmark", rc=0, seconds=200.0, status="ok")
    text = gpu_check.render_summary(facts, suite, tests, b, bench, [tests, bench], "LOGS")
    lines = text.splitlines()
    assert ("machine: 1 x NVIDIA H200; CuPy 14.2.0, NCCL 2.27.3, CUDA runtime 13.0, driver 13.0, NVRTC 13.0, "
            "NumPy 2.5.0, torch absent, Python 3.12.3") in lines
    assert "GPU tests: 61 passed, 1 failed, 0 errors, 3 skipped, 1 xfailed in 143 s" in lines
    failed = [line for line in lines if line.startswith("- FAILED tests/gpu/test_gpu.py::test_x: AssertionError: yyy")]
    assert len(failed) == 1 and failed[0].endswith("...") and len(failed[0]) < 200
    assert "- ERROR tests/gpu/test_gpu.py::test_y: failed on setup" in lines
    for row in ("| MLP towers 1 tower, GPU 0, b100 | 453,121 |",
                "| MLP PyTorch eager, GPU 0, b100 | FAILED: CUDA OOM |",
                "| MLP towers N towers on N GPUs | skipped: only one GPU |", "| LeNet-5 some new row | 162,086 |",
                "- MLP towers 1 tower / PyTorch b100: 3.59", "- main job GPU warm wall / CPU wall: n/a",
                "steps: GPU tests 150.0 s (exit 1); benchmark 200.0 s (ok); total 350 s"):
        assert row in lines, row
    assert gpu_check.verdict(suite, tests, bench) == 1
    clean = gpu_check.SuiteResult(passed=61, source="junit xml")
    tests_ok = gpu_check.Step("GPU tests", rc=0)
    assert gpu_check.verdict(clean, tests_ok, bench) == 0
    assert gpu_check.verdict(clean, tests_ok, gpu_check.Step("benchmark", rc=0, killed=True)) == 1
    skipped_all = gpu_check.SuiteResult(skipped=61, source="junit xml")
    assert gpu_check.verdict(skipped_all, tests_ok, bench) == 1  # nothing was checked on the GPU
    assert gpu_check.verdict(skipped_all, tests_ok, bench, cpu_smoke=True) == 0

    path.write_text(json.dumps(BENCH)[:-40])
    with pytest.raises(ValueError):
        gpu_check.read_bench(path)


def test_a_step_past_its_limit_is_stopped_and_logged(tmp_path):
    code = "import time; print('started', flush=True); time.sleep(60)"
    log = tmp_path / "step.log"
    t0 = time.monotonic()
    step = gpu_check.run_logged("sleeper", [sys.executable, "-c", code], log, 1.0, echo=open(tmp_path / "echo", "w"))
    assert time.monotonic() - t0 < 15
    assert step.killed and not step.ok and "1 s limit" in step.status
    text = log.read_text()
    assert "started" in text and "[gpu_check: sleeper: stopped at its 1 s limit" in text
    assert "started" in (tmp_path / "echo").read_text()


@pytest.mark.slow
def test_the_gpu_tests_dry_run_on_the_cpu():
    """The GPU tests that take their device from tests/gpu_compare.py run here with TOWERS_TEST_GPU_AS=cpu (both
    sides CPU runs, which must agree): a broken test is found before a GPU lease is spent on it."""
    import os
    import re

    env = dict(os.environ, TOWERS_TEST_GPU_AS="cpu")
    env.pop("TOWERS_GPU_REPORT", None)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "gpu", "-p", "no:cacheprovider",
                          "tests/gpu/test_gpu_layers.py", "tests/gpu/test_gpu_training.py"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", res.stdout).group(1))
    assert passed >= 40, res.stdout[-500:]


def test_the_default_run_fits_its_budget_with_each_models_references_first():
    """The time budget is explicit (gpu_check.budget): the steps' limits sum to BUDGET at most, the benchmark's
    estimate for its default rows fits its limit, its PyTorch rows come before towers' (a run stopped at its limit
    keeps the references), and no cold start-up run is made unless asked (--startup)."""
    from tools import bench_gpu

    b = gpu_check.budget()
    assert b["total"] <= gpu_check.BUDGET, b["steps"]
    assert b["bench_estimate"] <= gpu_check.BENCH_TIMEOUT, b["bench_estimate"]
    measured = [r for r in b["rows"] if r["kind"] != "skip"]
    assert measured and {r["model"] for r in measured} == {"ResNet-20"}
    kinds = [r["kind"] for r in measured]
    assert kinds == ["torch"] * kinds.count("torch") + ["towers"] * kinds.count("towers"), kinds
    assert {r["gpu_conv"] for r in measured if r["kind"] == "towers"} == {"im2col", "cudnn", "cudnn+graphs"}
    a = bench_gpu.parse_args(shlex.split(gpu_check.BENCH_ARGS))
    assert not a.startup
    cold = bench_gpu.estimate_seconds(b["rows"], a.sizes, a.rounds, startup=True, host_profile=a.host_profile)
    assert cold > b["bench_estimate"] + 5 * bench_gpu.START_S["cold"]
    for model in ("MLP", "LeNet-5", "CIFAR-10"):  # every model's rows: references first
        rows = [r for r in bench_gpu._plan(1, True, [model], False, ["im2col", "cudnn"]) if r["kind"] != "skip"]
        first_towers = next(i for i, r in enumerate(rows) if r["kind"] == "towers")
        assert all(r["kind"] == "towers" for r in rows[first_towers:]), model


def test_resnet50_rows_come_when_asked_for_not_in_the_default_run():
    """tf_cnn_benchmarks' workload: ResNet-50 at 224x224 on synthetic data, towers fp32 and bf16 against PyTorch
    eager fp32, AMP bf16 channels-last and torch.compile, at batch 64 and 128 a tower, and forward only."""
    from tools import bench_gpu

    assert "ResNet-50" not in bench_gpu.DEFAULT_MODELS and "resnet50" not in gpu_check.BENCH_ARGS
    assert bench_gpu.model_names("resnet50") == ["ResNet-50"] and bench_gpu.MODELS["ResNet-50"][4] == (224, 224, 3)
    rows = bench_gpu._plan(1, True, ["ResNet-50"], True, ("cudnn",), batch=128, bf16=True)
    names = [r["name"] for r in rows]
    assert "ResNet-50 towers cudnn 1 tower, GPU 0, b128" in names
    assert any(r["kind"] == "towers" and r.get("precision") == "bf16" for r in rows)
    assert {r["variant"] for r in rows if r["kind"] == "torch"} == {"fp32", "amp", "compile"}
    assert [r["batch"] for r in rows if r["kind"] == "torch" and r["variant"] == "fp32"] == [128, 256]
    words = [w for _, w in gpu_check.EXTRA_BENCHES["resnet50"]]
    assert any("--batch 64" in w for w in words) and any("--batch 128" in w for w in words)
    assert any("--forward-only" in w for w in words) and all("--bf16" in w for w in words)
