"""Shared fixtures: paths, the NCCL stand-in, the GPU marker, the library's notices, the suite's bytecode and groups."""
from __future__ import annotations

import contextlib
import logging
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
DIGITS = REPO / "data" / "digits.npz"


def _share_compiled_bytecode() -> None:
    """Under ``PYTHONDONTWRITEBYTECODE`` (set on some CI machines) every process the suite starts (about 300:
    command lines, Ray's workers, pytest-xdist's workers) compiled towers and the test modules from source again,
    0.2 s of CPU each on a fresh checkout.  The suite writes its bytecode under one folder in the system's temp
    folder instead (``PYTHONPYCACHEPREFIX``), so the checkout still gets no ``__pycache__``; it runs before
    pytest-xdist starts its workers, which inherit it with the processes they start.  A prefix already set is
    kept; a folder of that name that is not this user's own (another user could plant bytecode in it) is not
    used, and this user's is closed to others."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    prefix = os.path.join(tempfile.gettempdir(), f"towers-tests-pycache-{os.getuid()}")
    try:
        os.makedirs(prefix, mode=0o700, exist_ok=True)
        st = os.lstat(prefix)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return
    if st.st_mode & 0o077:
        os.chmod(prefix, 0o700)
    os.environ.pop("PYTHONDONTWRITEBYTECODE")
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    sys.dont_write_bytecode, sys.pycache_prefix = False, prefix


_share_compiled_bytecode()


def shared_file(*parts: str) -> Path:
    """A file under ../shared, or skip the test with the reason."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent (../shared holds test data next to the checkout)")
    return path


def cuda_count() -> int:
    from towers.devices.placement import cuda_device_count

    return cuda_device_count()


def cupy_performance_warnings_fail() -> list:
    """The mark that makes CuPy's ``PerformanceWarning`` fail a GPU test module, where CuPy is installed.

    pytest finds a warning category by importing its module when each test
    starts, skipped ones too: ``cupy._util`` without CuPy stopped the whole
    session (INTERNALERROR).  CuPy is an extra (towers[cuda12], [cuda13]).
    """
    from towers.devices.placement import cupy_installed

    return [pytest.mark.filterwarnings("error::cupy._util.PerformanceWarning")] if cupy_installed() else []


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "dry_run: a GPU test that runs on the CPU with TOWERS_TEST_GPU_AS=cpu "
                                       "(tests/gpu_compare.py)")
    config.addinivalue_line("markers", "slow: takes seconds on 2 quiet cores (most start processes): run first "
                                       "(`-m 'not slow'` leaves them out)")
    config.addinivalue_line("markers", "references: imports PyTorch or TensorFlow, seconds of CPU each: these run "
                                       "in one pytest-xdist worker, which imports each once")


def _one_worker_each(items) -> None:
    """The tests that share one thing run in one pytest-xdist worker (pytest.ini: ``-n auto --dist loadgroup``
    runs the others spread over a worker per core): those on the session's Ray (``local_ray``, started once,
    not in every worker), the GPU tests (one process at a time on the GPUs), those that import PyTorch or
    TensorFlow (``references``: each imported once), and those of a module that share one of its module-scoped
    fixtures (a trained run: made once, not once in each worker, nor again in a worker whose turn passed to
    another module in between)."""
    for item in items:
        if "local_ray" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif "gpu" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("gpu"))
        elif item.get_closest_marker("references"):
            item.add_marker(pytest.mark.xdist_group("references"))
        elif _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def _uses_a_module_fixture(item) -> bool:
    """Whether ``item`` takes a module-scoped fixture defined in its own module."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(d[-1].scope == "module" and d[-1].func.__module__ == item.module.__name__
               for d in defs.values() if d)


def _slow_first(items) -> None:
    """The tests marked ``slow`` go first: pytest-xdist hands out the groups (largest first), then the tests in
    this order, so the run ends on short tests, not on one worker finishing a long one while the others wait."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(config, items):
    _slow_first(items)
    _one_worker_each(items)
    if cuda_count() > 0:
        return
    # A dry run of the GPU tests on the CPU (tests/gpu_compare.py): those that take their device from there run.
    dry = os.environ.get("TOWERS_TEST_GPU_AS") == "cpu"
    from towers.devices.placement import cupy_installed

    why = "no CUDA device visible to CuPy" if cupy_installed() else "CuPy is not installed (towers[cuda12], [cuda13])"
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords and not (dry and "dry_run" in item.keywords):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def local_ray():
    """One quiet local Ray instance (4 logical CPUs) for every test that needs one (its start-up costs seconds),
    started as towers starts its own: without a worker per CPU made in advance (``NO_PRESTART``)."""
    ray = pytest.importorskip("ray")
    from towers.cluster.session import NO_PRESTART

    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 _system_config=NO_PRESTART)
    yield ray
    ray.shutdown()


@pytest.fixture
def notices():
    """The messages said through the ``towers`` logger during the test (``towers.errors.notice``).

    Its own handler on that logger: a command line run in this process
    (``towers.cli.show_notices``) stops the logger's propagation to the root.
    """
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("towers")
    logger.addHandler(handler)
    yield said
    logger.removeHandler(handler)


@pytest.fixture
def standin():
    from tests import nccl_standin

    nccl_standin.reset()
    yield nccl_standin
    nccl_standin.reset()


def run_cli(*args: str, module: str = "towers.train", timeout: int = 120) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` from the repository root, as a user would (``tests.commands``)."""
    from tests import commands

    return commands.run(module, *args, timeout=timeout)


@contextlib.contextmanager
def cpu_form(which: str):
    """Inside the block host arrays take the ops' NumPy passes (``"numpy"``) or numba's compiled loops
    (``"numba"``: the test skips without numba): the current forms (``towers.ops.forms``)."""
    from towers.ops import forms

    if which == "numba":
        pytest.importorskip("numba", reason="numba is not installed: the compiled CPU forms are optional")
    with forms.host(which).active():
        yield
