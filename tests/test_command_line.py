"""The command line as an installed user meets it: modules of the current folder, ``--help``'s defaults."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import fields

import numpy

from tests.conftest import REPO
from towers.config import Config
from towers.settings import flag_name
from towers.train import build_parser

# What a console script does (pip's wrapper): ``sys.argv[0]`` its own path, then ``sys.exit(main())``; ``-P``
# keeps the current folder off ``sys.path``, as for a script in ``.../bin``.
CONSOLE = "import sys; from towers.{module} import main; sys.argv[0] = '/usr/local/bin/x'; sys.exit(main(sys.argv[1:]))"


def console_script(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-P", "-c", CONSOLE.format(module=module), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_installed_commands_find_a_model_module_in_the_current_folder(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "nets.py").write_text(textwrap.dedent("""
        import towers

        def small(input_shape, num_classes):
            return [towers.Flatten(), towers.Dense("h", 8), towers.ReLU(), towers.Dense("out", num_classes)]
    """))
    res = console_script("train", "--model", "mypkg.nets:small", "--steps", "2", "--quiet", "--summary-every", "0",
                         "--logdir", str(tmp_path / "run"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "No module named" not in res.stderr
    # towers-export --layout torch builds the run's model from its settings: the same module.
    res = console_script("export", str(tmp_path / "run" / "final.npz"), "-o", str(tmp_path / "w.safetensors"),
                         "--layout", "torch", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "w.safetensors").exists()


def _flag_help() -> dict[str, str]:
    """{flag: its --help text, one line}."""
    return {a.option_strings[0]: " ".join((a.help or "").split()) for a in build_parser()._actions
            if a.option_strings and a.option_strings[0] != "-h"}


def test_help_shows_every_value_flags_default():
    helps = _flag_help()
    for f in fields(Config):
        if f.metadata["type"] == "bool":  # a switch: off unless given (a --no- flag: on unless given)
            continue
        assert "default" in helps[flag_name(f)], (flag_name(f), helps[flag_name(f)])
    for flag, default in (("--batch-size", "100"), ("--hidden", "500"), ("--data", "data/digits.npz"),
                          ("--logdir", "runs/<timestamp>"), ("--keep-checkpoints", "5"), ("--seed", "0")):
        assert f"(default: {default}" in helps[flag], (flag, helps[flag])


def test_help_references_name_their_file():
    """A "see SECTION" in a flag's help names the docs file that has that heading ("see docs/X.md" alone: the page)."""
    headings = {p.name: {re.sub(r"^#+\s*", "", line).strip() for line in p.read_text().splitlines()
                         if line.startswith("#")} for p in (REPO / "docs").glob("*.md")}
    seen = 0
    for flag, text in _flag_help().items():
        for ref in re.findall(r"\bsee ([^;)]*)", text):
            seen += 1
            m = re.fullmatch(r"(?:(.+?) in )?docs/(\w+\.md)(?: .*)?", ref)
            assert m, f"{flag}: 'see {ref}' names no docs file"
            assert m[2] in headings, f"{flag}: docs/{m[2]} does not exist"
            names = {h.replace("`", "") for h in headings[m[2]]}
            listed = (m[1] or "").replace("`", "")
            sections = [listed] if listed in names else re.split(r", | and ", listed)
            for section in filter(None, sections):
                assert section in names, f"{flag}: docs/{m[2]} has no heading {section!r}"
    assert seen > 10


def test_a_missing_data_set_the_fetcher_writes_names_the_fetch_command(tmp_path):
    import pytest

    from towers.errors import UserError
    from towers.run.trainer import Trainer

    with pytest.raises(UserError) as e:
        Trainer(Config(model="lenet5", data=str(tmp_path / "data" / "mnist.npz")))
    assert f"mnist.npz does not exist: towers-fetch-data mnist -o {tmp_path / 'data'} writes it" in str(e.value)
    with pytest.raises(UserError) as e:  # another name: no command to suggest
        Trainer(Config(data=str(tmp_path / "mine.npz")))
    assert "towers-fetch-data" not in str(e.value)


def test_the_tensorboard_viewer_is_an_extra_the_docs_name():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("tensorboard") for dep in extras["tensorboard"])
    text = (REPO / "docs" / "training.md").read_text()
    assert "pip install 'towers[tensorboard]'" in text and "tensorboard --logdir runs" in text


def test_the_readme_says_the_shared_folder_tests_are_optional():
    for line in re.split(r"\n\n", (REPO / "README.md").read_text()):
        if "../shared" in line:
            assert "optional" in line and "not part of the repository" in line, line


def test_a_command_forked_by_the_suite_gives_what_a_new_interpreter_gives(tmp_path):
    """``tests.commands`` forks the suite's commands from a process that has imported towers: the same status,
    output and files as ``python -m`` in a new interpreter, in the command's environment (``COLUMNS`` wraps
    ``--help``), a refusal's one line, and a run's weights."""
    from tests import commands

    def both(*args, env=None):
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        forked = commands.run("towers.train", *args, env=env)
        assert forked.forked  # not a new interpreter: what is compared below is the fork
        new = subprocess.run([sys.executable, "-m", "towers.train", *args], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120)
        assert (forked.returncode, forked.stdout, forked.stderr) == (new.returncode, new.stdout, new.stderr)
        return forked

    narrow, wide = (both("--help", env=dict(os.environ, COLUMNS=str(c))).stdout for c in (60, 200))
    assert narrow != wide and max(map(len, narrow.splitlines())) <= 60
    assert both("--steps", "-1").returncode == 2
    run = ["--devices", "cpu", "--steps", "3", "--hidden", "8", "--quiet", "--summary-every", "0"]
    assert commands.run("towers.train", *run, "--logdir", tmp_path / "forked").forked
    subprocess.run([sys.executable, "-m", "towers.train", *run, "--logdir", str(tmp_path / "new")], cwd=REPO,
                   check=True, capture_output=True, timeout=120)
    with numpy.load(tmp_path / "forked" / "final.npz") as a, numpy.load(tmp_path / "new" / "final.npz") as b:
        assert a.files == b.files and all(numpy.array_equal(a[k], b[k]) for k in a.files)
