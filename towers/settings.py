"""How a setting is declared: one dataclass field whose metadata carries the rest.

A setting of ``towers.Config`` is declared once, with ``setting(...)``: its
default, its help text, its group (one of ``GROUPS``), its check and its resume
rule.  From that one declaration are derived the command line's flags and
``--help``, by group (``towers.train``), the flag table of docs/cli.md (``flag_table``; a test compares
them), the per-field checks of ``Config.resolved()`` (``check_fields``) and what
a changed setting does on ``--resume`` (``resume_changes``).  An optimizer
declares its hyperparameters the same way in its own file
(``towers.optim.optimizers``) and ``Config`` gets them as fields.

Resume rules (``resume=``), each setting has exactly one:

* ``REFUSE``: it shapes the model (``model``, ``hidden``); a checkpoint of
  another shape cannot be continued, so a change is refused, naming it;
* ``NOTE``: it changes the trajectory (optimizer, schedule, data transforms,
  seed, sync ...); the run continues with a note that the continuation differs
  from an uninterrupted run;
* ``BATCH``: it changes the tower count or the global batch; the tower x batch
  note of the resume says what that does;
* ``SILENT``: it changes neither (logging, workers, output, performance).

A setting may also say when it is in use (``used_when``, a predicate on the
resolved config): a change of ``hidden`` matters only to the mlp, one of
``beta1`` only to the optimizers that read it; and when a change that is
otherwise silent changes the trajectory (``note_when``: ``steps`` of a
``cosine`` schedule, which ends at them), a note.

What a resume takes from the checkpoint (``inherited``): every setting the run
did not give explicitly (``given``: the flags typed, the ``Config`` fields
passed) is the checkpoint's, so ``--resume`` alone continues the run as it
was.  A setting the resolution derives from others (``follows``: the
learning rate from the optimizer, ``checkpoint_every`` from the sync period)
is the checkpoint's only while those others are: when one of them is given
with another value, it is derived again, as a fresh run derives it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types

from towers.errors import UserError

REFUSE, NOTE, BATCH, SILENT = "refuse", "note", "batch", "silent"
RULES = (REFUSE, NOTE, BATCH, SILENT)

# The groups a setting may belong to (``group=``), in the order ``--help`` shows them, each with the one line
# its heading there says.
GROUPS = {
    "placement": "how many towers, on which devices",
    "data": "the training and test data, and how they are read",
    "images": "image data: its size, augmentation, normalization and the decoded-image cache",
    "model": "the network",
    "optimization": "how long to train, the batch, the optimizer and its hyperparameters",
    "recipes": "the learning-rate schedule, warm-up, label smoothing, synchronized batch norm",
    "sync": "how the replicas are kept together",
    "hosts": "several hosts on Ray",
    "output": "log lines, the logdir, checkpoints, TensorBoard summaries, resuming",
    "performance": "CPU threads and kernels, GPU matmuls, and what a run measures of its speed",
}


# -- the kinds of check ---------------------------------------------------------------


class Check:
    """A per-field check; ``late`` ones run after the model's defaults are filled in."""

    late = False
    arg_type = str  # what argparse turns the flag's text into

    def __call__(self, cfg, name: str) -> None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Bool(Check):
    def __call__(self, cfg, name):
        if not isinstance(getattr(cfg, name), bool):
            raise UserError(f"`{name}` must be True or False, got {getattr(cfg, name)!r}")


@dataclasses.dataclass(frozen=True)
class Text(Check):
    """A non-empty string (or None when ``optional``), then ``parse(value)`` checks its format."""

    optional: bool = True
    parse: object = None

    def __call__(self, cfg, name):
        v = getattr(cfg, name)
        if v is None and self.optional:
            return
        if not isinstance(v, str) or not v:
            raise UserError(f"`{name}` must be a non-empty string{' or None' if self.optional else ''}, got {v!r}")
        if self.parse is not None:
            self.parse(v)


@dataclasses.dataclass(frozen=True)
class Integer(Check):
    """An integer >= ``minimum`` (None allowed when ``optional``); a NumPy integer becomes an int."""

    minimum: int = 0
    optional: bool = False
    arg_type = int

    def __call__(self, cfg, name):
        v = getattr(cfg, name)
        if v is None and self.optional:
            return
        setattr(cfg, name, integer(v, self.minimum, f"`{name}`"))


def integer(v, minimum: int, what: str) -> int:
    """``v`` as an int >= ``minimum``, else a ``UserError`` starting with ``what``.

    A NumPy integer is an integer too; a bool, a float (2.5, or 2.0) and a
    string ('2') are not: ``int()`` would take them silently.
    """
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise UserError(f"{what} must be an integer >= {minimum}, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class StepsOrEpoch(Check):
    """A number of steps >= 0, or ``epoch`` (None allowed: a default derived later); a flag's digits become an
    int."""

    def __call__(self, cfg, name):
        v = getattr(cfg, name)
        if v is None or v == "epoch":
            return
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0:
            setattr(cfg, name, int(v))
            return
        raise UserError(f"`{name}` must be a number of steps >= 0 or epoch, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Choice(Check):
    """One of ``choices`` (a tuple, or a function returning one: a registry filled later)."""

    choices: object = ()
    optional: bool = False

    def __call__(self, cfg, name):
        v = getattr(cfg, name)
        if v is None and self.optional:
            return
        choices = self.choices() if callable(self.choices) else self.choices
        if v not in choices:
            raise UserError(f"`{name}` {v!r} is unknown: use one of {', '.join(choices)}")


@dataclasses.dataclass(frozen=True)
class Number(Check):
    """A finite number in the interval (None allowed when ``optional``); checked once the model's defaults are
    filled in."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    late = True
    arg_type = float

    def __call__(self, cfg, name):
        v = getattr(cfg, name)
        if v is None and self.optional:
            return
        if isinstance(v, numbers.Real) and not isinstance(v, bool):
            v = float(v)  # a NumPy float is a number too
            setattr(cfg, name, v)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if ok and self.low is not None:
            ok = v > self.low if self.low_open else v >= self.low
        if ok and self.high is not None:
            ok = v < self.high if self.high_open else v <= self.high
        if not ok:
            lo = "" if self.low is None else ("(" if self.low_open else "[") + f"{self.low:g}"
            hi = "" if self.high is None else f"{self.high:g}" + (")" if self.high_open else "]")
            want = f"in {lo}, {hi}" if self.low is not None and self.high is not None else (
                f"{'>' if self.low_open else '>='} {self.low:g}")
            raise UserError(f"`{name}` must be a finite number {want}, got {v!r}")


class Free(Check):
    """Checked by hand in ``towers.config`` (a cross-setting rule, or a message of its own)."""

    def __call__(self, cfg, name):
        pass


# -- the declaration --------------------------------------------------------------------


def setting(default, help: str, *, group: str, check: Check, resume: str, type: str, metavar: str | None = None,
            shown: str | None = None, used_when=None, model_default=None, fallback=None, follows: tuple = (),
            note_when=None, gpu_only: bool = False):
    """A ``Config`` field declared with everything derived from it.

    ``type``: the annotation (a string, as ``from __future__ import annotations`` writes it);
    ``shown``: the default as the flag table writes it (else derived from ``default``);
    ``used_when(cfg)``: whether the resolved run uses the setting (a change of an unused one is silent);
    ``model_default``: None-valued until the model's (optimizer's) defaults fill it, to ``fallback``
    when neither gives one (it then ``follows`` ``optimizer`` too); ``"recipe"``: filled by the model's recipe
    (``towers.nn.models.model_recipe``), not by the optimizer's defaults (it then ``follows`` ``recipe``);
    ``follows``: the settings it is derived from when not given: on a resume that gives one of them
    another value, it is derived again instead of taken from the checkpoint (``inherited``);
    ``note_when(cfg)``: a change that ``resume`` calls silent is a note in the runs where it holds;
    ``gpu_only``: it changes only what GPU towers do (CPU towers run as without it: a notice says so, and
    a resume on CPU towers takes its change silently).
    """
    if resume not in RULES:
        raise ValueError(f"resume rule {resume!r}: use one of {RULES}")
    if group not in GROUPS:
        raise ValueError(f"group {group!r}: use one of {tuple(GROUPS)} (a new group is declared in GROUPS)")
    source = "recipe" if model_default == "recipe" else "optimizer"
    follows = tuple(follows) + ((source,) if model_default and source not in follows else ())
    meta = dict(help=" ".join(help.split()), group=group, check=check, resume=resume, type=type,
                metavar=metavar, shown=shown, used_when=used_when, model_default=bool(model_default),
                fallback=fallback, follows=follows, note_when=note_when, gpu_only=gpu_only)
    return dataclasses.field(default=default, metadata=meta)


def hyperparameter(default: float, help: str, *, check: Check, metavar: str | None = None, shown: str | None = None):
    """An optimizer's numeric hyperparameter, declared in its file (``towers.optim.optimizers``).

    Unset (None) until the config is resolved; then the optimizers that read it get the model's value
    or ``default``, and the others leave it unset.  So whether it was given is known to ``Config``
    itself, not from its value: one given to an optimizer that does not read it is refused even at its
    default (``optimizer`` sgd with ``beta1`` 0.9), by flag and in Python alike, and a resolved config
    (a cluster's hosts resolve theirs again) holds none given.  ``check`` must allow None (``optional``).
    """
    return setting(None, help, group="optimization", check=check, resume=NOTE, type="float | None", metavar=metavar,
                   shown=shown if shown is not None else f"{default:g}", model_default=True, fallback=default)


def switch(help: str, *, group: str, resume: str, on: bool = False, follows: tuple = (), gpu_only: bool = False):
    """A True/False setting (a flag without a value; ``--no-NAME`` when ``on`` by default)."""
    return setting(on, help, group=group, check=Bool(), resume=resume, type="bool", follows=follows,
                   gpu_only=gpu_only)


def gpu_only_set(cfg) -> list[str]:
    """The ``gpu_only`` settings ``cfg`` sets away from their defaults, as a message names them."""
    return [f"`{f.name}`" if f.metadata["type"] == "bool" else f"`{f.name}` {getattr(cfg, f.name)}"
            for f in dataclasses.fields(cfg) if f.metadata["gpu_only"] and getattr(cfg, f.name) != f.default]


def with_settings(extra: dict, after: str):
    """Class decorator (under ``@dataclass``): add the fields ``extra`` ({name: setting(...)}) after ``after``.

    How the optimizers' hyperparameters, declared in their own files, become ``Config`` fields.
    """
    def add(cls):
        annotations = {}
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():
            annotations[name] = annotation
            if name == after:
                for extra_name, f in extra.items():
                    if extra_name in cls.__dict__.get("__annotations__", {}):
                        raise TypeError(f"setting {extra_name!r} is declared twice")
                    annotations[extra_name] = f.metadata["type"]
                    setattr(cls, extra_name, f)
        if after not in annotations:
            raise TypeError(f"no field {after!r} to add settings after")
        cls.__annotations__ = annotations
        return cls
    return add


def tracks_given(cls):
    """Class decorator (over ``@dataclass``): each instance records the fields its caller passed, or assigned
    once it was made (``cfg.steps = 30``), as ``given``.

    A field passed or assigned as None whose default is None counts as not given (None is "unset" there).
    """
    init, setattr_ = cls.__init__, cls.__setattr__
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}

    def counts(name, value) -> bool:
        return value is not None or defaults[name] is not None

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        passed = {**dict(zip(names, args)), **kwargs}
        self.__dict__["_given"] = frozenset(k for k, v in passed.items() if counts(k, v))

    def __setattr__(self, name, value):
        setattr_(self, name, value)
        if "_given" in self.__dict__ and name in defaults:  # not the __init__'s own
            given = self.__dict__["_given"]
            self.__dict__["_given"] = given | {name} if counts(name, value) else given - {name}

    def given(self) -> frozenset:
        return self.__dict__.get("_given", frozenset(names))

    cls.__init__, cls.__setattr__ = __init__, __setattr__
    cls.given = property(given, doc="The names of the settings its caller passed (see ``tracks_given``).")
    return cls


def check_fields(cfg, late: bool) -> None:
    """Every field's own check at the given point (early: before the defaults are filled in)."""
    for f in dataclasses.fields(cfg):
        check = f.metadata["check"]
        if check.late == late:
            check(cfg, f.name)


# -- resume -------------------------------------------------------------------------------


def resume_changes(old: dict, cfg) -> dict[str, list[tuple[str, object, object]]]:
    """{rule: [(name, old value, new value)]} of the settings ``cfg`` changes against ``old``.

    ``old``: the checkpoint's settings, every field present (see ``towers.config.checkpoint_settings``).
    A setting one of the two runs does not use (``used_when``) is left out: after a change of optimizer
    its hyperparameters were unset on one side (the change of ``optimizer`` is the note).
    """
    changes = {rule: [] for rule in RULES}
    before = types.SimpleNamespace(**old)
    for f in dataclasses.fields(cfg):
        used = f.metadata["used_when"]
        new = getattr(cfg, f.name)
        if f.name in old and old[f.name] != new and (used is None or (used(cfg) and used(before))):
            changes[resume_rule(f, cfg, before)].append((f.name, old[f.name], new))
    return changes


def resume_rule(f: dataclasses.Field, cfg, before) -> str:
    """What a change of the setting ``f`` from the run ``before`` to ``cfg`` does: its declared rule, or a note
    where ``note_when`` holds for either run."""
    when = f.metadata["note_when"]
    return NOTE if when is not None and (when(cfg) or when(before)) else f.metadata["resume"]


def note_reasons(old: dict, cfg, names) -> list[str]:
    """Why the changes of the settings ``names`` are notes where their rule alone is silent (``note_when``'s
    words), for the resume's note."""
    before = types.SimpleNamespace(**old)
    out = []
    for f in dataclasses.fields(cfg):
        when = f.metadata["note_when"]
        if f.name in names and when is not None:
            why = when(cfg) or when(before)
            if why and why not in out:
                out.append(why)
    return out


def inherited(cls, old: dict, cfg, given) -> dict:
    """{name: the checkpoint's value} of the settings a resumed run takes from its checkpoint.

    ``old``: the checkpoint's settings, every field present; ``cfg``: the run's (not resolved);
    ``given``: the names it gave explicitly, which it keeps.  Every other setting is the checkpoint's,
    except one that ``follows`` a setting given with another value than the checkpoint's: the
    resolution derives it afresh, as in a fresh run (``optimizer`` adam given on a run of sgd gets
    adam's learning rate, not sgd's).  Only those: a setting derived again moves none in turn (``lr``
    given moves ``lr_values``, which does not move ``lr_schedule``: the schedule stays the run's).
    """
    moved = {name for name in given if name in old and old[name] != getattr(cfg, name)}
    return {f.name: old[f.name] for f in dataclasses.fields(cls)
            if f.name not in given and f.name in old and not moved.intersection(f.metadata["follows"])}


def used_settings(saved: dict, cls, rule: str) -> list[tuple[str, object]]:
    """(name, value) of the settings of resume rule ``rule`` that a run of the settings ``saved`` uses
    (``used_when``; a setting ``saved`` lacks counts at its default): what a message about that run may cite.
    ``saved`` is a plain dict (a checkpoint's), not resolved: a user's model module is not imported."""
    values = {f.name: saved.get(f.name, f.default) for f in dataclasses.fields(cls)}
    run = types.SimpleNamespace(**values)
    return [(f.name, values[f.name]) for f in dataclasses.fields(cls) if f.metadata["resume"] == rule
            and (f.metadata["used_when"] is None or f.metadata["used_when"](run))]


def show(value) -> str:
    """A setting's value in a message: as given, ``unset`` for None."""
    return "unset" if value is None else str(value)


# -- documentation ----------------------------------------------------------------------


def flag_name(f: dataclasses.Field) -> str:
    """The flag as the command line spells it: ``--name``, or ``--no-name`` for a setting on by default."""
    dashed = f.name.replace("_", "-")
    return f"--no-{dashed}" if f.metadata["type"] == "bool" and f.default else f"--{dashed}"


def metavar(f: dataclasses.Field) -> str | None:
    return None if f.metadata["type"] == "bool" else (f.metadata["metavar"] or f.name.upper())


def shown_default(f: dataclasses.Field) -> str:
    if f.metadata["shown"] is not None:
        return f.metadata["shown"]
    if f.metadata["type"] == "bool":
        return "off"  # the flag's state: a setting on by default has a --no- flag
    if f.default is None:
        return "none"
    return f"`{f.default}`" if isinstance(f.default, str) else f"{f.default:g}" if isinstance(
        f.default, float) else str(f.default)


def help_text(f: dataclasses.Field) -> str:
    """The flag's ``--help`` text: its help, and its default (``shown_default``) where the help does not say it;
    a switch's default is its flag's absence."""
    text = f.metadata["help"]
    if f.metadata["type"] == "bool" or "default" in text:
        return text
    return f"{text} (default: {shown_default(f)})"


def flag_table(cls) -> str:
    """The table of command-line flags of docs/cli.md, generated from the declarations."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        mv = metavar(f)
        text = f.metadata["help"].replace("|", "\\|")
        flag = f"{flag_name(f)}{' ' + mv if mv else ''}".replace("|", "\\|")
        rows.append(f"| `{flag}` | {shown_default(f)} | {text} |")
    return "\n".join(rows)
