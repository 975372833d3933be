"""The step engine: one synchronous step over every tower, read top to bottom in ``run`` and ``_work``.

The phases and how each runs are docs/architecture.md's "What a step does".  A step on one global batch of
``towers x batch_size x accumulate`` host examples (or their row indices, with the training set on the GPUs)
runs, per tower: 1. stage (``run`` uploads the device rows once; ``Tower.compute`` takes its slice);
2. forward and backward into the flat gradient buffer (K micro-batches with ``accumulate``:
``Replica.mean_loss_and_grads``); 3. the keeper's ``average`` (``towers.parallel.sync``) returns the buffers
each tower's update applies, or None to skip the update (gradient buckets: issued inside phase 2 through
the keeper's ``buckets()`` hooks, ``towers.parallel.overlap``); 4. each tower's ``update`` (none for a tower
sharing another's parameter buffer: ``Tower.shares_params``); 5. EMA: fused into tower 0's update in grads
mode, else the keeper's ``step_done``.

Who runs phases 1-4 is the *worker* layout:

* one worker owning every tower (GPU towers, queued on their streams tower after tower; serial CPU
  towers): compute each tower, then average and update whole buffers;
* one worker per tower on ``towers.devices.cpu_threads`` threads (CPU towers; every tower with
  ``sync_bn``): worker i computes tower i; with a ``shared`` keeper it waits at a barrier, then averages
  and updates slice i of EVERY tower's buffers (a reducer or keeper that does not split -- NCCL, fp16's
  -- leaves both to tower 0's thread over whole buffers); a keeper that is not shared averages and
  updates the worker's own tower.

Both call ``_work(mine, step)`` with a ``Step`` made per call and bound to it, so a late tower thread of
the last step reads its own step's inputs (and, on GPUs, its own upload of the row indices:
``Step.staged``).  ``gradients`` is phases 1-3 alone, for a parameter server's hosts
(``towers.cluster.ps``).

Sync points: none inside a step on a GPU without ``sync_bn`` (fp16: the finite check of the averaged
gradient is read back); with tower threads, host barriers inside the step (after compute, and two per
batch-norm layer with ``sync_bn``); ``run`` returns when tower 0's share is done and ``synchronize``
joins the rest (so do a step the keeper averages weights at, ``averages_at``, and ``finish``;
``want_loss`` with a keeper that is not shared joins them at once).  The loss leaves the device only
when asked for (``want_loss``).

All-reduces are counted once, by the keeper's ``Counted`` reducer (``all_reduces``): one per step in
grads mode, whatever ``accumulate`` (a sliced all-reduce counts at slice 0), or one per bucket range;
one per averaged buffer in weights mode; sync-BN's statistic averages are not counted.
"""
from __future__ import annotations

import dataclasses

import numpy

from towers.arrays import check_host
from towers.devices.cpu_threads import TowerThreads, chunks
from towers.errors import UserError
from towers.nn.context import TowerSync
from towers.parallel.sync import check_replicas
from towers.state import count
from towers.step.tower import QUIET


@dataclasses.dataclass(frozen=True)
class Step:
    """One step's inputs, as every worker of the step reads them.

    ``x``, ``y``: the host batch (None with ``staged``, the handle of the
    step's rows on the devices, ``DeviceData.upload``); ``lr``: its learning
    rate; ``step``: updates done before it; ``want_loss``: whether the towers'
    losses are kept; ``loss_scale``: the keeper's loss scale when the step
    began (fp16: ``towers.optim.loss_scale``; else 1); ``buckets``: the
    keeper's progress of the gradient buckets averaged during this step's
    backward (``towers.parallel.overlap``; None: averaged after compute).
    Made per call: a tower thread of the last step still running holds its own.
    """

    x: object
    y: object
    staged: object
    want_loss: bool
    lr: float
    step: int
    loss_scale: float = 1.0
    buckets: object = None


class StepEngine:
    """Runs steps over ``towers``; ``keeper`` keeps their replicas together (see the module docstring).

    ``threads``: run each tower on its own thread (CPU towers; the keeper's
    reducer must be ``splittable``).  ``schedule(step)`` is the learning rate
    of the step after ``step`` updates.  ``timer`` is the run's ``PhaseTimer``.
    """

    def __init__(self, towers: list, keeper, schedule, *, l2: float, timer, threads: bool = False,
                 device_data=None, sync_bn: bool = False, nccl_timeout: float = 0.0):
        self.towers, self.schedule = towers, schedule
        self.forms = towers[0].forms  # which forms of the ops the towers run (one choice per run: build_towers)
        self.nccl_timeout = nccl_timeout  # host sync points poll NCCL this long (0: they wait as CUDA does)
        self.keeper = keeper
        self.l2, self.timer, self.device_data = l2, timer, device_data
        self.step = 0
        self._pool = None
        n = len(towers)
        # The gradient buckets, if the keeper averages them during backward (before any thread starts).
        keeper.bind(towers, (threads or sync_bn) and n > 1)
        if (threads or sync_bn) and n > 1:
            self._pool = TowerThreads(n)
            # A reducer that takes slices splits the all-reduce and the update
            # among the threads; else (NCCL, GPUs, across hosts) tower 0's thread
            # does both over whole buffers once every tower has its gradients.
            self._parts = (chunks(towers[0].replica.params.size, n)
                           if keeper.reducer.splittable and keeper.splits and threads else [None] * n)
        if sync_bn and n > 1:
            # The wrapped reducer: batch statistics are not counted as all-reduces.
            mean = SyncMean(n, keeper.reducer.reducer, self._pool.barrier)
            for t in towers:
                t.replica.context.sync = mean.for_tower(t.index)
        self._losses = [None] * n

    @property
    def keeper(self):
        return self._keeper

    @keeper.setter
    def keeper(self, keeper) -> None:
        """The keeper; refused when the towers share a parameter buffer and it updates replicas apart."""
        if not keeper.same_updates and any(t.shares_params for t in self.towers):
            raise ValueError(f"{type(keeper).__name__} does not apply the same update to every replica, but these "
                             "CPU towers share one parameter buffer: build them with share=False")
        self._keeper = keeper

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    @property
    def all_reduces(self) -> int:
        """Collectives issued, for the communication report."""
        return self.keeper.reducer.count

    # -- one step ----------------------------------------------------------------------

    def run(self, x, y, want_loss: bool = False, indices=None):
        """One step on host batch ``x``, ``y`` (or device rows ``indices``); the towers' losses when ``want_loss``."""
        with self.forms.active():  # this run's forms of the ops (tower threads run in a copy of this context)
            # 1. stage: the step's device rows go up once, before any tower gathers
            # its slice (GPU towers on threads too: sync-BN runs them on the pool).
            # ``staged`` names this step's index buffers: a tower thread of the
            # last step that is still running reads its own step's, not these.
            s = Step(x, y, self._stage_indices(indices), want_loss, self.schedule(self.step), self.step,
                     self.keeper.loss_scale, self.keeper.buckets())
            # 1-4 by each worker (its module doc).
            if self._pool is None:
                self._work(range(len(self.towers)), s)
            else:
                # The step is bound to this call, not stored on self: without a
                # barrier (a keeper that is not shared) a late tower thread of the
                # last step could otherwise read this step's batch.
                self._pool.run(lambda i: self._work([i], s))
                if want_loss and not self.keeper.shared:
                    self._pool.wait()  # no barrier: wait for every tower's loss
            # 5. the keeper's end of a step (weights mode: every K steps the weights' average, then the EMA).
            return self._step_done(list(self._losses) if want_loss else None)

    def _stage_indices(self, indices):
        """Send a step's device rows (one copy per GPU); the handle of their buffers, or None for a host batch."""
        if indices is None:
            return None
        with self.timer("stage"):
            return self.device_data.upload(indices)

    def _work(self, mine, s: Step) -> None:
        """A worker's share of step ``s``: phases 1-4 for its towers ``mine`` (the module doc)."""
        on = mine[0]
        for i in mine:  # 1-2. stage, forward and backward
            self._losses[i] = self._compute(i, s)
        with numpy.errstate(**QUIET):  # an overflow (fp16's skipped steps, a diverging run) is reported, not warned
            towers, part = self._share(mine)
            if not towers:
                return  # tower 0's thread averages and updates whole buffers
            grads = self.keeper.average(towers, part, on, s.buckets)  # 3. average (the keeper's strategy)
            if grads is None:
                return  # skipped (fp16's overflow): no update, no EMA
            timer = None if part is None else self.towers[on].timer  # a slice: on this worker's timer
            for t, g in zip(towers, grads):  # 4. update (grads mode: tower 0's fuses the EMA)
                t.update(g, s.lr, s.step, part, timer=timer)

    def _share(self, mine) -> tuple[list, slice | None]:
        """The towers whose buffers worker ``mine`` averages and updates, and its slice ``part`` of them.

        A keeper that is not ``shared``: the worker's own towers, whole.  A
        shared one: every tower, after the barrier on tower threads (every
        tower's gradients complete); the worker's slice of the buffers, or
        whole buffers (the one worker; on threads tower 0's, the others none).
        """
        on = mine[0]
        if not self.keeper.shared:
            return [self.towers[i] for i in mine], None
        if self._pool is None:  # one worker owns every tower
            return self.towers, None
        with self.timer("barrier", on):
            self._pool.barrier.wait()
        part = self._parts[on]
        return ([], None) if part is None and on != 0 else (self.towers, part)

    def _compute(self, i: int, s: Step):
        """Tower ``i``'s slice (rows ``i*r .. (i+1)*r`` of the host batch, or of the device rows) through phases 1-2.

        ``r`` is the tower's ``rows``: ``batch_size`` x ``accumulate``, run as that many micro-batches.
        """
        t = self.towers[i]
        ready = s.buckets.hook(i) if s.buckets is not None else None
        if s.staged is not None:
            return t.compute(None, None, self.l2, s.want_loss, s.step,
                             stage=lambda k: self.device_data.stage(i, k, s.staged), loss_scale=s.loss_scale,
                             ready=ready)
        r = t.rows
        return t.compute(s.x[i * r: (i + 1) * r], s.y[i * r: (i + 1) * r], self.l2, s.want_loss, s.step,
                         loss_scale=s.loss_scale, ready=ready)

    def _step_done(self, losses):
        self.step += 1
        if self.keeper.averages_at(self.step):
            self._wait_threads()  # the keeper reads every tower's buffers
        with numpy.errstate(**QUIET):
            self.keeper.step_done(self.towers, self.step)
        self.timer.step_done()
        return losses

    # -- a parameter server's host: phases 1-3 without the update (a GradientAveraging keeper) -------

    def gradients(self, x, y, want_loss: bool = False):
        """Phases 1-3 without the update: every tower's ``grads`` ends as the keeper's average (grads mode: the
        mean gradient, which the server applies: ``towers.cluster.ps``); the step count does not move."""
        with self.forms.active():  # this run's forms of the ops (tower threads run in a copy of this context)
            self.synchronize()
            if self._pool is not None and self.towers[0].replica.context.sync is not None:
                raise UserError("`sync_bn` averages batch statistics inside a synchronous step of one host's towers: "
                                "not with a parameter server")
            s = Step(x, y, None, want_loss, self.schedule(self.step), self.step)
            losses = [self._compute(i, s) for i in range(len(self.towers))]
            with numpy.errstate(**QUIET):
                self.keeper.average(self.towers, None, 0)
            return losses if want_loss else None

    # -- keeping replicas together --------------------------------------------------------

    def finish(self) -> None:
        """End of training (weights mode: a last average if steps were taken since)."""
        with self.forms.active():  # this run's forms of the ops (tower threads run in a copy of this context)
            self._wait_threads()
            with numpy.errstate(**QUIET):
                self.keeper.finish(self.towers, self.step)

    def agreed(self) -> None:
        """The replicas were just set to one value (a load, ``set_weights``): the next check compares against it."""
        self.keeper.agreed(self.step)

    def check_replicas(self) -> bool:
        """Compare replicas now if the keeper means them to agree; return whether it ran."""
        if not self.keeper.comparable(self.step):
            return False
        self.synchronize()
        check_replicas([t.replica for t in self.towers], self.step, self.keeper.atol(self.towers[0].replica.params))
        return True

    def _wait_threads(self) -> None:
        if self._pool is not None:
            self._pool.wait()

    def synchronize(self) -> None:
        """Host sync point: tower threads and GPU streams finish what was issued (with ``nccl_timeout``, the
        all-reduces polled first for NCCL's asynchronous errors: ``Reducer.wait``)."""
        self._wait_threads()
        if self.nccl_timeout:
            self.keeper.reducer.wait(self.nccl_timeout)
        for t in self.towers:
            if t.stream is not None:
                t.stream.synchronize()

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"step": numpy.int64(self.step), **self.keeper.state_dict()}

    def prepare(self, state: dict, where: str):
        """Check ``step`` and the keeper's keys (``sync/n_averages``); return the function that sets them."""
        step = count(state, "step", where)
        set_keeper = self.keeper.prepare(state, where)

        def apply():
            self.step = step
            set_keeper(step)
        return apply

    def close(self) -> None:
        """Stop the tower threads and the keeper's (idempotent)."""
        try:
            if self._pool is not None:
                pool, self._pool = self._pool, None
                pool.close()
        finally:
            self.keeper.close()


class SyncMean:
    """Sync-BN's cross-tower average: ``for_tower(i).average(array)`` averages a small array in place over the towers.

    Every tower's thread calls it at the same point of its forward or
    backward pass (``towers.nn.context``); the first barrier waits for every
    tower's array, tower 0's thread averages them with the step's reducer
    (a device mean, NCCL), the second barrier hands them back.  Sync points:
    two barriers per call; a tower's error breaks them (``TowerThreads``).
    """

    def __init__(self, n: int, reducer, barrier):
        self.reducer, self.barrier = reducer, barrier
        self.arrays = [None] * n

    def for_tower(self, i: int) -> TowerSync:
        return TowerSync(lambda array: self(i, array), i, len(self.arrays))

    def __call__(self, i: int, array) -> None:
        self.arrays[i] = array
        self.barrier.wait()
        if i == 0:
            self.reducer.average(self.arrays)
        self.barrier.wait()


def check_indices(indices, global_batch: int, n: int):
    """``indices`` as host ints if they are one global batch of rows of an ``n``-row set, else a ``UserError``."""
    check_host(indices, "train_step_at: the row numbers")
    indices = numpy.asarray(indices)
    if len(indices) != global_batch or not numpy.issubdtype(indices.dtype, numpy.integer) or (
            int(indices.min()) < 0 or int(indices.max()) >= n):  # the gather kernel does not check
        raise UserError(f"train_step_at takes one global batch of {global_batch} row numbers in "
                        f"0..{n - 1}, got {len(indices)} {indices.dtype} values")
    return indices
