"""NCCL communicators and the grouped in-place all-reduce over one buffer per GPU.

``NcclAllReduce`` is the one place NCCL is called: one communicator per rank
(``initAll`` over this process's GPUs, or this host's ranks of an
``NcclWorld``) and ``average(buffers, streams)``, a grouped ``NCCL_AVG`` of
one buffer per rank.  ``towers.parallel.reducers.NcclMean`` wraps it as a
reducer; the group sums around it (towers sharing a GPU) are
``towers.parallel.reducers.DeviceMean``'s.

Limits: one process drives every GPU, so every collective of a step sits inside
one ``groupStart()``/``groupEnd()`` pair (a plain loop would block on the first
rank).  Two ranks on one GPU are refused by NCCL, so towers sharing a GPU are
reduced on the device first.  NCCL's AVG multiplies by 1/N before summing, so
results can differ from ``sum / N`` in the last bit when N is not a power of two.

Waiting (``wait``, at every host sync point of the step engine, with the
``nccl_timeout`` setting; off by default until a GPU run has checked it): NCCL
reports a failed collective (a peer gone, a network error) asynchronously, and
the all-reduce then never finishes: a plain stream synchronize would hang.  So
the host polls instead: every ``POLL_S`` seconds it asks each communicator for
its asynchronous error (``check_async_error``, NCCL's
``ncclCommGetAsyncError``) and each rank's stream whether its work is done; an
error, or work not done within the timeout, aborts the communicators and
raises one ``TrainingError`` line (exit status 1 from the command line), never
a hang.

The NCCL module is injected at one place: the ``nccl`` argument (default
``cupy.cuda.nccl``).  Tests pass a host-memory stand-in with the same call
signatures (and CPU ``devices``, in whose scope nothing changes).

Across hosts (``NcclWorld``, ``towers.cluster``): one communicator spans every
host's GPU leaders.  Host h's leaders are ranks ``first_rank ..`` of ``n_ranks``;
rank 0's host made the ``unique_id`` and every host got it from the driver.
Each host builds its communicators with ``NcclCommunicator(n_ranks, id, rank)``
inside ``groupStart()``/``groupEnd()`` (the calls of all ranks of one process
must be grouped, like the all-reduce).  The group sums are scaled by
``n_ranks / total_towers`` so NCCL's average over all leaders is the mean over
every tower of every host, whatever each host's tower count.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy

from towers.errors import TrainingError, UserError
from towers.devices.placement import GPU_EXTRAS, Device


POLL_S = 0.0005  # seconds between two polls of the streams and of NCCL's asynchronous errors


def nccl_module():
    """The real ``cupy.cuda.nccl`` (imported lazily: the CPU path never needs it).

    NCCL's library comes with the cuda12/cuda13 extras, not with CuPy: without
    it CuPy's module imports with ``available`` False (and a warning) and fails
    at its first call, so that is said here, in one line naming the extras.
    """
    import warnings

    why = ""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            from cupy.cuda import nccl
        except ImportError as e:  # no CuPy at all
            nccl, why = None, str(e)
    if nccl is not None and getattr(nccl, "available", True):
        return nccl
    # CuPy's warning spans lines ("nccl library could not be loaded.", "Reason: ...", its own pip command for
    # CUDA 12 only): its reason alone goes into the one line.
    lines = [line.strip() for line in (why or (str(said[0].message) if said else "")).splitlines() if line.strip()]
    why = next((line[len("Reason: "):] for line in lines if line.startswith("Reason: ")), lines[0] if lines else "")
    why = f" ({why})" if why else ""
    raise UserError(f"towers on several GPUs average through NCCL, whose library does not load{why}: {GPU_EXTRAS}")


def data_ptr(array) -> int:
    """Address of an array's first element: CuPy ``.data.ptr``, NumPy ``.ctypes.data``."""
    data = getattr(array, "data", None)
    ptr = getattr(data, "ptr", None)
    return int(ptr) if ptr is not None else int(array.ctypes.data)


@dataclass(frozen=True)
class NcclWorld:
    """This host's share of a communicator over several hosts (see the module docstring)."""

    unique_id: bytes  # from nccl.get_unique_id() on the host of rank 0
    n_ranks: int  # GPU leaders over all hosts
    first_rank: int  # this host's first leader's rank
    total_towers: int  # towers over all hosts


def world_layout(leaders_per_host: list[int], towers_per_host: list[int], unique_id: bytes) -> list[NcclWorld]:
    """Each host's ``NcclWorld``: ranks numbered host by host, in host order."""
    firsts = [sum(leaders_per_host[:h]) for h in range(len(leaders_per_host))]
    return [NcclWorld(unique_id, sum(leaders_per_host), f, sum(towers_per_host)) for f in firsts]


class NcclAllReduce:
    """One communicator per rank (``initAll``, or a ``NcclWorld``'s ranks) and a grouped in-place average."""

    def __init__(self, device_ids: list[int], nccl=None, world: NcclWorld | None = None, devices=None,
                 stream_done=None):
        if len(set(device_ids)) != len(device_ids):
            raise UserError(
                f"NCCL needs distinct GPUs, got {device_ids}: towers sharing a GPU are reduced on it first"
            )
        self.nccl = nccl or nccl_module()
        self.device_ids = list(device_ids)
        # Whose scope each rank's communicator is made in (default: GPU ``device_ids``).
        self.devices = list(devices) if devices is not None else [Device("gpu", d) for d in self.device_ids]
        # Whether a stream's queued work is done (``wait``): CUDA's stream query; on host "devices" (tests' NCCL
        # stand-in) the work ran when it was issued.
        self._stream_done = stream_done or (_cuda_stream_done if any(d.is_gpu for d in self.devices)
                                            else (lambda ptr: True))
        self._issued: set = set()  # streams with all-reduces not yet waited for
        self._dtypes = {
            numpy.dtype(numpy.float32): self.nccl.NCCL_FLOAT32,
            numpy.dtype(numpy.float64): self.nccl.NCCL_FLOAT64,
        }
        if world is None:
            # initAll takes an int or a list (a tuple raises ValueError).
            self.comms = self.nccl.NcclCommunicator.initAll(list(self.device_ids))
        else:
            self.comms = self._join(world)

    def _join(self, world: NcclWorld) -> list:
        """This host's ranks of ``world``: one communicator per local GPU, grouped."""
        comms = []
        self.nccl.groupStart()
        try:
            for k, dev in enumerate(self.devices):
                with dev.scope():
                    comms.append(self.nccl.NcclCommunicator(world.n_ranks, world.unique_id, world.first_rank + k))
        finally:
            self.nccl.groupEnd()
        return comms

    def average(self, buffers: list, stream_ptrs: list[int]) -> None:
        """In-place ``NCCL_AVG`` of ``buffers[r]`` on rank r, on ``stream_ptrs[r]``."""
        nccl = self.nccl
        if len(buffers) != len(self.comms) or len(stream_ptrs) != len(self.comms):
            raise ValueError(f"{len(self.comms)} ranks, got {len(buffers)} buffers and {len(stream_ptrs)} streams")
        # Build and check every argument before groupStart: an exception between
        # groupStart and the last rank's call would leave a half-built collective.
        count, dtype = buffers[0].size, buffers[0].dtype
        calls = []
        for comm, buf, stream in zip(self.comms, buffers, stream_ptrs):
            if buf.size != count or buf.dtype != dtype or buf.ndim != 1 or not buf.flags.c_contiguous:
                raise ValueError(
                    f"all-reduce buffers must be contiguous 1-D arrays of one size and dtype; "
                    f"got {buf.shape} {buf.dtype} against ({count},) {dtype}"
                )
            if dtype not in self._dtypes:
                raise ValueError(f"NCCL all-reduce of {dtype} is not supported here")
            ptr = data_ptr(buf)
            calls.append((comm, ptr, int(stream)))
        nccl_dtype = self._dtypes[dtype]
        nccl.groupStart()
        try:
            for comm, ptr, stream in calls:
                comm.allReduce(ptr, ptr, count, nccl_dtype, nccl.NCCL_AVG, stream)
        finally:
            nccl.groupEnd()  # nothing is enqueued before this returns
        self._issued.update(stream for _, _, stream in calls)

    def wait(self, timeout: float) -> None:
        """Return when every stream an all-reduce was queued on since the last ``wait`` is done; a communicator's
        asynchronous error, or ``timeout`` seconds passing first, aborts the communicators and raises a
        ``TrainingError`` (module doc).  Polls every ``POLL_S`` seconds; the streams' other work counts too."""
        pending, t0 = set(self._issued), time.monotonic()
        while True:
            for rank, comm in enumerate(self.comms):
                check = getattr(comm, "check_async_error", None)
                if check is None:
                    continue
                try:
                    check()
                except Exception as e:  # NcclError: the collective failed
                    self._abort()
                    raise TrainingError(f"NCCL all-reduce failed on rank {rank} (device {self.device_ids[rank]}): "
                                        f"{type(e).__name__}: {e}; the run stops") from None
            pending = {ptr for ptr in pending if not self._stream_done(ptr)}
            if not pending:
                break
            if time.monotonic() - t0 > timeout:
                self._abort()
                raise TrainingError(f"NCCL all-reduce did not finish within {timeout:g} s on devices "
                                    f"{self.device_ids} (no error reported: a peer stopped answering?); the run stops")
            time.sleep(POLL_S)
        self._issued.clear()

    def _abort(self) -> None:
        """Abort every communicator (their queued collectives end), best effort: the caller raises next."""
        for comm in self.comms:
            try:
                comm.abort()
            except Exception:  # noqa: BLE001, S110 - already failing; the error raised next says why
                pass
        self.comms, self._issued = [], set()

    def close(self) -> None:
        for comm in self.comms:
            comm.destroy()
        self.comms = []


def _cuda_stream_done(ptr: int) -> bool:
    """Whether the CUDA stream ``ptr`` has finished its queued work (another CUDA error raises)."""
    from cupy_backends.cuda.api import runtime

    try:
        status = runtime.streamQuery(ptr)
    except runtime.CUDARuntimeError as e:
        status = e.status
    if status == _NOT_READY:
        return False
    runtime.check_status(status)
    return True


_NOT_READY = 600  # cudaErrorNotReady: the stream still has work
