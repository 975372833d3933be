"""pyproject.toml installs every subpackage and the embedded data (checked without building)."""
import os
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO


def test_pyproject_lists_every_subpackage_and_the_data():
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "towers").rglob("__init__.py")}
    assert on_disk - set(conf["packages"]) == set(), "add these to [tool.setuptools] packages"
    data_dir = REPO / conf["package-dir"]["towers._data"]
    for name in conf["package-data"]["towers._data"]:
        assert (data_dir / name).is_file(), name


def test_console_scripts_point_at_main_functions():
    import importlib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, _, fn = target.partition(":")
        assert callable(getattr(importlib.import_module(module), fn)), name


# The commands a user runs, each a package module with a console script (``pip install .`` does not
# install tools/), while ``python -m tools.X`` keeps working in a checkout with the same main.
USER_TOOLS = {"fetch_data": "towers-fetch-data", "tfrecord_to_npz": "towers-tfrecord-to-npz",
              "npz_to_tfrecord": "towers-npz-to-tfrecord", "images_to_tfrecord": "towers-images-to-tfrecord"}


def test_the_tools_users_run_are_installed_as_console_scripts():
    import importlib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    scripts, packages = project["project"]["scripts"], project["tool"]["setuptools"]["packages"]
    for tool, script in USER_TOOLS.items():
        assert script in scripts, f"tools/{tool}.py has no console script {script}"
        module, _, fn = scripts[script].partition(":")
        assert module.rpartition(".")[0] in packages, f"{module} is not in an installed package"
        assert getattr(importlib.import_module(f"tools.{tool}"), "main") is getattr(importlib.import_module(module), fn)


# runpy runs each module as __main__ again, after the import above: its warning says so, and --help only parses.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
def test_each_command_names_itself_in_its_usage_line(monkeypatch, capsys):
    """``--help`` of an installed console script, of ``python -m towers.X`` and of ``python -m tools.X``: the usage
    line names the command that ran (the installed npz and image converters printed ``python -m tools....``)."""
    import importlib
    import runpy

    def usage(call, argv0):
        monkeypatch.setattr(sys, "argv", [argv0, "--help"])
        with pytest.raises(SystemExit) as done:
            call()
        assert done.value.code == 0
        return capsys.readouterr().out.splitlines()[0]

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for script, target in scripts.items():
        module, _, fn = target.partition(":")
        # What the console script pip writes does: sys.argv[0] its own path, then sys.exit(main()).
        entry = getattr(importlib.import_module(module), fn)
        assert usage(entry, f"/usr/local/bin/{script}").startswith(f"usage: {script} "), script
        assert usage(lambda: runpy.run_module(module, run_name="__main__"), module).startswith(
            f"usage: python -m {module} "), module
    for tool in USER_TOOLS:
        assert usage(lambda: runpy.run_module(f"tools.{tool}", run_name="__main__"), tool).startswith(
            f"usage: python -m tools.{tool} "), tool


def test_command_lines_sit_beside_train_and_the_library_imports_none():
    # Before: the converters' and the fetcher's command lines lived in towers/data/ (towers.data.fetch:main,
    # ...) and that library imported towers.cli.  Every console script is now a top-level module of towers,
    # and nothing under towers/ below the top level imports towers.cli.
    import ast

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    nested = {name: target for name, target in scripts.items() if target.count(".") != 1}
    assert nested == {}, "a command line belongs beside towers/train.py"
    for path in (REPO / "towers").rglob("*.py"):
        if path.parent == REPO / "towers":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names] \
                if isinstance(node, ast.ImportFrom) else []
            assert "towers.cli" not in names, f"{path.relative_to(REPO)} imports towers.cli"


def test_import_towers_loads_no_protobuf_and_npz_training_no_image_codec(tmp_path):
    # Before: `import towers` loaded protobuf (the TFRecord reader) and the converter's command line.
    # Protobuf stays installed for the TensorBoard writer, which a run loads when it starts writing; the
    # image codecs are hidden as uninstalled packages are (importing them raises).
    code = ("import sys\nimport towers\nassert 'google.protobuf' not in sys.modules, 'protobuf loaded'\n"
            "assert 'towers.data.tfrecord.convert' not in sys.modules and 'towers.tfrecord_to_npz' not in sys.modules\n"
            "for m in ('PIL', 'simplejpeg'): sys.modules[m] = None\n"
            "from towers.train import main\n"
            "sys.exit(main(['--devices', 'cpu', '--steps', '3', '--quiet', '--logdir', sys.argv[1]]))")
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "run" / "final.npz").exists()


def test_hosts_without_ray_installed_is_one_line_naming_the_extra():
    # Ray is hidden as an uninstalled package is: `import ray` raises ModuleNotFoundError.
    code = ("import sys; sys.modules['ray'] = None; from towers.train import main; "
            "sys.exit(main(['--hosts', '2', '--devices', 'cpu', '--steps', '2', '--quiet', '--logdir', sys.argv[1]]))")
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", code, "/nonexistent-logdir-not-written"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    # Before: a ModuleNotFoundError traceback, exit 1.
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "towers.train: error: --hosts > 1 runs on Ray, which is not installed: pip install 'towers[cluster]' "
        "(or pip install ray), or train on one host"]


# -- what an install brings (issue: a new user's first hour) -------------------------------------------

CUDA_PACKAGES = ("cupy", "nvidia-", "cuda-")


def test_a_plain_install_is_the_cpu_core_and_the_extras_bring_cupy_and_nccl_for_the_machines_cuda():
    # Before: every install pulled cupy-cuda12x and nvidia-nccl-cu12 (about 700 MB), also without a GPU.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    cuda = [d for d in project["dependencies"] if d.lower().startswith(CUDA_PACKAGES)]
    assert cuda == [], "the core installs no CUDA package"
    extras = project["optional-dependencies"]
    assert extras["cuda12"] == ["cupy-cuda12x[ctk]>=14.0", "nvidia-nccl-cu12>=2.18"]
    assert extras["cuda13"] == ["cupy-cuda13x[ctk]>=14.0", "nvidia-nccl-cu13>=2.27"]
    assert extras["cluster"] == ["ray>=2.40"] and extras["fast-cpu"] == ["numba>=0.61"]
    # The frontend versions towers.devices.cudnn is written for (1.32 moved its tensors to Python, without set_alignment).
    assert extras["cudnn12"][0] == extras["cudnn13"][0] == "nvidia-cudnn-frontend>=1.23,<1.33"


def test_the_quick_start_installs_towers_itself_with_what_the_tests_need():
    # Before: requirements.txt held the dependencies only, so a script outside the checkout could not import towers.
    lines = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    lines = [line for line in lines if line]
    assert lines[0] == "-e .[cluster,fast-cpu,test]", lines
    # The CUDA kernels' compile test on a machine without a GPU: CuPy and NVRTC, not the CUDA libraries.
    assert sorted(lines[1:]) == ["cupy-cuda12x>=14.0", "nvidia-cuda-nvrtc-cu12>=12.0"]
    readme = (REPO / "README.md").read_text()
    quick = "```\npip install -r requirements.txt && python -m towers.train --n-gpu 2\npython -m pytest -q\n```"
    assert quick in readme  # still two commands


# CuPy hidden as an uninstalled package is: `import cupy` raises ModuleNotFoundError, importlib finds no spec.
NO_CUPY = "import sys; sys.modules['cupy'] = None; "


def _without_cupy(code: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_CUPY + code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("flags, line", [
    (["--devices", "0"], "towers.train: error: --devices 0 names a GPU, but CuPy is not installed, so towers cannot "
                         "use a GPU: pip install 'towers[cuda12]' or 'towers[cuda13]' (the CUDA version nvidia-smi "
                         "shows; in a checkout: pip install -e '.[cuda12]'); or use --devices cpu"),
    (["--n-gpu", "2", "--no-soft-placement"],
     "towers.train: error: asked for 2 GPU towers (--n-gpu 2) but CuPy is not installed, so towers cannot use a "
     "GPU: pip install 'towers[cuda12]' or 'towers[cuda13]' (the CUDA version nvidia-smi shows; in a checkout: pip "
     "install -e '.[cuda12]'); use --devices cpu, or fall back to the CPU (drop --no-soft-placement)"),
])
def test_a_gpu_asked_for_without_cupy_is_one_line_naming_the_extras(flags, line, tmp_path):
    # Before: "GPU 0 does not exist: no CUDA device is visible", which sends a user looking for a driver.
    p = _without_cupy("from towers.train import main; sys.exit(main(sys.argv[1:]))",
                      *flags, "--steps", "2", "--quiet", "--logdir", str(tmp_path / "run"))
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [line], p.stderr
    assert not (tmp_path / "run").exists()


def test_soft_placement_without_cupy_says_what_to_install_and_trains_on_the_cpu(tmp_path):
    p = _without_cupy("from towers.train import main; sys.exit(main(sys.argv[1:]))",
                      "--n-gpu", "2", "--steps", "2", "--quiet", "--summary-every", "0", "--logdir", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[0] == ("soft placement: CuPy is not installed (towers[cuda12] or towers[cuda13] "
                                        "for GPUs), running 2 towers on the CPU with NumPy")
    assert (tmp_path / "final.npz").exists()


def test_every_module_imports_without_cupy():
    code = ("import importlib, pkgutil, towers\n"
            "for m in pkgutil.walk_packages(towers.__path__, 'towers.'):\n"
            "    importlib.import_module(m.name)\n"
            "print('imported', len(sys.modules))")
    p = _without_cupy(code)
    assert p.returncode == 0 and p.stdout.startswith("imported"), p.stderr


def test_the_gpu_test_modules_skip_without_cupy():
    # Before: their filterwarnings mark resolved cupy._util.PerformanceWarning by importing CuPy, and without it
    # pytest stopped the whole session with an INTERNALERROR.
    # In this process (-n 0): a worker process would not inherit the CuPy hidden here.
    code = ("import pytest; sys.exit(pytest.main(['-q', '-n', '0', '-rs', '-p', 'no:cacheprovider', "
            "'tests/gpu/test_gpu.py', 'tests/gpu/test_gpu_layers.py', 'tests/gpu/test_gpu_training.py']))")
    p = _without_cupy(code, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    assert " skipped" in p.stdout.splitlines()[-1] and "passed" not in p.stdout.splitlines()[-1], p.stdout[-500:]
    assert "CuPy is not installed (towers[cuda12], [cuda13])" in p.stdout  # the reason, not "no CUDA device"


def test_nccl_that_does_not_load_is_one_line_naming_the_extras(monkeypatch):
    # CuPy imports cupy.cuda.nccl without NCCL's library (available = False, a warning); its first call failed.
    import types

    from towers.errors import UserError
    from towers.parallel.allreduce import nccl_module

    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = types.ModuleType("cupy.cuda.nccl")
    cuda.nccl.available = False
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    with pytest.raises(UserError, match=r"^towers on several GPUs average through NCCL, whose library does not "
                                        r"load: pip install 'towers\[cuda12\]' or 'towers\[cuda13\]'"):
        nccl_module()
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)  # no CuPy at all
    with pytest.raises(UserError, match=r"NCCL, whose library does not load \(import of cupy.cuda halted"):
        nccl_module()
