"""Starting input worker processes: the ``spawn`` context, and the ``__main__`` guard it needs.

Input workers (image transforms, TFRecord parsing, image conversion) are
started with ``spawn``, never ``fork``: the trainer's threads must not be
forked mid-flight.  A spawned process first runs the parent's main script
again (as ``__mp_main__``, so that what the script defines can be unpickled
there), so everything outside its ``if __name__ == "__main__":`` block runs
once more in every worker.  A script that starts workers outside that block
starts them again there, which multiprocessing refuses in a process still
starting ("bootstrapping phase"), and the parent would only see its workers
die.  :func:`spawn_context` checks for this before a process starts:

- in the parent: a main script that spawn runs again (a file; not ``-c``, an
  interactive session or a package's ``__main__``, which spawn does not run)
  with no ``if __name__ == "__main__":`` test at its top level is a
  ``UserError`` saying so, before the script body can run twice; so is a
  main script without a file to run again (``python - < script.py``: spawn
  would look for a file named ``<stdin>``, and every worker would die);
- in a worker still starting (the script has a guard, but the code that
  starts workers is outside it): the worker exits at once with
  ``UNGUARDED_EXIT``, printing nothing, and the parent's pool turns that
  status into the same message (:func:`unguarded_error`).

Limits: the parent's check reads the script's source (``ast``); a script it
cannot read or parse is not checked there, and the worker's check remains.
"""
from __future__ import annotations

import ast
import functools
import multiprocessing
import os
import sys

from towers.errors import UserError

UNGUARDED_EXIT = 86  # a worker's status when it found itself starting workers while still starting


def spawn_context():
    """multiprocessing's ``spawn`` context, once the main script is known to start workers only in its guard."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # multiprocessing's own test
        os._exit(UNGUARDED_EXIT)  # noqa: SLF001 - nothing to report to here: the parent says why
    script = _rerun_script()
    if script is not None and not os.path.isfile(_as_spawn_finds(script)):
        raise UserError(f"input workers start with spawn, which runs the main script again in each worker from its "
                        f"file, but this one has none ({script}: read from standard input, or a file since "
                        "removed): save the script as a file and run that, or use no input workers "
                        "(`input_workers` 0)")
    if script is not None and not _has_guard(script):
        raise unguarded_error(script)
    return multiprocessing.get_context("spawn")


def _as_spawn_finds(script: str) -> str:
    """The main script's path as a spawned worker opens it: relative to the directory the parent started in."""
    start = multiprocessing.process.ORIGINAL_DIR
    return script if os.path.isabs(script) or start is None else os.path.join(start, script)


def unguarded_error(script: str | None = None) -> UserError:
    script = script or _rerun_script() or "the main script"
    return UserError(f"input workers start with spawn, which runs {script} again in each worker: put the code "
                     "that loads data and trains under 'if __name__ == \"__main__\":' (see the multiprocessing "
                     "documentation, 'Safe importing of main module'), or use no input workers (`input_workers` 0)")


def _rerun_script() -> str | None:
    """The file that spawn runs again in each worker (``multiprocessing.spawn.get_preparation_data``)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:  # python -m: imported again by name, except a package's __main__
        name = spec.name or ""
        return None if name == "__main__" or name.endswith(".__main__") else spec.origin
    return getattr(main, "__file__", None)


@functools.lru_cache(maxsize=8)
def _has_guard(path: str) -> bool:
    """Whether ``path``'s top level tests ``__name__`` against ``"__main__"`` (True when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return True
    for node in tree.body:
        if isinstance(node, ast.If):
            parts = list(ast.walk(node.test))
            if any(isinstance(n, ast.Name) and n.id == "__name__" for n in parts) and \
                    any(isinstance(n, ast.Constant) and n.value == "__main__" for n in parts):
                return True
    return False
