"""numba's side of the compiled CPU forms: the import, the compile, the disk cache, the kernels to warm up.

Each op module declares its compiled form as a plain Python loop, wrapped by
``kernel(fn, warm)`` (a hand-written loop: a window op, batch norm) or made
from its definition's source by ``from_source`` (an elementwise op,
``towers.ops.codegen.numba_form``).  Nothing here imports numba until a kernel is
first compiled (``towers.ops.forms`` decides whether one ever is): a run
that keeps NumPy's passes never pays numba's start (about 0.75 s: its import,
then LLVM's).

Compile and cache: numba compiles a kernel per signature on its first call
(about a second a kernel, once per machine) and caches the machine code on
disk beside the kernel's source file (or in ``NUMBA_CACHE_DIR``), so later
runs load it: per kernel an index (``<kernel>-<line>.pyXY.nbi``: numba's
version, then a pickle of the source's stamp and the data file of each
signature) and data files (``.nbc``, pickles of the object code), in
``__pycache__`` (or ``NUMBA_CACHE_DIR`` followed by the folder's path).  A
generated source is written once to a file named by its hash
(``numba_forms/`` in this package's ``__pycache__``, or in ``NUMBA_CACHE_DIR``
or the user's cache folder where that is read-only) and imported from there:
numba caches only functions that have a source file, and it stamps the cache
with the file's modification time, which a file written once keeps.

numba writes its cache atomically, but a file damaged afterwards (a disk
error, a copy cut short) makes numba raise at the first call of its kernel
(``UnpicklingError``, ``EOFError``, ...) in every run.  A cache is a cache:
where a call of a cached kernel raises before its dispatcher holds machine
code (the load failed; once it holds code, an error is the kernel's own and
goes up at once: a second run would start from half-written buffers), the
kernel's index and data files are
removed from its cache folder (``dispatcher.stats.cache_path``; numba names
them ``<source file's stem>.<qualified name>-<line>.pyXY.nbi`` and ``.<n>.nbc``,
the qualified name without ``<`` and ``>``; another Python's files are left)
and the call is made again through a new dispatcher, which compiles the
kernel and caches it anew; where that call succeeds, the cache was at fault
and a notice names the folder (once a folder and process); where it raises
too, the error is the kernel's own and goes up.  Where numba finds no writable place for its
cache at all, kernels are compiled in every run, with a notice.

The kernels release the GIL (``nogil``), so CPU tower threads run them at once.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import threading

from towers.errors import notice

_LOCK = threading.RLock()
_STATE: dict = {}  # "numba": the module or the ImportError; "cache": whether disk caching works
_ALL: list = []  # every NumbaKernel made
_WARM: list = []  # what warm_up calls: each kernel's (and each op's, for its loop made on demand) warm-up
_DAMAGED: set = set()  # cache folders whose damage was noticed (one notice a folder and process)


def numba_module():
    """numba, imported once (raises the ImportError of a missing or broken numba, every call)."""
    with _LOCK:
        if "numba" not in _STATE:
            try:
                import numba

                _STATE["numba"] = numba
            except ImportError as e:
                _STATE["numba"] = e
    found = _STATE["numba"]
    if isinstance(found, ImportError):
        raise found
    return found


class NumbaKernel:
    """A plain Python loop and, once compiled, its numba dispatcher; ``warm()`` gives it arguments that load
    (or compile) its machine code for float32 now, not in a timed step."""

    def __init__(self, fn, warm=None):
        self.py_func, self._warm, self._dispatcher = fn, warm, None
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__
        with _LOCK:
            _ALL.append(self)

    @property
    def warmed_up(self) -> bool:
        """Whether ``warm_up`` has arguments for it."""
        return self._warm is not None

    def __call__(self, *args):
        d = self._dispatcher
        if d is None:
            d = self.compiled()
        try:
            return d(*args)
        except MemoryError:
            raise
        except Exception as e:  # whatever a damaged pickle or object code raises, or the kernel's own error
            # A dispatcher that holds machine code loaded it: the error is the kernel's own (running it again
            # would start from buffers it has half written); only a load that failed is the cache's doing.
            if not _STATE.get("cache", True) or d.signatures:
                raise
            return self._compiled_again(d, e, args)

    def _compiled_again(self, failed, error, args):
        """The call of a fresh dispatcher after the kernel's cache files are removed (module doc)."""
        folder = failed.stats.cache_path
        fn = self.py_func
        stem = os.path.splitext(os.path.basename(fn.__code__.co_filename))[0]
        qualname = fn.__qualname__.replace("<", "").replace(">", "")  # as numba names it: no <locals>' brackets
        v = sys.version_info
        prefix = f"{stem}.{qualname}-{fn.__code__.co_firstlineno}.py{v[0]}{v[1]}{getattr(sys, 'abiflags', '')}."
        with _LOCK:
            with contextlib.suppress(OSError):
                for name in os.listdir(folder):
                    if name.startswith(prefix) and name.endswith((".nbi", ".nbc")):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(folder, name))
            fresh = _jit(fn)
            result = fresh(*args)  # raises the kernel's own error: the cache was not at fault
            self._dispatcher = fresh
            if folder not in _DAMAGED:
                _DAMAGED.add(folder)
                notice(f"CPU kernels: numba's cache in {folder} does not load "
                       f"({fn.__name__}: {type(error).__name__}: {error}); compiling the kernels again "
                       "(a second or two) and caching them anew")
        return result

    def compiled(self):
        """The numba dispatcher (made on the first call)."""
        with _LOCK:
            if self._dispatcher is None:
                self._dispatcher = _jit(self.py_func)
        return self._dispatcher

    def warm(self) -> None:
        if self._warm is not None:
            self(*self._warm())


def kernel(warm=None):
    """Decorator: the loop below as a compiled CPU kernel; ``warm()`` returns tiny float32 arguments for it
    (``warm_up`` calls it with them)."""
    def wrap(fn):
        k = NumbaKernel(fn, warm)
        on_warm_up(k.warm)
        return k

    return wrap


def from_source(source: str, name: str, warm=None) -> NumbaKernel:
    """The function ``name`` of the generated ``source`` (``import numpy`` is prepended) as a ``NumbaKernel``."""
    text = "import numpy\n\n\n" + source
    folder = _forms_folder()
    if folder is None:
        scope: dict = {}
        exec(compile(text, f"<{name}>", "exec"), scope)
        return NumbaKernel(scope[name], warm)
    path = os.path.join(folder, f"{name}_{hashlib.sha1(text.encode()).hexdigest()[:16]}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # written once: numba's cache is stamped with the file's time
    # A module of its own, in sys.modules: numba's cached code names the function's module, and a new
    # process finds it there when it loads the code (the module is made before the kernel's first call).
    module_name = "towers_numba_form_" + os.path.basename(path)[:-3]
    with _LOCK:
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    return NumbaKernel(getattr(module, name), warm)


def _forms_folder():
    """A writable folder for generated sources, or None (then they are compiled in memory, without a cache)."""
    with _LOCK:
        if "forms" not in _STATE:
            here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__", "numba_forms")
            candidates = [here]
            if os.environ.get("NUMBA_CACHE_DIR"):
                candidates.append(os.path.join(os.environ["NUMBA_CACHE_DIR"], "towers_numba_forms"))
            candidates.append(os.path.join(os.path.expanduser("~"), ".cache", "towers", "numba_forms"))
            _STATE["forms"] = None
            for folder in candidates:
                try:
                    os.makedirs(folder, exist_ok=True)
                    probe = os.path.join(folder, f".probe-{os.getpid()}")
                    with open(probe, "w"):
                        pass
                    os.unlink(probe)
                except OSError:
                    continue
                _STATE["forms"] = folder
                break
    return _STATE["forms"]


def on_warm_up(fn) -> None:
    """Have ``warm_up`` call ``fn`` (which loads a kernel's machine code)."""
    with _LOCK:
        _WARM.append(fn)


def kernels() -> list:
    """Every ``NumbaKernel`` made so far (hand-written ones at import; an op's when its loop is first needed)."""
    return list(_ALL)


def warm_up() -> None:
    """Load (or compile) every kernel declared so far, for float32."""
    for fn in list(_WARM):
        fn()


def _jit(fn):
    """``fn`` as a numba dispatcher, cached on disk where numba can (module doc)."""
    numba = numba_module()
    if _STATE.get("cache", True):
        try:
            return numba.njit(nogil=True, cache=True, error_model="numpy")(fn)
        except RuntimeError as e:  # numba found no writable place for its cache
            _STATE["cache"] = False
            notice(f"CPU kernels: numba cannot cache them ({e}); they are compiled at every start "
                   "(about a second each): set NUMBA_CACHE_DIR to a writable folder")
    return numba.njit(nogil=True, cache=False, error_model="numpy")(fn)

