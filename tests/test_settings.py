"""Each setting is declared once (towers/settings.py): the flags, the command-line reference's table (docs/cli.md) and
the resume rules agree."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from towers import Config
from towers.config import checkpoint_settings
from towers.optim.optimizers import OPTIMIZERS
from towers.errors import UserError
from towers.settings import (GROUPS, NOTE, REFUSE, RULES, SILENT, Check, flag_name, flag_table, help_text,
                             resume_changes)
from towers.train import build_parser, main, parse_config

ROOT = Path(__file__).resolve().parents[1]


def reference_flag_table() -> str:
    text = (ROOT / "docs" / "cli.md").read_text()
    m = re.search(r"<!-- flag table:[^\n]*-->\n(.*?)\n<!-- end of flag table -->", text, re.S)
    assert m, "docs/cli.md has no generated flag table between its markers"
    return m.group(1)


def test_the_command_line_references_flag_table_is_the_declarations():
    want = flag_table(Config)
    assert reference_flag_table() == want, "docs/cli.md's flag table is out of date; paste this:\n" + want


def test_every_setting_is_declared_with_a_help_a_check_and_a_resume_rule():
    for f in dataclasses.fields(Config):
        meta = f.metadata
        assert meta.get("resume") in RULES, f"{f.name} has no resume rule"
        assert isinstance(meta.get("check"), Check), f"{f.name} has no check"
        assert meta.get("help") and meta.get("group"), f"{f.name} has no help or group"


def test_every_field_is_a_flag_with_its_default_and_its_help():
    parser = build_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(Config):
        action = by_dest[f.name]
        assert flag_name(f) in action.option_strings
        assert action.help == help_text(f).replace("%", "%%").replace("`", "")
        assert action.help.startswith(f.metadata["help"].replace("%", "%%").replace("`", ""))
    assert parse_config([]) == Config()
    cfg = parse_config(["--optimizer", "rmsprop", "--rmsprop-decay", "0.8", "--rmsprop-centered",
                        "--weight-decay", "0.1", "--no-soft-placement"])
    assert (cfg.rmsprop_decay, cfg.rmsprop_centered, cfg.weight_decay, cfg.soft_placement) == (0.8, True, 0.1, False)


def help_sections(text: str) -> dict[str, list[str]]:
    """{heading: its lines} of an argparse --help text (a heading is a line 'name:' at column 0)."""
    sections, current = {}, None
    for line in text.splitlines():
        if re.fullmatch(r"[a-z][\w -]*:", line):
            current = sections.setdefault(line[:-1], [])
        elif current is not None:
            current.append(line)
    return sections


def test_help_shows_every_flag_once_under_its_declared_group(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"], prog="towers-train")
    assert e.value.code == 0
    sections = help_sections(capsys.readouterr().out)
    # argparse's own heading (for -h alone), then the declared groups in their order, each with its line
    assert list(sections) == ["options", *GROUPS]
    for name, description in GROUPS.items():
        lines = sections[name]
        assert " ".join(line.strip() for line in lines[:lines.index("")]) == description, name
    flags = {name: re.findall(r"^  (--[a-z0-9-]+)", "\n".join(lines), re.M) for name, lines in sections.items()}
    assert flags["options"] == []
    for f in dataclasses.fields(Config):
        where = [name for name, found in flags.items() if flag_name(f) in found]
        assert where == [f.metadata["group"]], (f.name, where)
    assert sum(map(len, flags.values())) == len(dataclasses.fields(Config))


def test_a_setting_of_an_undeclared_group_is_refused():
    from towers.settings import Integer, setting

    with pytest.raises(ValueError, match="group 'optimisation'"):
        setting(1, "a typo'd group", group="optimisation", check=Integer(), resume=SILENT, type="int")


def test_config_stays_a_plain_dataclass_with_the_optimizers_fields():
    cfg = Config(n_gpu=2, optimizer="adamw", weight_decay=0.05)
    assert dataclasses.is_dataclass(cfg) and cfg.n_gpu == 2
    r = cfg.resolved()
    # momentum is SGD's and RMSProp's: it stays unset with AdamW
    assert (r.optimizer, r.weight_decay, r.lr, r.l2, r.momentum) == ("adamw", 0.05, 0.001, 0.0, None)
    assert Config(optimizer="rmsprop").resolved().rmsprop_epsilon == 1e-10


@pytest.mark.parametrize("kw, needle", [
    (dict(augment="tf-cifar10", normalize="0.5,0.25"), "augment tf-cifar10 standardizes each image itself"),
    (dict(optimizer="sgd", weight_decay=0.1), "weight_decay is for optimizer adamw, not sgd"),
    (dict(optimizer="adam", rmsprop_centered=True), "rmsprop_centered is for optimizer rmsprop, not adam"),
    (dict(optimizer="adamw", momentum=0.9), "momentum is for optimizer sgd, rmsprop, not adamw"),
    (dict(optimizer="rmsprop", rmsprop_decay=1.0), "rmsprop_decay must be a finite number in [0, 1)"),
    (dict(optimizer="adamw", weight_decay=-1.0), "weight_decay must be a finite number >= 0"),
    (dict(x_key=""), "x_key must be a non-empty string"),
])
def test_settings_are_checked_from_their_declarations(kw, needle):
    with pytest.raises(UserError) as e:
        Config(**kw).resolved()
    assert needle in str(e.value)


@pytest.mark.parametrize("argv, kw", [
    (["--optimizer", "sgd", "--beta1", "0.9"], dict(optimizer="sgd", beta1=0.9)),
    (["--optimizer", "adam", "--rmsprop-decay", "0.9"], dict(optimizer="adam", rmsprop_decay=0.9)),
    (["--optimizer", "adam", "--momentum", "0"], dict(optimizer="adam", momentum=0.0)),
    (["--optimizer", "sgd", "--weight-decay", "0.01"], dict(optimizer="sgd", weight_decay=0.01)),
    (["--model", "lenet5", "--optimizer", "rmsprop", "--epsilon", "1e-8"],
     dict(model="lenet5", optimizer="rmsprop", epsilon=1e-8)),
])
def test_a_foreign_hyperparameter_is_refused_when_given_even_at_its_default(argv, kw):
    # It passed when its value was the default (--beta1 0.9 with sgd), and was refused otherwise (0.8):
    # given is decided by the flag (or the keyword), not by the value, on the command line and in Python.
    name = next(k for k in kw if k not in ("model", "optimizer"))
    for cfg in (parse_config(argv), Config(**kw)):
        with pytest.raises(UserError, match=f"{name} is for optimizer .*, not {kw['optimizer']}; drop it"):
            cfg.resolved()


@pytest.mark.parametrize("kw", [dict(), dict(optimizer="adam"), dict(optimizer="adamw", weight_decay=0.05),
                                dict(optimizer="rmsprop", momentum=0.5), dict(model="lenet5"),
                                dict(model="resnet20", optimizer="sgd", nesterov=True)])
def test_a_resolved_config_resolves_to_itself(kw):
    # A cluster's hosts and the scaling measurement resolve the run's resolved settings again: its
    # optimizer's hyperparameters are filled, the others unset, and none of them counts as given.
    r = Config(**kw).resolved()
    assert r.resolved() == r
    reads = {name for cls in OPTIMIZERS.values() for name in cls.settings} - set(OPTIMIZERS[r.optimizer].reads)
    assert all(getattr(r, name) in (None, False) for name in reads), reads


def test_a_checkpoint_that_holds_foreign_defaults_resumes_as_before():
    # Checkpoints written before unused hyperparameters stayed unset hold them at their defaults.
    old = dataclasses.asdict(Config(model="resnet20").resolved())
    old.update(beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.01, rmsprop_decay=0.9, rmsprop_epsilon=1e-10)
    assert not any(resume_changes(old, Config(model="resnet20").resolved()).values())
    del old["lr_boundaries"]  # a setting newer than the checkpoint: resolved from the checkpoint's settings
    assert checkpoint_settings(old)["lr_boundaries"] == "32000,48000"


def changed(name: str):
    """A value of ``name`` other than the resolved default run's (of the field's kind)."""
    f = {f.name: f for f in dataclasses.fields(Config)}[name]
    base = getattr(Config().resolved(), name)
    kind = f.metadata["type"]
    if kind == "bool":
        return not base
    if kind.startswith("int"):
        return (base or 0) + 3
    if kind.startswith("float"):
        return (base or 0.5) / 2
    return "other"


def rule_of_a_change(name: str, **run) -> str | None:
    old = dataclasses.asdict(Config(**run).resolved())
    new = dataclasses.replace(Config(**run).resolved(), **{name: changed(name)})
    found = [rule for rule, items in resume_changes(old, new).items() if any(k == name for k, _, _ in items)]
    return found[0] if found else None


@pytest.mark.parametrize("name, rule", [
    ("model", REFUSE), ("hidden", REFUSE),
    ("augment", NOTE), ("normalize", NOTE), ("decode", NOTE), ("image_size", NOTE), ("lr_schedule", NOTE),
    ("warmup_steps", NOTE), ("nesterov", NOTE), ("label_smoothing", NOTE), ("sync_bn", NOTE), ("seed", NOTE),
    ("lr", NOTE), ("momentum", NOTE), ("ema_decay", NOTE), ("sync", NOTE), ("average_every", NOTE),
    ("input_workers", SILENT), ("log_every", SILENT), ("quiet", SILENT), ("profile", SILENT), ("steps", SILENT),
])
def test_each_setting_has_the_resume_rule_of_its_kind(name, rule):
    assert rule_of_a_change(name) == rule


def test_a_setting_the_run_does_not_use_changes_nothing_on_resume():
    # hidden shapes only the mlp; beta1 is read by Adam and AdamW, not SGD.
    assert rule_of_a_change("hidden", model="lenet5") is None
    assert rule_of_a_change("beta1", optimizer="sgd") is None
    assert rule_of_a_change("beta1", optimizer="adamw") == NOTE
    assert rule_of_a_change("rmsprop_centered", optimizer="rmsprop") == NOTE


# -- the parser every entry point builds (towers/cli.py) -----------------------------------------


@pytest.mark.parametrize("value", ["-1e-10", "-2.5E+3", "-.5e1", "-1e10", "-inf"])
def test_a_negative_number_in_exponent_notation_is_a_flags_value(value):
    # argparse's own pattern took "-1e-10" for a flag: "expected one argument" instead of the setting's check.
    cfg = parse_config(["--optimizer", "rmsprop", "--rmsprop-epsilon", value])
    assert cfg.rmsprop_epsilon == float(value)
    with pytest.raises(UserError, match="rmsprop_epsilon must be a finite number > 0"):
        cfg.resolved()
    with pytest.raises(SystemExit):  # a flag that looks like a number is still no value for another flag
        build_parser().parse_args(["--rmsprop-epsilon", "--lr", "0.1"])


@pytest.mark.parametrize("module, name", [
    ("towers.train", "towers.train"), ("towers.eval", "towers.eval"), ("towers.export", "towers.export"),
    ("towers.tfrecord_to_npz", "tfrecord_to_npz"), ("towers.npz_to_tfrecord", "npz_to_tfrecord"),
    ("towers.images_to_tfrecord", "images_to_tfrecord"),
])
def test_a_flag_mistake_names_the_command_as_its_other_errors_do(module, name, capsys):
    # The name run_main prints for every other error, as the READMEs write it (towers.train: error: ...,
    # tfrecord_to_npz: error: ...), not argparse's prog (python -m towers.train: error: ...).
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(["--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"{name}: error: ") and err.count("\n") == 1, err
