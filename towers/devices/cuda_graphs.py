"""CUDA graphs of a GPU tower's forward and backward: captured once per kind of step, then replayed.

A GPU step is bound by the host when its kernels are small: ResNet-20 at
batch 128 queues about 340 launches per tower-step, each tens of
microseconds of Python and CuPy on the one thread that drives every GPU,
against a few milliseconds of kernels.  ``StepGraphs`` records a tower's
forward and backward once as a CUDA graph and then runs it as ONE launch.

``StepGraphs.run(key, inputs, compute, timer)``, ``compute(*inputs, timer=)``
being the tower's eager forward and backward on its staged batch:

1. the first call of a key runs ``compute`` eagerly: the warm-up, in which
   kernels compile, cuDNN builds its plans, workspaces are allocated and
   the step scalars registered (none of which may happen inside a capture);
2. the second captures ``compute`` on the tower's stream (CuPy's stream
   capture, relaxed mode), every allocation of the capture drawn from the
   tower's graph memory pool, then launches the graph;
3. every later call copies the staged inputs into the captured ones (a
   device copy, only when they are other arrays) and launches the graph.

What a capture bakes in is either the key or in device memory: the key is
the caller's (whether the loss is computed, the loss scale, L2) plus the
inputs' shapes and dtypes; numbers that change from step to step (batch
norm's moving-statistics step) are ``StepScalars`` in device memory, which
the replica refreshes before each launch (``Replica.start_step``).  The
output (the loss, a 0-d array the graph rewrites at each launch) is returned
as a copy.  At most ``KEEP`` graphs per tower (fp16's loss scale changes now
and then): the least recently used is dropped, after its stream finishes.

Memory: what the captures allocate (the step's activations, the layers'
saved values) comes from one memory pool per tower that nothing else draws
from, kept with the tower's graphs, so no eager array ever takes it.  Its
graphs share it: a block one capture freed may be another's scratch, which
is safe because a tower's launches run one after another on its stream and
no graph reads at its start what another left there (each reads its inputs,
which are its own arrays, and the arrays below); a graph's output is held by
the graph, never freed.  What a graph reads that was allocated before it
(the flat parameter, gradient and buffer arrays, the layers' workspaces, the
staging buffers, cuDNN's and cuBLAS's workspaces) lives as long as the
replica, the process or the handle, and is never reallocated.

Limits: nothing inside ``compute`` may synchronize with the host or copy
from it (dropout draws its masks on the host: ``Trainer`` refuses it with
graphs, as it refuses several micro-batches, sync-BN and gradient buckets);
GEMMs inside a capture go through nvmath-python's cuBLAS binding, because
CuPy's refuses any cuBLAS call while a stream captures
(``towers.devices.matmul``).  A capture that fails leaves the tower eager for
the rest of the run, the reason in ``refused`` (and said once as a notice).
Sync points: none (a launch is queued on the tower's stream).
"""
from __future__ import annotations

import collections

from towers.errors import notice

#: Graphs kept per tower (fp16: one per loss scale and loss wanted or not).
KEEP = 4


class _Captured:
    """One instantiated graph, its inputs and its output."""

    def __init__(self, graph, inputs: tuple, out):
        self.graph, self.inputs, self.out = graph, inputs, out

    def launch(self, inputs: tuple, stream) -> None:
        for mine, given in zip(self.inputs, inputs):
            if given is not mine:
                mine[...] = given  # a device copy on the tower's stream (the staged arrays may alternate)
        self.graph.launch(stream)

    def output(self):
        return None if self.out is None else self.out.copy()


class StepGraphs:
    """One GPU tower's graphs (module doc): ``run`` its step, eagerly or by a graph.

    ``stream``: the tower's CuPy stream (non-blocking: the legacy default
    stream cannot capture); ``scalars``: its replica's ``StepScalars``,
    flagged while a capture runs; ``label``: the tower, for the notice.
    ``captures``, ``launches``: counts, for tests and the benchmark.
    """

    def __init__(self, stream, scalars, label: str = "a GPU tower"):
        self.stream, self.scalars, self.label = stream, scalars, label
        self.refused: str | None = None
        self.captures = self.launches = 0
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._seen: set = set()
        self._pool = None  # the captures' memory pool (module doc), made with the first

    def pool_bytes(self) -> int:
        """Device bytes the captures' memory pool holds (on the tower's device; 0 before the first capture)."""
        return 0 if self._pool is None else int(self._pool.total_bytes())

    def run(self, key, inputs: tuple, compute, timer):
        """``compute(*inputs, timer=...)``'s result for this step: eagerly (a key's first call, or after a refused
        capture) or by the key's graph, whose launch ``timer("graph")`` times."""
        if self.refused is not None:
            return compute(*inputs, timer=timer)
        key = (key, tuple((a.shape, a.dtype.str) for a in inputs))
        g = self._graphs.get(key)
        if g is None:
            if key not in self._seen:
                self._seen.add(key)
                return compute(*inputs, timer=timer)
            g = self._capture(key, inputs, compute)
            if g is None:
                return compute(*inputs, timer=timer)
        else:
            self._graphs.move_to_end(key)
        with timer("graph"):
            g.launch(inputs, self.stream)
        self.launches += 1
        return g.output()

    def _capture(self, key, inputs: tuple, compute):
        import cupy

        if len(self._graphs) >= KEEP:
            self.stream.synchronize()  # the oldest graph's launches have finished before it goes
            self._graphs.popitem(last=False)
        if self._pool is None:
            self._pool = cupy.cuda.MemoryPool()
        self.scalars.capturing = True
        try:
            with cupy.cuda.using_allocator(self._pool.malloc):
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
            notice(f"CUDA graphs: {self.label} runs its steps eagerly, the capture failed ({self.refused})")
            return None
        finally:
            self.scalars.capturing = False
        g = self._graphs[key] = _Captured(graph, tuple(inputs), out)
        self.captures += 1
        return g
