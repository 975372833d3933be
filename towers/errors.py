"""The two kinds of error towers raises on purpose, and how messages name settings.

Messages name settings in backticks, `sync`, the name of the ``towers.Config``
field.  For Python users they show the bare name (``sync``); within a command
line's ``flags_in_messages()`` they show the flag (``--sync``) instead: this is
the one place where settings become flags.  Notes a run prints go through
``render`` too; ``progress_bar`` is the other thing a library call shows the user on stderr.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys

_SETTING = re.compile(r"`([a-z][a-z0-9_]*)`")
# Settings a message names otherwise: soft placement is on by default, so the
# messages that name it ask to turn it back on.
_FLAGS = {"soft_placement": "drop --no-soft-placement"}
_NAMES = {"soft_placement": "soft_placement=True"}
_as_flags = False


def flag(setting: str) -> str:
    """The command-line flag of a ``Config`` field (as messages name it)."""
    return _FLAGS.get(setting, "--" + setting.replace("_", "-"))


@contextlib.contextmanager
def flags_in_messages():
    """Within it, messages name settings as command-line flags (the entry points' ``main``)."""
    global _as_flags
    before, _as_flags = _as_flags, True
    try:
        yield
    finally:
        _as_flags = before


def render(text: str) -> str:
    """A message with its `settings` shown as names, or as flags inside ``flags_in_messages()``."""
    return _SETTING.sub(lambda m: flag(m.group(1)) if _as_flags else _NAMES.get(m.group(1), m.group(1)), text)


def notice(text: str, level: int = logging.WARNING) -> None:
    """Say ``text`` to the user through the ``towers`` logger, its `settings` rendered now (within a command
    line's ``flags_in_messages()``: as flags).  The command lines print these (``towers.cli.show_notices``);
    a Python program sees them through ``logging``."""
    logging.getLogger("towers").log(level, render(text))


def info(text: str) -> None:
    """:func:`notice` at INFO: what a library call says on the way (the converters' and the fetcher's default
    ``say``; their command lines print these lines themselves)."""
    notice(text, logging.INFO)


def progress_bar(shown: bool, **kw):
    """The one kind of progress bar (training steps, the decoded-image cache, the converters): tqdm on
    stderr, drawn only when ``shown`` and stderr is a terminal, so a redirected stderr (a log file, a
    pipe) gets no bar; ``kw`` are tqdm's (``total``, ``unit``, ``desc``, ...)."""
    from tqdm import tqdm

    return tqdm(file=sys.stderr, dynamic_ncols=True, disable=not (shown and sys.stderr.isatty()), **kw)


class _Message(Exception):
    def __str__(self) -> str:
        return render(super().__str__())


class UserError(_Message, ValueError):
    """A mistake in the user's input (settings, files, placement).

    The command-line entry points print its message as one line and exit with
    status 2; it is never shown as a traceback.
    """


class TrainingError(_Message, RuntimeError):
    """A run that cannot go on (replicas diverged, the loss is not finite, a disk failed).

    Printed as one line by the entry points, with exit status 1.
    """


class InputError(Exception):
    """The input failed while a batch was being made (a record damaged since it was indexed, an input worker
    that died); ``str()`` is the one-line report.  A batch raises it as a :class:`TrainingError`
    (``towers.data.batches.Batch``); the decoded-image cache tells the kinds apart."""
