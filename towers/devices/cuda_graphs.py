"""CUDA graphs of a GPU tower's forward and backward: captured once per kind of step, then replayed.

``StepGraphs`` records a tower's forward and backward once as a CUDA graph
and then runs it as ONE launch, for steps bound by the host's launch cost
(docs/architecture.md, "On GPUs").

``StepGraphs.run(key, inputs, compute, timer, want)``, ``compute(*inputs,
timer=)`` being the tower's eager forward and backward on its staged batch
(which always computes the loss, so that one graph serves the steps that
want it and those that do not):

1. the first call of a key runs ``compute`` eagerly: the warm-up, in which
   kernels compile, cuDNN builds its plans, workspaces are allocated and
   the step scalars registered (none of which may happen inside a capture);
2. the second captures ``compute`` on the tower's stream (CuPy's stream
   capture, relaxed mode), every allocation of the capture drawn from a
   memory pool of the graph's own, then launches the graph;
3. every later call copies the staged inputs into the captured ones (a
   device copy, only when they are other arrays) and launches the graph.

What a capture bakes in is either the key or in device memory: the key is
the caller's (the loss scale, L2) plus the inputs' shapes and dtypes;
numbers that change from step to step (batch norm's moving-statistics step)
are ``StepScalars`` in device memory, which the replica refreshes before
each launch (``Replica.start_step``).  The
output (the loss, a 0-d array the graph rewrites at each launch) is returned
as a copy when ``want``, else not at all.  At most ``KEEP`` graphs per tower
(fp16's loss scale changes now and then): the least recently used is
dropped, with its pool, after its stream finishes.

Memory: what a capture allocates (the step's activations, the layers' saved
values) comes from a memory pool of that graph's own, kept with it, so no
eager array and no other graph ever takes its blocks (a pool shared by two
graphs could, short of memory, hand the driver back blocks one of them
still uses: CuPy's pools free their cached blocks and retry).  For the same
reason a capture must not run short of memory itself (its pool would free
blocks its own earlier operations use): before capturing, CuPy's default
pool gives its cached free blocks back to the driver, and the capture is
refused unless the device has room for about what the key's warm-up step
took from that pool, with a margin (``HEADROOM``).  What a graph
reads that was allocated before it (the flat parameter, gradient and buffer
arrays, the layers' workspaces, the staging buffers, cuDNN's and cuBLAS's
workspaces) lives as long as the replica, the process or the handle, and is
never reallocated.

Limits: nothing inside ``compute`` may synchronize with the host or copy
from it (dropout draws its masks on the host: ``Trainer`` refuses it with
graphs, as it refuses several micro-batches, sync-BN and gradient buckets);
GEMMs inside a capture go through nvmath-python's cuBLAS binding, because
CuPy's refuses any cuBLAS call while a stream captures
(``towers.devices.matmul``).  A capture that fails leaves the tower eager for
the rest of the run, the reason in ``refused`` (and said once as a notice),
after ``on_failure`` (the replica's ``reset_workspaces``: scratch the
capture made and marked filled, whose fills never ran, is made afresh).
Sync points: none (a launch is queued on the tower's stream).
"""
from __future__ import annotations

import collections
import traceback

from towers.errors import notice

#: Graphs kept per tower (fp16: one per loss scale met lately).
KEEP = 4
#: A capture needs free device memory of this many times what its warm-up step took from CuPy's pool, plus MARGIN.
HEADROOM, MARGIN = 1.5, 64 << 20


def _pool_bytes() -> int:
    """Bytes CuPy's default memory pool holds on the current device (what it took from the driver)."""
    import cupy

    return int(cupy.get_default_memory_pool().total_bytes())


class _Captured:
    """One instantiated graph, the memory pool its capture allocated from, its inputs and its output."""

    def __init__(self, graph, pool, inputs: tuple, out):
        self.graph, self.pool, self.inputs, self.out = graph, pool, inputs, out

    def launch(self, inputs: tuple, stream) -> None:
        for mine, given in zip(self.inputs, inputs):
            if given is not mine:
                mine[...] = given  # a device copy on the tower's stream (the staged arrays may alternate)
        self.graph.launch(stream)

    def pool_bytes(self) -> int:
        return int(self.pool.total_bytes())


class StepGraphs:
    """One GPU tower's graphs (module doc): ``run`` its step, eagerly or by a graph.

    ``stream``: the tower's CuPy stream (non-blocking: the legacy default
    stream cannot capture); ``scalars``: its replica's ``StepScalars``,
    flagged while a capture runs; ``on_failure()``: called when a capture
    fails, before the eager step; ``label``: the tower, for the notice.
    ``captures``, ``launches``: counts, for tests and the benchmark.
    """

    def __init__(self, stream, scalars, on_failure=None, label: str = "a GPU tower"):
        self.stream, self.scalars, self.label = stream, scalars, label
        self.on_failure = on_failure
        self.refused: str | None = None
        self.refused_traceback: str | None = None  # where a capture failed (the benchmark's log shows it)
        self.captures = self.launches = 0
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._seen: dict = {}  # key -> device bytes its warm-up step took from CuPy's default pool

    def pool_bytes(self) -> int:
        """Device bytes the graphs' memory pools hold (on the tower's device)."""
        return sum(g.pool_bytes() for g in self._graphs.values())

    def run(self, key, inputs: tuple, compute, timer, want: bool = True):
        """This step by ``compute(*inputs, timer=...)``: eagerly (a key's first call, or after a failed capture)
        or by the key's graph, whose launch ``timer("graph")`` times; its result when ``want``, else None."""
        if self.refused is not None:
            return self._eager(inputs, compute, timer, want)
        key = (key, tuple((a.shape, a.dtype.str) for a in inputs))
        g = self._graphs.get(key)
        if g is None:
            if key not in self._seen:
                before = _pool_bytes()
                out = self._eager(inputs, compute, timer, want)
                self._seen[key] = max(_pool_bytes() - before, 0)
                return out
            g = self._capture(key, inputs, compute)
            if g is None:
                return self._eager(inputs, compute, timer, want)
        else:
            self._graphs.move_to_end(key)
        with timer("graph"):
            g.launch(inputs, self.stream)
        self.launches += 1
        return g.out.copy() if want and g.out is not None else None

    @staticmethod
    def _eager(inputs, compute, timer, want: bool):
        out = compute(*inputs, timer=timer)
        return out if want else None

    def _capture(self, key, inputs: tuple, compute):
        import cupy

        if len(self._graphs) >= KEEP:
            self.stream.synchronize()  # the oldest graph's launches have finished before it goes
            self._graphs.popitem(last=False)
        cupy.get_default_memory_pool().free_all_blocks()  # cached, unused: no graph reads them
        free = cupy.cuda.runtime.memGetInfo()[0]
        need = int(HEADROOM * self._seen[key]) + MARGIN
        if free < need:
            self.refused = f"{free >> 20} MiB free on the device, a capture wants about {need >> 20} MiB"
            notice(f"CUDA graphs: {self.label} runs its steps eagerly ({self.refused})")
            return None
        pool = cupy.cuda.MemoryPool()
        self.scalars.capturing = True
        try:
            with cupy.cuda.using_allocator(pool.malloc):
                self.stream.begin_capture()
                try:
                    out = compute(*inputs, timer=None)  # a phase timer synchronizes: not inside a capture
                except BaseException:
                    try:
                        self.stream.end_capture()  # leave capture mode; the failed capture is discarded
                    except Exception:
                        pass
                    raise
                graph = self.stream.end_capture()
        except Exception as e:
            self.refused = f"{type(e).__name__}: {e}"
            self.refused_traceback = traceback.format_exc()
            notice(f"CUDA graphs: {self.label} runs its steps eagerly, the capture failed ({self.refused})")
            if self.on_failure is not None:
                self.on_failure()
            return None
        finally:
            self.scalars.capturing = False
        g = self._graphs[key] = _Captured(graph, pool, tuple(inputs), out)
        self.captures += 1
        return g
