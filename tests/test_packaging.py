"""pyproject.toml installs every subpackage and the embedded data (checked without building)."""
import sys
import tomllib

import pytest

from conftest import REPO


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
