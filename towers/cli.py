"""What the command lines share: turning an exception into one line and an exit status, SIGTERM into an
exception, and printing the library's notices and a dataset's warnings (the library itself prints nothing).

Every entry point (``towers.train``, ``towers.eval``, the converters, the
fetcher) ends the same way: a mistake in the input is one line and status 2,
a run or a write that cannot go on (out of memory too) is one line and status 1, Ctrl-C is 130,
SIGTERM 143, and anything else is a bug and keeps its traceback.

Within ``sigterm_raises`` SIGTERM raises ``Terminated``, which unwinds like
``KeyboardInterrupt``: the library's writers clean up on any ``BaseException``
(``towers.files``: no partial output, no temporary file), and the
command line exits 143 = 128 + SIGTERM, as it exits 130 = 128 + SIGINT on
Ctrl-C.  The library never installs a signal handler: a Python program keeps
its own.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import threading

from towers.errors import TrainingError, UserError, flags_in_messages, render


# A negative number as a flag's value, exponent notation included (-1e-10, -2.5E+3, -.5; and -inf, -nan,
# which the settings' checks then name): argparse's own pattern knows only -5 and -0.5, and takes "-1e-10"
# for an unknown flag ("expected one argument").
NEGATIVE_NUMBER = re.compile(r"^-((\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|inf|infinity|nan)$", re.IGNORECASE)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (not usage + line), shared by the entry points.

    ``name``: the command's name in its error lines, the one ``run_main`` prints
    (``towers.train: error: ...``; default: ``prog``); ``prog`` stays the
    command as typed, for ``--help``'s usage line.  Negative numbers in
    exponent notation are values, not flags (``NEGATIVE_NUMBER``).
    """

    def __init__(self, *args, name: str | None = None, **kw):
        super().__init__(*args, **kw)
        self.name = name or self.prog
        self._negative_number_matcher = NEGATIVE_NUMBER  # argparse's hook for what counts as a number

    def error(self, message):
        self.exit(2, f"{self.name}: error: {message} (see --help)\n")


class Terminated(BaseException):
    """SIGTERM arrived (see :func:`sigterm_raises`); a BaseException so only cleanup code sees it."""


@contextlib.contextmanager
def sigterm_raises():
    """While active (main thread only), SIGTERM raises :class:`Terminated` once.

    A second SIGTERM during the cleanup is ignored so that it cannot cut the
    cleanup short; SIGKILL stays the hard stop.  A SIGTERM the parent set to
    be ignored stays ignored.  The previous handler is restored on exit.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_status(exc: BaseException, more: dict | None = None) -> tuple[int, str] | None:
    """(status, message) for an exception a user can cause, or None (a bug: let it raise).

    ``more`` maps a tool's own exception types to their status.  A signal's exception (Ctrl-C's
    ``KeyboardInterrupt``, SIGTERM's ``Terminated``) raised while C code checks for signals may come out
    wrapped, as a ``SystemError`` caused by it (Ray's ``wait``, seen in a SIGTERM test): it is that signal's.
    """
    cause = exc.__cause__
    if isinstance(exc, SystemError) and isinstance(cause, (KeyboardInterrupt, Terminated)):
        return exit_status(cause, more)
    for kind, status in (more or {}).items():
        if isinstance(exc, kind):  # (its `settings` as flags too: a tool's own types need not be UserErrors)
            return status, render(f"error: {exc}")
    if isinstance(exc, UserError):
        return 2, f"error: {exc}"
    if isinstance(exc, (TrainingError,)):
        return 1, f"error: {exc}"
    if isinstance(exc, OSError):  # a file touched outside the writers that name it
        return 1, f"error: {exc.filename or ''}: {exc.strerror or exc}; check the path, its permissions and free space"
    if isinstance(exc, MemoryError):  # NumPy's and CuPy's out-of-memory errors both derive from it
        return 1, (f"error: out of memory ({str(exc) or type(exc).__name__}): free memory or raise this process's "
                   "limit (ulimit -v), or use smaller batches or data")
    if isinstance(exc, KeyboardInterrupt):
        return 130, "interrupted"
    if isinstance(exc, Terminated):
        return 143, "terminated (SIGTERM)"
    return None


def current_folder_importable() -> None:
    """Put the current folder first on ``sys.path``, as ``python -m`` does (idempotent).

    An installed command (``towers-train``, a console script) starts with its own folder
    (``.../bin``) first on ``sys.path``, where ``python -m towers.train`` has the current
    folder: ``--model mypkg.nets:small`` then imported ``mypkg`` beside the user only with
    ``python -m``.  Every command line calls this, so both find the same modules.
    """
    try:
        here = os.getcwd()
    except OSError:  # the current folder was removed: nothing to find there
        return
    if not any(os.path.abspath(entry or ".") == here for entry in sys.path):
        sys.path.insert(0, here)


def run_main(prog: str, body, more: dict | None = None, interrupted: str | None = None,
             terminated: str | None = None) -> int:
    """Call ``body()``; print a user-caused exception as ``prog: message`` on stderr; return the status.

    ``interrupted``/``terminated`` replace the Ctrl-C / SIGTERM lines (say what
    was kept, for instance).  Within it, messages name settings as flags
    (``towers.errors.flags_in_messages``): every command line does; modules
    are found in the current folder as with ``python -m`` (``current_folder_importable``).
    """
    current_folder_importable()
    with flags_in_messages():
        return _run(prog, body, more, interrupted, terminated)


def _run(prog, body, more, interrupted, terminated) -> int:
    try:
        return body() or 0
    except BaseException as exc:
        found = exit_status(exc, more)
        if found is None:
            raise
        status, line = found
        if status == 130 and interrupted is not None:
            line = interrupted
        elif status == 143 and terminated is not None:
            line = terminated
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
        return status


def run_writer(prog: str, write, report=None, more: dict | None = None) -> int:
    """:func:`run_main` for a command that writes its output atomically (the converters).

    ``write()`` runs with SIGTERM raising, so the writers clean up as on Ctrl-C,
    and both say that no output was written; ``report(result)`` then says what
    was written, outside that window.
    """
    def body():
        with sigterm_raises():
            done = write()
        if report is not None:
            report(done)

    return run_main(prog, body, more, interrupted="interrupted: no output written",
                    terminated="terminated (SIGTERM): no output written")


def say_as(prog: str):
    """A ``say(message)`` that prints ``prog: message`` on stderr: what a command passes to the library's
    ``say`` parameters (whose default is the ``towers`` logger)."""
    def say(message: str) -> None:
        print(f"{prog}: {message}", file=sys.stderr)
    return say


def show_notices() -> None:
    """The library's notices (the ``towers`` logger: soft placement, an index being built, ...) as plain
    lines on stderr (idempotent)."""
    log = logging.getLogger("towers")
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        log.addHandler(_Stderr())
        log.propagate = False


class _Stderr(logging.Handler):
    """Each record's message (rendered when said, ``towers.errors.notice``) on the *current* ``sys.stderr``.

    Not a ``StreamHandler``, which keeps the stream it was made with: a caller
    that swaps ``sys.stderr`` later (a test's capture, a redirect) would miss
    the lines.
    """

    def emit(self, record) -> None:
        try:
            print(record.getMessage(), file=sys.stderr, flush=True)
        except Exception:  # logging's rule: a failed notice never stops the program
            self.handleError(record)


def warn(prog: str, line: str) -> None:
    """``prog: warning: line`` on stderr, its `settings` shown as flags."""
    print(f"{prog}: warning: {render(line)}", file=sys.stderr, flush=True)


def warn_about(dataset, prog: str) -> None:
    """Print the dataset's warnings (labels that train but say little) on stderr, one line each."""
    for line in dataset.warnings:
        warn(prog, line)
