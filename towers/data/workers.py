"""Input worker processes, the one pool of the data pipeline: rows made in parallel, batches in shared memory.

A :class:`Workers` pool serves the jobs (``towers.data.jobs``) of a data
set's examples made on demand (``towers.data.examples.Examples``: training
and test share the pool) and of the converter's decode
(``towers.data.image.convert``).  ``start(jid, rows...)`` hands a batch to
the workers as chunks of rows; a worker makes its rows with the job
(``make``: each example read and transformed, or a raw TFRecord chunk
gathered whole by its source) and writes the results straight into
a shared-memory block that the main process allocated for the whole batch, so
only row numbers travel to the workers (the rows themselves from an array in
memory) and only a list of failures comes back (no pickled arrays).
``workers=0`` runs the chunk in the calling thread (the input thread), into
ordinary memory.

Chunks: while at least as many chunks are pending (sent, their answers not yet
read) as there are workers (training: the batch thread keeps two batches per
worker in flight), a batch is one chunk, for the next worker in turn, and the
main process pays one hand-off per batch.  Otherwise (a batch read once:
evaluation, indexing, a cluster host's slice) it is split into one chunk per
worker, as nothing else would keep the other workers busy.  (An evaluation in
the middle of training finds the batch thread's chunks pending and reads on
one worker at a time.)  A block is reused only once every chunk written into it
has been answered: a batch dropped unread (a run stopped early) may still be
written by its workers.

Hand-offs: each worker has its own pipe; chunks go down it in order and their
answers come back in the same order, read by whichever thread waits for one
(why not ``concurrent.futures.ProcessPoolExecutor``: docs/architecture.md,
"Why some paths are as they are").

Order and memory: the caller (``towers.data.batches.Prefetcher``) keeps a
bounded number of batches in flight and takes them in order.  A block is
returned to a free list when the last view of its batch array is collected,
and reused for the next batch of the same size, so the blocks in use are the
batches in flight plus those the trainer still holds.

Cleanup: :meth:`Workers.close` (the trainer's ``close``: normal exit, Ctrl-C,
SIGTERM) stops the workers and unlinks every block.  A worker ends when its
pipe closes and watches its parent (``towers.data.orphans``), so it exits as
soon as the parent is gone (``kill -9``, the OOM killer) even mid-chunk and no
worker outlives a dead run; the first worker to see its parent gone unlinks
the parent's blocks by their name.  The blocks are kept off
multiprocessing's resource tracker, which would unlink them too but print a
warning about "leaked" objects after every killed run.

Sync points: ``towers.data.batches.Batch`` waits for a batch's chunks (the
caller's only wait); ``start`` blocks while a worker's pipe is full (chunks that carry their
pixels: an npz to augment).  Limits: workers are spawned (not forked: the
trainer's threads must not be forked mid-flight), which costs about a second
when the first batch is read; a worker keeps at most ``ATTACHED`` blocks
mapped.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import secrets
import signal
import threading
import weakref
from collections import OrderedDict

import numpy as np

from towers.data.batches import Batch
from towers.data.orphans import block_prefix, exit_if_orphaned, unlink, untracked_block, watch_parent
from towers.data.spawning import UNGUARDED_EXIT, spawn_context, unguarded_error
from towers.errors import InputError, UserError

ATTACHED = 16  # blocks a worker keeps mapped (batch and test-chunk sizes)
STOP_SECONDS = 5  # how long a worker has to end on SIGTERM before SIGKILL


# -- in the worker processes --------------------------------------------------------------------------------

_JOBS: list = []  # the jobs by id, in this worker
_BLOCKS: OrderedDict = OrderedDict()  # shared-memory blocks attached, by name, least recently used first


def _keep_heap() -> None:
    """Keep freed memory in the heap (glibc's malloc): a worker's per-example buffers (a decoded photo,
    Pillow's resize output: hundreds of KB each) are all freed after each example, so glibc would unmap
    them or trim the heap every time and the next example would fault its pages in again (measured:
    250 page faults and 1.5x the time per 224-pixel example against the same work in the main process)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: allocations below 64 MiB come from the heap
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: give memory back only past 256 MiB free at the top
    except (OSError, AttributeError):
        pass  # not glibc: its allocator's defaults


def _serve(conn, jobs, parent: int) -> None:
    """A worker's life: chunks from ``conn``, each answered in turn with ("ok", failures) or ("error", exception)."""
    _keep_heap()
    _JOBS[:] = jobs
    # Ctrl-C reaches the whole process group: the main process stops the run and then these workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A worker spawned while the run handles SIGTERM would inherit SIG_IGN: stop() must still end it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    watch_parent(parent, block_prefix(parent))
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the main process closed the pipe (or is gone)
            return exit_if_orphaned(block_prefix(parent))
        try:
            answer = ("ok", _run_chunk(*chunk))
        except Exception as e:  # a damaged record (TFRecordError): raised where the batch is waited for
            answer = ("error", e)
        try:
            conn.send(answer)
        except OSError:  # the main process is gone
            return exit_if_orphaned(block_prefix(parent))
        except Exception:  # an exception that does not pickle (the pipe is untouched): its text instead
            conn.send(("error", RuntimeError(f"in an input worker: {answer[1]!r}")))


def _block(name: str):
    block = _BLOCKS.pop(name, None)
    if block is None:
        block = untracked_block(name)  # the main process owns it
    _BLOCKS[name] = block
    while len(_BLOCKS) > ATTACHED:
        _BLOCKS.popitem(last=False)[1].close()
    return block


def _run_chunk(jid, name, offset, shape, dtype, refs, epochs, indices):
    out = np.ndarray((len(refs),) + tuple(shape), dtype, buffer=_block(name).buf, offset=offset)
    try:
        return _JOBS[jid].make(refs, epochs, indices, out)
    finally:
        del out  # the block may be closed later: no view may outlive this call


# -- in the main process ------------------------------------------------------------------------------------


class WorkerDied(InputError):
    """The pool lost a worker."""


class _Ticket:
    """A chunk's answer: number ``number`` of ``worker``'s, or ``failures`` when the chunk was made here.

    ``result()`` gives the failures or raises the worker's exception, as often as asked.
    """

    def __init__(self, worker=None, number=0, failures=()):
        self._worker, self._number = worker, number
        self._answer = ("ok", failures) if worker is None else None
        self._fetching = threading.Lock()  # two threads may wait for the same batch

    def result(self):
        with self._fetching:
            if self._answer is None:
                self._answer = self._worker.answer(self._number)  # read from the pipe once
        kind, value = self._answer
        if kind == "error":
            raise value
        return value

    @property
    def answered(self) -> bool:
        """Whether the worker is done with the chunk (its answer has been read): its block may be reused."""
        return self._worker is None or self._worker.read > self._number


class _Worker:
    """One worker process and its pipe: chunks go down in order and their answers come back in that order.

    Whoever waits for an answer reads the pipe, keeping the answers that come
    first for their own waiters (an evaluation and the batches of training may
    be waited for from different threads).
    """

    def __init__(self, context, jobs, parent: int):
        self._conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs, jobs, parent), daemon=True,
                                       name="towers-input-worker")
        self.process.start()
        theirs.close()  # the worker's exit then reads here as the end of the pipe
        self.sent = self.read = 0
        self._answers: dict[int, tuple] = {}
        self._sending, self._reading = threading.Lock(), threading.Lock()

    @property
    def pending(self) -> int:
        """Chunks sent whose answers have not been read (queued, being made, or made and not yet waited for)."""
        return self.sent - self.read

    def send(self, chunk) -> _Ticket:
        """Queue ``chunk``; blocks while the pipe is full (a chunk that carries its rows' pixels)."""
        with self._sending:
            if self._conn.closed:
                raise _closed()
            try:
                self._conn.send(chunk)
            except OSError:
                raise _died(self.process) from None
            self.sent += 1
            return _Ticket(self, self.sent - 1)

    def answer(self, number: int) -> tuple:
        """("ok", failures) or ("error", exception) of chunk ``number``, read once."""
        with self._reading:
            while number not in self._answers:
                try:
                    data = self._conn.recv_bytes()
                except (EOFError, OSError):
                    raise _died(self.process) from None
                try:
                    answer = pickle.loads(data)
                except Exception as e:  # e.g. an exception type that pickles but cannot be rebuilt here
                    answer = ("error", RuntimeError(f"an input worker's answer cannot be read: {e!r}"))
                # Counted even when unreadable: the next answer must keep its own number.
                self._answers[self.read] = answer
                self.read += 1
            return self._answers.pop(number)

    def stop(self) -> None:
        """End the process now (chunks still queued are not wanted) and close the pipe."""
        self.process.terminate()
        self.process.join(STOP_SECONDS)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
        # A send in flight ends with the process (a broken pipe); the pipe closes after it.
        with self._sending:
            self._conn.close()


def _died(process) -> Exception:
    process.join(STOP_SECONDS)  # its pipe closes as it exits: the status follows at once
    if process.exitcode == UNGUARDED_EXIT:  # it was starting workers itself (towers.data.spawning)
        return unguarded_error()
    return WorkerDied("an input worker process died (out of memory? killed?); resume from the last checkpoint "
                      "with `resume`")


def _closed() -> UserError:
    return UserError("the image data set is closed (its close() stopped the input workers): load it again to "
                     "read it")


class Workers:
    """``n`` worker processes shared by the jobs registered with ``add`` (0: run in the calling thread)."""

    def __init__(self, n: int):
        self.n = int(n)
        self._jobs: list = []
        self._pool = None  # a _Worker per process, once started
        self._turn = 0  # the worker that gets the next chunk
        self._free: dict[int, list] = {}  # block size -> (block, its last batch's tickets) not in use
        self._blocks: list = []  # every block made, for close
        # The input thread and the main thread (evaluation) both start batches; re-entrant because a batch
        # collected by the garbage collector inside `start` gives its block back under the same lock.
        self._lock = threading.RLock()
        self._closed = False
        self._finalizer = None

    def __getstate__(self):
        # Pickled to other processes (Ray hosts): the jobs and the count travel; the pool and blocks do not.
        return {"n": self.n, "jobs": self._jobs}

    def __setstate__(self, state):
        self.__init__(state["n"])
        self._jobs = state["jobs"]

    def add(self, job) -> int:
        """Register a job (``towers.data.jobs``) before the first batch; its id."""
        if self._pool is not None:
            raise RuntimeError("Workers.add after the workers started")
        self._jobs.append(job)
        return len(self._jobs) - 1

    def start(self, jid: int, rows, epochs=None, y=None, repair=None) -> Batch:
        """Start making the examples ``rows`` (row numbers of job ``jid``; ``epochs``: training draws); the
        batch carries the labels ``y`` and answers rows that cannot be made with ``repair`` (``Batch``).

        One chunk for the next worker in turn while at least as many chunks
        are pending as there are workers (the batch thread keeps them busy);
        else
        (a read made once, evaluation, a cluster host's slice) one chunk per
        worker.  Blocks while a worker's pipe is full.
        """
        if self._closed:
            raise _closed()
        job = self._jobs[jid]
        rows = np.asarray(rows, np.int64)
        example, dtype = job.shape, job.dtype
        shape = (len(rows),) + tuple(example)
        if self.n == 0 or len(rows) == 0:
            out = np.empty(shape, dtype)
            failures = job.make(job.refs(rows), epochs, rows, out)
            return Batch(out, y, [_Ticket(failures=failures)], [(0, len(rows))], repair)
        row_bytes = int(np.prod(example)) * dtype.itemsize
        tickets: list = []  # filled below; the block goes back to the free list with them
        with self._lock:
            if self._closed:
                raise _closed()
            workers = self._started()  # first: a script that cannot start them makes no block
            block = self._take(len(rows) * row_bytes)
            out = np.asarray(_Lease(block, shape, dtype))
            weakref.finalize(out.base, self._give_back, block, tickets)
            # Unread answers count: reading them first (a poll per worker) split more batches and measured
            # slower (2 workers / 1 worker 1.41-1.52 against 1.59-1.73, side by side).
            busy = sum(worker.pending for worker in workers) >= self.n
            per = len(rows) if busy else -(-len(rows) // self.n)
            bounds = [(a, min(a + per, len(rows))) for a in range(0, len(rows), per)]
            turns = [workers[(self._turn + k) % self.n] for k in range(len(bounds))]
            self._turn = (self._turn + len(bounds)) % self.n
        # Sent outside the lock: a full pipe must not hold up the other thread's batches or a block's return.
        for worker, (a, b) in zip(turns, bounds):
            tickets.append(worker.send((jid, block.name, a * row_bytes, example, dtype.str,
                                        job.refs(rows[a:b]), None if epochs is None else epochs[a:b], rows[a:b])))
        return Batch(out, y, tickets, bounds, repair)

    def _take(self, nbytes: int):
        """A block of ``nbytes``: a free one whose chunks are all answered (a batch dropped unread may still
        be written by its workers), else a new one."""
        free = self._free.get(max(nbytes, 1), [])
        for k, (block, tickets) in enumerate(free):
            if all(ticket.answered for ticket in tickets):
                return free.pop(k)[0]
        # Named after this process, so that a block in /dev/shm says whose it is (and its orphaned workers
        # find it: towers.data.orphans).
        block = untracked_block(f"{block_prefix(os.getpid())}{secrets.token_hex(4)}", create=True,
                                size=max(nbytes, 1))
        self._blocks.append(block)
        return block

    def _give_back(self, block, tickets) -> None:
        with self._lock:
            if self._closed:
                block.close()
            else:
                self._free.setdefault(block.size, []).append((block, tickets))

    def _started(self) -> list:
        """The workers, started on first use."""
        if self._pool is None:
            context = spawn_context()
            self._pool = [_Worker(context, self._jobs, os.getpid()) for _ in range(self.n)]
            # Workers never closed (a Python user without close()) still end, and their blocks are unlinked,
            # when this object is collected or the interpreter exits.
            self._finalizer = weakref.finalize(self, _release, self._pool, self._blocks)
        return self._pool

    def close(self) -> None:
        """Stop the workers and unlink every block (idempotent); blocks still viewed close when released."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
            free = [block for entries in self._free.values() for block, _ in entries]
            self._free = {}
        if pool is not None:
            self._finalizer.detach()
        _release(pool, self._blocks)
        for block in free:
            block.close()
        for job in self._jobs:
            job.close()


def _release(pool, blocks) -> None:
    """Stop the workers of ``pool`` (if any), then unlink ``blocks`` (no worker can attach one again)."""
    for worker in pool or ():
        worker.stop()
    for block in blocks:
        try:
            unlink(block)
        except FileNotFoundError:
            pass


class _Lease:
    """A batch array's owner: NumPy views of the batch keep it alive, and its collection returns the block.

    (An array made on ``block.buf`` itself would not do: NumPy points the
    views of such an array at the buffer, not at the array, so the array
    could be collected, and the block reused, while a view still reads it.)
    """

    def __init__(self, block, shape, dtype):
        probe = np.frombuffer(block.buf, np.uint8, count=1)
        address = probe.ctypes.data
        del probe  # no export of block.buf may stay: close() refuses while one exists
        self.block = block
        self.__array_interface__ = {"shape": tuple(shape), "typestr": np.dtype(dtype).str,
                                    "data": (address, False), "version": 3}
