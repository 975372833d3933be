"""pyproject.toml installs every subpackage and the embedded data (checked without building)."""
import tomllib

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
