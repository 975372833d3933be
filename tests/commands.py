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
output goes to pipes of the test process's own (passed over a Unix socket),
read as ``subprocess.run(capture_output=True, text=True)`` reads them: until
every process holding them has closed them, the command's own children (input
workers, multiprocessing's resource tracker and its warnings) too; a signal's
death is ``-signum``.  ``result.forked`` says which way a command ran.

What the child shares with its zygote is what a fresh process would have made
the same way: the modules ``import towers`` imports and their state after
import; its environment is the command's.  It shares one more thing, the
string hash seed: two forked commands iterate a set of strings in the same
order, where two new interpreters might not (the CLI-against-API comparisons
run their API side in the test process, which has its own seed).  A command whose environment differs
from the test process's in what is read at import (``_READ_AT_IMPORT``:
another ``PYTHONPATH``, BLAS threads, ...) or that runs in another folder runs
as a plain subprocess, and so do a test's own ``python -c`` scripts: a test of
the start itself (what a command imports) starts a new interpreter.  When the
test process's own environment changes there, a new zygote is made.
"""
from __future__ import annotations

import atexit
import json
import locale
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The zygote: reads one request at a time from the socket on fd SOCK, with the write ends of the command's stdout
# and stderr pipes attached, forks, reports the child's pid and then its status.  The child never returns into
# the loop: the SystemExit it ends with (or its exception) ends the interpreter.
_ZYGOTE = r"""
import json, os, socket, sys, types
import towers  # noqa: F401 - what every command imports first

conn = socket.socket(fileno=int(sys.argv[1]))
requests = conn.makefile("rb")


def _child(request, out, err):
    requests.close()
    conn.close()
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, source in ((0, null), (1, out), (2, err)):
        os.dup2(source, fd)
        os.close(source)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # python -m: the folder it started in
    sys.argv[:] = ["-m", *request["args"]]
    sys.modules["__main__"] = types.ModuleType("__main__")  # the command's namespace, not the zygote's
    import runpy
    runpy._run_module_as_main(request["module"], alter_argv=True)
    sys.exit(0)


while True:
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
    if not msg:
        break  # the test process is done
    request = json.loads(msg)
    pid = os.fork()
    if pid == 0:
        _child(request, *fds)
    for fd in fds:
        os.close(fd)
    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall((json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
"""


class _Zygote:
    """One zygote process and the socket to it; used by one command at a time."""

    def __init__(self, env: dict, cwd: str):
        self.env = env
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, str(theirs.fileno())], cwd=cwd, env=env,
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.lock = threading.Lock()

    def run(self, module: str, args: list[str], env: dict, timeout: float | None) -> subprocess.CompletedProcess:
        """The command's result, as ``subprocess.run`` gives it: its output is read until every process that
        holds it (the command's own children too) has closed it."""
        cmd = [sys.executable, "-m", module, *args]
        (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
        try:
            request = json.dumps({"module": module, "args": args, "env": env}).encode()
            socket.send_fds(self.sock, [request], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        output = {out_r: bytearray(), err_r: bytearray()}
        try:
            status = self._wait(cmd, output, timeout)
        finally:
            for fd in output:
                os.close(fd)
        return subprocess.CompletedProcess(cmd, status, _text(output[out_r]), _text(output[err_r]))

    def _wait(self, cmd: list[str], output: dict, timeout: float | None) -> int:
        """Read the command's output (``output``: its two pipes' read ends and what came) and the zygote's
        replies until both pipes are closed and the status came; the status."""
        (out_r, _), (err_r, _) = output.items()
        replies = bytearray()
        deadline = None if timeout is None else time.monotonic() + timeout
        pid = status = None
        with selectors.DefaultSelector() as sel:
            for fd in (out_r, err_r, self.sock):
                sel.register(fd, selectors.EVENT_READ)
            while len(sel.get_map()) > 1 or status is None:
                wait = None if deadline is None else deadline - time.monotonic()
                ready = sel.select(wait) if wait is None or wait > 0 else []
                if not ready:  # past the timeout: as subprocess.run does, kill it and say so
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(cmd, timeout, _text(output[out_r]), _text(output[err_r]))
                for key, _ in ready:
                    chunk = os.read(key.fd, 65536)
                    if key.fd == self.sock.fileno():
                        if not chunk:
                            raise RuntimeError("the command zygote died (tests/commands.py)")
                        replies += chunk
                        *lines, rest = replies.split(b"\n")
                        replies = bytearray(rest)
                        for line in lines:
                            reply = json.loads(line)
                            pid, status = reply.get("pid", pid), reply.get("status", status)
                    elif chunk:
                        output[key.fd] += chunk
                    else:
                        sel.unregister(key.fd)
        return status

    def close(self) -> None:
        self.sock.close()  # the zygote's loop ends at the end of its input
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _text(data: bytes) -> str:
    """Bytes as ``text=True`` decodes a pipe: the locale's encoding, universal newlines."""
    return bytes(data).decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


_ZYGOTES: dict = {}
_ZYGOTES_LOCK = threading.Lock()
# The variables read while ``import towers`` runs (Python's, NumPy's and its OpenBLAS's, tqdm's, towers' own):
# a command whose values of these differ from the zygote's runs as a plain subprocess.  The others reach the
# child as they are (set in it before the command starts): libraries set some in the test process as they go
# (threadpoolctl sets KMP_DUPLICATE_LIB_OK), and pytest names each test in one.
_READ_AT_IMPORT = ("PYTHON", "LANG", "LC_", "OPENBLAS", "GOTO", "OMP_", "MKL_", "NPY_", "NUMPY_", "TQDM_", "LD_",
                   "TOWERS_")


def _same(a: dict, b: dict) -> bool:
    def imported(env):
        return {k: v for k, v in env.items() if k.startswith(_READ_AT_IMPORT)}

    return imported(a) == imported(b)


def _zygote(env: dict, cwd: str) -> _Zygote | None:
    """This process's zygote, for a command in the checkout with this process's environment; None for any other
    (a plain subprocess).  A zygote is made at the first such command, and again when this process's environment
    has changed in what is read at import since (a library the tests import may set such a variable) or the
    zygote died: a command always runs in the environment it was given."""
    if cwd != str(REPO):
        return None
    current = dict(os.environ, PYTHONUNBUFFERED=os.environ.get("PYTHONUNBUFFERED", "1"))
    if not _same(env, current):
        return None
    with _ZYGOTES_LOCK:
        old = _ZYGOTES.get("one")
        if old is not None and (not _same(old.env, env) or old.proc.poll() is not None):
            if not old.lock.acquire(blocking=False):
                return None  # still running another thread's command
            del _ZYGOTES["one"]
            old.close()
            old.lock.release()
        if "one" not in _ZYGOTES:
            _ZYGOTES["one"] = _Zygote(env, cwd)
            atexit.register(_ZYGOTES["one"].close)
        return _ZYGOTES["one"]


def run(module: str, *args, cwd=REPO, env: dict | None = None,
        timeout: float | None = 120) -> subprocess.CompletedProcess:
    """``python -m module args`` in ``cwd`` (the checkout), its output captured as text: a
    ``subprocess.CompletedProcess``; ``subprocess.TimeoutExpired`` past ``timeout``."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    env.setdefault("PYTHONUNBUFFERED", "1")  # output reaches the pipes as it is written, a crash loses none
    z = _zygote(env, str(cwd)) if hasattr(os, "fork") else None
    if z is not None and z.lock.acquire(blocking=False):  # a second command at once: a subprocess
        try:
            result = z.run(module, args, env, timeout)
        except BaseException:  # a timeout, an interrupt: its replies are out of step now, a new one starts next
            with _ZYGOTES_LOCK:
                _ZYGOTES.pop("one", None)
            z.proc.kill()
            z.close()
            raise
        finally:
            z.lock.release()
        result.forked = True
        return result
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)
    result.forked = False
    return result
