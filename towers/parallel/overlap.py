"""The gradient average in buckets, issued while backward runs, as PyTorch DDP and Horovod do.

With ``allreduce_bucket_mib`` > 0 (grads mode) the gradient keeper
(``towers.parallel.sync.GradientAveraging``) averages the flat gradient
buffers bucket by bucket (``towers.parallel.buckets``: ranges of the buffer
cut at layer boundaries, the last layers first) instead of in one call after
every tower's compute.  ``Overlap`` is made once per step engine; each step
takes a fresh ``BucketedStep`` (``Overlap.step``), whose ``hook(i)`` is tower
i's ``ready`` (``Replica.mean_loss_and_grads``):

1. tower i's last micro-batch's backward reports each layer once its
   gradients (and every later layer's) are final; the hook counts the
   buckets the tower has finished and, on a GPU, records an event on the
   tower's stream right after the bucket's last layer was queued;
2. once every tower has finished bucket b, the thread whose report completed
   it issues b, buckets strictly in order (one issuer at a time): each range of
   the bucket is averaged over every tower's buffer through the keeper's
   reducer (its rounding to ``allreduce_dtype`` first).  CPU towers average it
   there and then, in that thread: serial towers during the last tower's
   backward, tower threads while the other towers' backward goes on; a
   reducer that ``waits`` for other hosts (the cross-host mean of CPU hosts)
   gets the bucket on a thread of its own, the bucket thread, so the host's
   wait for the others runs beside its backward.  GPU
   towers queue it on a second stream per GPU, the all-reduce stream, which
   first waits for bucket b's event on every tower's compute stream, so the
   all-reduce of bucket b runs while the compute streams go on with the earlier
   layers (the reducer's ``on_streams``: the same NCCL communicators);
3. in the keeper's ``average``, before the update (``finish``), every
   compute stream waits for its GPU's all-reduce stream, the bucket
   thread's averages are joined (an error there is raised here); that every
   bucket was issued is checked.

Counting (``Counted``): each range of a bucket is one reducer call and counts
as one all-reduce; a bucket holds two ranges in general (the buffer keeps the
weights of every layer before the biases, ``towers.parallel.buckets``), so a
run reports about twice its buckets per step; one bucket over the whole
buffer is one range, one all-reduce.

Results: an element's mean over towers does not depend on how the buffer is
cut, so on the CPU (host means, the NCCL stand-in) the bucketed average is
bit-identical to the one call's (tests/parallel/test_overlap.py).  On GPUs
two ranks give the same bits too; with three or more NCCL may choose another
algorithm for a smaller message and sum in another order: replicas stay
bit-identical among themselves, the run may differ from one without buckets
in the last bits.

Sync points: none on a GPU (events between streams).  CPU tower threads
wait for one another only when a thread's bucket must follow an earlier one
still being issued by another thread; ``finish`` waits for the bucket thread.
Measured on 2 cores, neither CPU towers nor 2 CPU hosts gained from buckets
(docs/performance.md, Several hosts): there the cores are busy with backward.

Limits: GPU towers on threads (``sync_bn``) are refused: sync-BN's
statistics and the buckets would call the same NCCL communicators from two
threads at once.  With ``accumulate`` > 1 only the last micro-batch's
backward issues buckets.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

from towers.devices.placement import on_stream


class Overlap:
    """The buckets of ``plan`` over ``towers``, averaged by ``average`` through ``reducer`` (module doc).

    ``average(buffers, scopes, reducer, on)``: the keeper's mean of one range
    of every tower's gradient (``buffers``), each tower's preparation queued
    in its ``scopes[i]()``, timed on worker ``on``.  On GPUs the all-reduce
    streams are made here, one per compute stream (towers sharing a GPU share
    both), and ``reducer`` is used on them (``on_streams``); so are the events,
    one per tower and bucket, recorded again each step (a stream's wait takes
    the event's latest record at the time of the call).
    """

    def __init__(self, plan: list, towers: list, reducer, average):
        self.plan, self.towers, self.average = plan, list(towers), average
        self.gpu = any(t.stream is not None for t in towers)
        self._thread = None
        if not self.gpu:
            self.streams = [None] * len(towers)
            self.reducer, self.scopes = reducer, [t.scope for t in towers]
            if reducer.waits:  # the host's side of a cross-host mean: waits there, not in backward
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="towers-buckets")
            return
        made: dict[int, object] = {}
        for t in towers:
            if id(t.stream) not in made:
                with t.device.scope():
                    made[id(t.stream)] = t.device.xp.cuda.Stream(non_blocking=True)
        self.streams = [made[id(t.stream)] for t in towers]
        self.reducer = reducer.on_streams(self.streams)
        self.scopes = [functools.partial(_on, t.device, s) for t, s in zip(towers, self.streams)]
        self.events, self.joined = [], []  # per tower: after each bucket's layers; after the last all-reduce
        for t in towers:
            with t.device.scope():
                self.events.append([_event(t.device) for _ in plan])
                self.joined.append(_event(t.device))

    def step(self) -> "BucketedStep":
        """A new step's progress (made before its towers compute)."""
        return BucketedStep(self)

    def finished(self, i: int, buckets: range) -> None:
        """Tower ``i``'s backward has queued the layers of ``buckets`` (GPU: their events recorded now)."""
        if self.gpu:
            t = self.towers[i]
            with t.device.scope():
                for b in buckets:
                    self.events[i][b].record(t.stream)

    def issue(self, b: int, on: int):
        """Bucket ``b``'s ranges averaged (CPU), handed to the bucket thread (its future), or queued on the
        all-reduce streams after its events (GPU)."""
        if self._thread is not None:
            return self._thread.submit(contextvars.copy_context().run, self._average, b, on)  # the caller's forms
        if self.gpu:
            for t, comm, mine in zip(self.towers, self.streams, self.events):
                with t.device.scope():
                    comm.wait_event(mine[b])
        self._average(b, on)
        return None

    def _average(self, b: int, on: int) -> None:
        for lo, hi in self.plan[b].ranges:
            self.average([t.replica.grads[lo:hi] for t in self.towers], self.scopes, self.reducer, on)

    def close(self) -> None:
        """Stop the bucket thread, if any (idempotent)."""
        if self._thread is not None:
            thread, self._thread = self._thread, None
            thread.shutdown(wait=True)

    def join(self) -> None:
        """Every compute stream waits for its all-reduce stream (GPU; the CPU's buckets are done)."""
        if self.gpu:
            for t, comm, done in zip(self.towers, self.streams, self.joined):
                with t.device.scope():
                    done.record(comm)
                    t.stream.wait_event(done)


class BucketedStep:
    """One step's buckets: which each tower has finished, which are issued (module doc)."""

    def __init__(self, overlap: Overlap):
        self.overlap = overlap
        n = len(overlap.towers)
        self.passed = [0] * n  # buckets each tower's backward has finished
        self.claimed = 0  # buckets a thread has taken to issue
        self.issued = 0  # buckets issued; -1 once an issue failed
        self.pending = []  # the bucket thread's futures, in bucket order
        self._order = threading.Condition()

    def hook(self, i: int):
        """Tower ``i``'s ``ready(layer)``."""
        return functools.partial(self._ready, i)

    def _ready(self, i: int, layer: int) -> None:
        plan = self.overlap.plan
        done = b = self.passed[i]
        while b < len(plan) and layer <= plan[b].first_layer:
            b += 1
        if b == done:
            return
        self.overlap.finished(i, range(done, b))
        with self._order:
            self.passed[i] = b
            first, last = self.claimed, min(self.passed)
            if last <= first:
                return
            self.claimed = last
            # Buckets are issued in order: wait for a thread still issuing earlier ones.
            self._order.wait_for(lambda: self.issued in (first, -1))
            if self.issued == -1:
                raise RuntimeError("an earlier gradient bucket's all-reduce failed")
        ok = False
        try:
            for k in range(first, last):
                future = self.overlap.issue(k, i)
                if future is not None:
                    self.pending.append(future)
            ok = True
        finally:
            with self._order:
                self.issued = last if ok else -1
                self._order.notify_all()

    def finish(self) -> None:
        """After every tower's compute, before the update: the buckets issued, the update ordered after them."""
        if self.issued != len(self.overlap.plan):
            raise RuntimeError(f"{self.issued} of {len(self.overlap.plan)} gradient buckets were averaged: "
                               "a tower's backward did not report every layer")
        for future in self.pending:
            future.result()  # the bucket thread's averages are done (its error, if any, raised here)
        self.overlap.join()


def _event(device):
    """A CUDA event on ``device`` (current) for ordering streams only: no timing."""
    return device.xp.cuda.Event(disable_timing=True)


@contextlib.contextmanager
def _on(device, stream):
    """``device`` current and ``stream`` its current stream."""
    with device.scope(), on_stream(stream):
        yield
