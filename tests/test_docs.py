"""The docs (README.md, docs/*.md): their internal links resolve, their Python examples run, the commands
they show parse.  The command-line reference's generated table is checked in ``tests/test_settings.py``.

An example that cannot run here (it needs a finished run, Ray, a GPU, or is a fragment of a file) says so on
the line before its fence, ``<!-- example: not run (why) -->``; it is still compiled, so it stays Python.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "tools" / "README.md",
        REPO / "tools" / "README_bench.md"]
NOT_RUN = re.compile(r"<!-- example: not run \(.+\) -->")
FENCE = re.compile(r"^```(\w*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")


def blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, code, the line before the fence) of each fenced block."""
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            found.append((i + 1, m.group(1), "\n".join(lines[i + 1:j]) + "\n", lines[i - 1] if i else ""))
            i = j
        i += 1
    return found


def prose(path: Path) -> str:
    """The text outside fenced blocks and inline code."""
    out, fenced = [], False
    for line in path.read_text().split("\n"):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path).split("\n"):
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        base = slug(re.sub(r"[`*]", "", m.group(1)))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path)) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_internal_link_resolves(doc):
    bad = []
    for target in links(doc):
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            bad.append(f"{target}: {file.relative_to(REPO) if file.is_relative_to(REPO) else file} does not exist")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{target}: {file.name} has no heading #{anchor}")
    assert not bad, f"{doc.relative_to(REPO)}: " + "; ".join(bad)


def _python_examples():
    seen = {}
    for doc in DOCS:
        for line, lang, code, before in blocks(doc):
            if lang == "python" and code not in seen:
                seen[code] = pytest.param(code, bool(NOT_RUN.search(before)),
                                          id=f"{doc.relative_to(REPO)}:{line}")
    return list(seen.values())


@pytest.mark.parametrize("code,not_run", _python_examples())
def test_the_python_examples_run(code, not_run, tmp_path):
    """Each example runs in a folder of its own, as a user's script would (the installed towers: PYTHONPATH
    stands for it here); an example marked not run is compiled only."""
    compile(code, "example.py", "exec")
    if not_run:
        return
    (tmp_path / "example.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    if "tr.fit()" in code:  # the README's example: a run of its own, in the folder it ran in
        assert "'accuracy': 0.9" in p.stdout, p.stdout
        assert len(list((tmp_path / "runs").iterdir())) == 1


def _commands():
    """Each ``python -m towers.X`` / ``towers-X`` line of a shell block, continuation lines joined."""
    found = []
    for doc in DOCS[:-2]:
        for line, lang, code, _ in blocks(doc):
            if lang not in ("", "sh", "bash", "console"):
                continue
            for k, text in enumerate(code.replace("\\\n", " ").split("\n")):
                m = re.match(r"\s*(?:python -m towers\.|towers-)(train|eval|export)\b(.*)", text.split("  #")[0])
                if m:
                    found.append(pytest.param(m.group(1), shlex.split(m.group(2), comments=True),
                                              id=f"{doc.relative_to(REPO)}:{line + 1 + k}"))
    return found


@pytest.mark.parametrize("command,argv", _commands())
def test_the_commands_shown_parse(command, argv):
    """Their flags exist and their values pass the settings' checks (nothing runs)."""
    from towers.eval import build_parser as eval_parser
    from towers.export import build_parser as export_parser
    from towers.train import parse_config

    parse = {"train": parse_config, "eval": lambda a: eval_parser().parse_args(a),
             "export": lambda a: export_parser().parse_args(a)}[command]
    try:
        parse(argv)
    except SystemExit:  # argparse has printed why
        pytest.fail(f"python -m towers.{command} {shlex.join(argv)}: its flags do not parse")


def test_the_docs_say_what_the_software_does_not_its_history():
    # "issue 31", "this round", "run D", a commit hash (7 to 40 hex digits with a letter and a digit)
    history = re.compile(r"\b[Ii]ssue \d+|\bthis round\b|\brun [A-H]\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
    bad = [f"{doc.relative_to(REPO)}: {m.group(0)!r}" for doc in DOCS for m in history.finditer(doc.read_text())]
    assert not bad, bad
