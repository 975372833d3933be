"""A host-memory stand-in for ``cupy.cuda.nccl``, for running the real NCCL call
sequence of ``towers.parallel.allreduce`` on a machine without a GPU.

It has the same names and call signatures as the CuPy module
(``NcclCommunicator.initAll(devices)``, ``comm.allReduce(sendbuf, recvbuf, count,
datatype, op, stream)`` with plain ints, ``groupStart``/``groupEnd``, the
``NCCL_*`` constants with NCCL's values, ``NcclError``), and it enforces what the
real library requires of a single process driving several ranks:

* a collective outside ``groupStart()``/``groupEnd()`` with more than one rank
  raises (the real call would block forever on the first rank);
* at ``groupEnd()`` every rank of the clique must have joined the collective,
  with the same count, datatype and op, else ``NcclError``;
* pointers are ints, counts are elements, and every ``[ptr, ptr + count *
  itemsize)`` range must fall inside a buffer registered with ``register``, so
  a count given in bytes fails loudly instead of scribbling over memory;
* all inputs are read before any output is written, so in-place works.

Every call is appended to ``calls`` for tests to inspect.  It cannot check
asynchrony, stream order or device placement.

Asynchronous errors: ``fail_async(rank, status, message)`` makes that rank's
communicator report an error from ``check_async_error()`` (NCCL's
``ncclCommGetAsyncError``, as CuPy's ``NcclCommunicator`` raises it), as a
failed collective does on a GPU; ``abort()`` ends a communicator as
``ncclCommAbort`` does.
"""
from __future__ import annotations

import ctypes
import os

import numpy

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_CHAR, NCCL_INT, NCCL_HALF, NCCL_FLOAT, NCCL_DOUBLE = 0, 2, 6, 7, 8

_DTYPES = {
    NCCL_INT8: numpy.int8, NCCL_UINT8: numpy.uint8, NCCL_INT32: numpy.int32,
    NCCL_UINT32: numpy.uint32, NCCL_INT64: numpy.int64, NCCL_UINT64: numpy.uint64,
    NCCL_FLOAT16: numpy.float16, NCCL_FLOAT32: numpy.float32, NCCL_FLOAT64: numpy.float64,
}


class NcclError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


NCCL_ERROR_SYSTEM_ERROR, NCCL_ERROR_INVALID_ARGUMENT, NCCL_ERROR_INVALID_USAGE, NCCL_ERROR_REMOTE_ERROR = 2, 4, 5, 6

calls: list[tuple] = []
_registry: list[tuple[int, int]] = []  # (start, end) byte ranges the stand-in may touch
_group_depth = 0
_pending: list = []
_cliques: list[list["NcclCommunicator"]] = []
_by_id: dict[bytes, list] = {}  # communicators made with NcclCommunicator(ndev, id, rank), by id


def reset() -> None:
    """Forget calls, buffers, pending work and communicators (between tests)."""
    global _group_depth
    calls.clear()
    _registry.clear()
    _pending.clear()
    _cliques.clear()
    _by_id.clear()
    _group_depth = 0


def register(*arrays) -> None:
    """Allow the stand-in to read and write these NumPy arrays' memory."""
    for a in arrays:
        start = a.ctypes.data
        _registry.append((start, start + a.nbytes))


def _view(ptr: int, count: int, datatype: int) -> numpy.ndarray:
    if not isinstance(ptr, int) or not isinstance(count, int):
        raise TypeError("pointers and counts are plain ints (use arr.data.ptr / arr.ctypes.data, arr.size)")
    dtype = numpy.dtype(_DTYPES[datatype])
    nbytes = count * dtype.itemsize
    if not any(lo <= ptr and ptr + nbytes <= hi for lo, hi in _registry):
        raise NcclError(
            NCCL_ERROR_INVALID_ARGUMENT,
            f"range [{ptr:#x}, +{nbytes} bytes) is outside every registered buffer "
            "(is the count in bytes instead of elements?)",
        )
    buf = (ctypes.c_char * nbytes).from_address(ptr)
    return numpy.frombuffer(buf, dtype=dtype, count=count)


def fail_async(rank: int, status: int = NCCL_ERROR_REMOTE_ERROR, message: str = "remote process exited") -> None:
    """Make the communicators of ``rank`` report ``status`` as their asynchronous error from now on."""
    for clique in [*_cliques, *_by_id.values()]:
        for comm in clique:
            if comm.rank_id() == rank:
                comm._async_error = (status, message)


def get_version() -> int:
    return 23203


def get_unique_id() -> bytes:
    return os.urandom(128)  # distinct ids, so a communicator built from the wrong one is caught


def groupStart() -> None:
    global _group_depth
    calls.append(("groupStart",))
    _group_depth += 1


def groupEnd() -> None:
    global _group_depth
    calls.append(("groupEnd",))
    if _group_depth == 0:
        raise NcclError(NCCL_ERROR_INVALID_USAGE, "groupEnd without groupStart")
    _group_depth -= 1
    if _group_depth == 0:
        work, _pending[:] = list(_pending), []
        _run(work)


def _run(work) -> None:
    by_clique: dict[int, list] = {}
    for item in work:
        by_clique.setdefault(id(item[0].clique), []).append(item)
    for items in by_clique.values():
        clique = items[0][0].clique
        ranks = sorted(c.rank_id() for c, *_ in items)
        if ranks != list(range(len(clique))):
            raise NcclError(NCCL_ERROR_INVALID_USAGE, f"ranks {ranks} of {len(clique)} joined the collective")
        shapes = {(count, datatype, op) for _, _, _, count, datatype, op, _ in items}
        if len(shapes) != 1:
            raise NcclError(NCCL_ERROR_INVALID_USAGE, f"ranks disagree on (count, datatype, op): {sorted(shapes)}")
        count, datatype, op = shapes.pop()
        inputs = [_view(send, count, datatype).copy() for _, send, *_ in items]  # read all first
        stacked = numpy.stack(inputs)
        if op == NCCL_SUM:
            result = stacked.sum(axis=0, dtype=stacked.dtype)
        elif op == NCCL_AVG:
            # NCCL scales each input by 1/N before summing (see gpu-facts).
            result = (stacked * stacked.dtype.type(1.0 / len(items))).sum(axis=0, dtype=stacked.dtype)
        elif op == NCCL_MAX:
            result = stacked.max(axis=0)
        elif op == NCCL_MIN:
            result = stacked.min(axis=0)
        else:
            result = stacked.prod(axis=0, dtype=stacked.dtype)
        for _, _, recv, *_ in items:
            _view(recv, count, datatype)[...] = result


class NcclCommunicator:
    def __init__(self, ndev: int, commId: bytes, rank: int, config=None):
        self._ndev, self._rank, self._device = int(ndev), int(rank), int(rank)
        self.comm_id = bytes(commId)
        # Ranks built from one id form one clique (several "hosts" in one process).
        self.clique: list[NcclCommunicator] = _by_id.setdefault(self.comm_id, [])
        self.clique.append(self)
        calls.append(("init", int(ndev), self.comm_id, int(rank)))
        self._alive = True
        self._async_error: tuple | None = None  # (status, message) once ``fail_async`` names this rank

    @staticmethod
    def initAll(devices):
        if isinstance(devices, int):
            devices = list(range(devices))
        elif not isinstance(devices, list):
            raise ValueError("devices must be an int or a list of ints")
        if len(set(devices)) != len(devices):
            raise NcclError(NCCL_ERROR_INVALID_USAGE, "duplicate GPU detected")
        comms = []
        for rank, dev in enumerate(devices):
            c = NcclCommunicator(len(devices), get_unique_id(), rank)
            c._device = int(dev)
            comms.append(c)
        del calls[-len(comms):]  # their "init" records: initAll is recorded as one call
        for c in comms:
            c.clique = comms
        _cliques.append(comms)
        calls.append(("initAll", list(devices)))
        return comms

    def size(self) -> int:
        return self._ndev

    def rank_id(self) -> int:
        return self._rank

    def device_id(self) -> int:
        return self._device

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:
        if not self._alive:
            raise NcclError(NCCL_ERROR_INVALID_USAGE, "communicator was destroyed")
        for name, v in (("sendbuf", sendbuf), ("recvbuf", recvbuf), ("count", count),
                        ("datatype", datatype), ("op", op), ("stream", stream)):
            if not isinstance(v, int):
                raise TypeError(f"allReduce {name} must be an int, got {type(v).__name__}")
        calls.append(("allReduce", self._rank, sendbuf, recvbuf, count, datatype, op, stream))
        item = (self, sendbuf, recvbuf, count, datatype, op, stream)
        if _group_depth == 0:
            if len(self.clique) > 1:
                raise RuntimeError(
                    "allReduce outside groupStart/groupEnd with several ranks in one thread: "
                    "the real call would block forever"
                )
            _run([item])
        else:
            _pending.append(item)

    def check_async_error(self) -> None:
        calls.append(("check_async_error", self._rank))
        if self._async_error is not None:
            raise NcclError(*self._async_error)

    def abort(self) -> None:
        calls.append(("abort", self._rank))
        self._alive = False

    def destroy(self) -> None:
        calls.append(("destroy", self._rank))
        self._alive = False


def reducer(n_towers: int, groups=None):
    """A towers reducer whose NCCL is this stand-in: CPU towers play GPUs, one rank per group.

    ``groups``: tower indices per "GPU" (default: each tower its own).  Hand it to
    ``towers.Trainer(..., reducer=...)``; it runs the production
    ``Hierarchical(DeviceMean, NcclMean)`` composition over host buffers.
    """
    import sys

    from towers.devices.placement import CPU
    from towers.parallel.reducers import DeviceMean, Hierarchical, NcclMean

    this = sys.modules[__name__]
    groups = groups or [[i] for i in range(n_towers)]
    ranks = len(groups)
    local = DeviceMean(groups, [CPU] * n_towers, [None] * n_towers, ranks / n_towers)
    return Hierarchical(local, NcclMean(list(range(ranks)), [CPU] * ranks, [None] * ranks, this))
