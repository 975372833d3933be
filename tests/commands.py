"""The project's command lines as the tests run them: ``python -m MODULE ARGS`` in a process of its own.

A fresh interpreter spends about 0.45 s of CPU before the command's first line
(Python's start, NumPy, towers), and the suite runs some 200 commands.  So a
command is forked from a zygote instead: one process per test process, started
at the first command, that has imported ``towers`` and nothing more and then
waits.  For each command it forks a child, which runs the module as ``python
-m`` does (``runpy._run_module_as_main``: ``__main__`` is the module, with its
spec; ``sys.argv[0]`` its file; ``sys.path[0]`` the folder) and exits through
the interpreter's own exit (atexit handlers, non-daemon threads joined, an
uncaught exception's traceback and status 1, ``SystemExit``'s status).  Its
output goes to files, read back as ``subprocess.run(capture_output=True,
text=True)`` gives it; a signal's death is ``-signum``.

What the child shares with its zygote is what a fresh process would have made
the same way: the modules ``import towers`` imports and their state after
import; its environment is the command's.  A command whose environment differs
from the zygote's in what is read at import (``_READ_AT_IMPORT``: another
``PYTHONPATH``, BLAS threads, ...) or that runs in another folder runs as a
plain subprocess, and so do a test's own ``python -c`` scripts: a test of the
start itself (what a command imports) starts a new interpreter.
"""
from __future__ import annotations

import atexit
import json
import locale
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The zygote: reads one request a line from fd REQ, forks, reports the child's pid and then its status on fd REP.
# The child never returns into the loop: the SystemExit it ends with (or its exception) ends the interpreter.
_ZYGOTE = r"""
import json, os, sys
import towers  # noqa: F401 - what every command imports first

req_fd, rep_fd = int(sys.argv[1]), int(sys.argv[2])
requests = os.fdopen(req_fd, "r")


def _child(request):
    os.close(rep_fd)
    requests.close()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                            (2, request["stderr"], os.O_WRONLY)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # python -m: the folder it started in
    sys.argv[:] = ["-m", *request["args"]]
    import runpy
    runpy._run_module_as_main(request["module"], alter_argv=True)
    sys.exit(0)


for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        _child(request)
    os.write(rep_fd, (json.dumps({"pid": pid}) + "\n").encode())
    _, status = os.waitpid(pid, 0)
    os.write(rep_fd, (json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
"""


class _Zygote:
    """One zygote process and the two pipes to it; used by one command at a time."""

    def __init__(self, env: dict, cwd: str):
        self.env, self.cwd = env, cwd
        req_r, self._req = os.pipe()
        self._rep, rep_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, str(req_r), str(rep_w)], cwd=cwd, env=env,
                                     pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL)
        os.close(req_r)
        os.close(rep_w)
        self.lock = threading.Lock()
        self._pending = b""

    def _reply(self, deadline: float | None) -> dict | None:
        """The zygote's next line, or None at the deadline (``time.monotonic``) or when it is gone."""
        import time

        while b"\n" not in self._pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._rep], [], [], wait)[0]:
                return None
            chunk = os.read(self._rep, 4096)
            if not chunk:
                return None
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, module: str, args: list[str], env: dict, timeout: float | None) -> subprocess.CompletedProcess:
        import time

        with tempfile.TemporaryDirectory(prefix="towers-command-") as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            for path in (out, err):
                open(path, "wb").close()
            request = {"module": module, "args": args, "env": env, "stdout": out, "stderr": err}
            os.write(self._req, (json.dumps(request) + "\n").encode())
            started = self._reply(None)
            if started is None:
                raise RuntimeError("the command zygote died (tests/commands.py)")
            deadline = None if timeout is None else time.monotonic() + timeout
            done = self._reply(deadline)
            if done is None:  # past the timeout: as subprocess.run does, kill it and say so
                os.kill(started["pid"], signal.SIGKILL)
                self._reply(None)
                raise subprocess.TimeoutExpired([sys.executable, "-m", module, *args], timeout,
                                                _read(out), _read(err))
            return subprocess.CompletedProcess([sys.executable, "-m", module, *args], done["status"],
                                               _read(out), _read(err))

    def close(self) -> None:
        os.close(self._req)  # the zygote's loop ends at the end of its input
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._rep)


def _read(path: str) -> str:
    """A file's bytes as ``text=True`` decodes a pipe: the locale's encoding, universal newlines."""
    with open(path, "rb") as f:
        data = f.read()
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


_ZYGOTES: dict = {}
_ZYGOTES_LOCK = threading.Lock()
# The variables read while ``import towers`` runs (Python's, NumPy's and its OpenBLAS's, tqdm's, towers' own):
# a command whose values of these differ from the zygote's runs as a plain subprocess.  The others reach the
# child as they are (set in it before the command starts): libraries set some in the test process as they go
# (threadpoolctl sets KMP_DUPLICATE_LIB_OK), and pytest names each test in one.
_READ_AT_IMPORT = ("PYTHON", "OPENBLAS", "GOTO", "OMP_", "MKL_", "NPY_", "NUMPY_", "TQDM_", "LD_", "TOWERS_")


def _same(a: dict, b: dict) -> bool:
    def imported(env):
        return {k: v for k, v in env.items() if k.startswith(_READ_AT_IMPORT)}

    return imported(a) == imported(b)


def _zygote(env: dict, cwd: str) -> _Zygote | None:
    """This process's zygote, for a command in the checkout with this process's environment (made at the first
    such command); None for any other (a plain subprocess), and once the zygote is gone."""
    if cwd != str(REPO):
        return None
    with _ZYGOTES_LOCK:
        if "one" not in _ZYGOTES:
            if not _same(env, dict(os.environ, PYTHONUNBUFFERED=os.environ.get("PYTHONUNBUFFERED", "1"))):
                return None
            _ZYGOTES["one"] = _Zygote(env, cwd)
            atexit.register(_ZYGOTES["one"].close)
        z = _ZYGOTES["one"]
    return z if _same(env, z.env) and z.proc.poll() is None else None


def run(module: str, *args, cwd=REPO, env: dict | None = None,
        timeout: float | None = 120) -> subprocess.CompletedProcess:
    """``python -m module args`` in ``cwd`` (the checkout), its output captured as text: a
    ``subprocess.CompletedProcess``; ``subprocess.TimeoutExpired`` past ``timeout``."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    env.setdefault("PYTHONUNBUFFERED", "1")  # the zygote's and every child's: output to files, nothing lost
    z = _zygote(env, str(cwd)) if hasattr(os, "fork") else None
    if z is not None and z.lock.acquire(blocking=False):  # a second command at once: a subprocess
        try:
            return z.run(module, args, env, timeout)
        finally:
            z.lock.release()
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
