"""The step engine: one synchronous step over every tower, and its weights-mode and parameter-server variants.

A step on one global batch of ``towers x batch_size x accumulate`` host
examples (or, with the training set on the GPUs, its row indices) runs four
named stages per tower:

1. stage:      the tower's contiguous slice onto its device (``Tower.compute``);
2. compute:    forward and backward into the tower's flat gradient buffer;
               with ``accumulate`` K > 1, stages 1-2 run once per micro-batch
               of ``batch_size`` rows and the buffer ends as their mean
               gradient (``Replica.mean_loss_and_grads``);
3. all-reduce: ``reducer.average`` over every tower's gradient buffer
               (``towers.parallel.reducers``);
4. update:     every replica applies the same optimizer update; the first
               one also updates the EMA in the same pass (``towers.optim``).

Who runs the stages is the *worker* layout, the one difference between the
two ways towers run:

* one worker owning every tower (GPU towers, whose stages are queued on their
  streams tower after tower; serial CPU towers): compute each tower, one
  reduce over whole buffers, update each tower;
* one worker per tower, concurrently on ``towers.devices.cpu_threads`` threads
  (CPU towers): worker i computes tower i, waits at a barrier, then reduces and
  updates slice i of EVERY tower's buffers, so the all-reduce and the update
  are split across cores.

Both call the same ``_work``.  ``weights`` mode skips stage 3; every
``average_every`` steps the weights, the optimizer state and the model
buffers are averaged instead and the EMA follows.  ``gradients`` and
``apply_gradients`` are stages 1-3 and 4 apart, for parameter servers
(``towers.cluster``).

Sync points: none inside a step on a GPU; with tower threads ``run`` returns
when tower 0's share is done and ``synchronize`` joins the rest.  The loss
leaves the device only when asked for (``want_loss``).

All-reduces are counted here, in ``_reduce``, the one place a step engine
calls its reducer over whole buffers (the threaded grads step counts its one
sliced all-reduce in ``run``): one per step, whatever ``accumulate``.
"""
from __future__ import annotations

import numpy

from towers.devices.cpu_threads import TowerThreads, chunks
from towers.devices.placement import to_host
from towers.errors import UserError
from towers.nn.context import TowerSync
from towers.parallel.sync import check_replicas
from towers.state import count


class StepEngine:
    """Runs steps over ``towers`` with ``reducer`` (see the module docstring).

    ``threads``: run each tower on its own thread (CPU towers; the reducer must
    be ``splittable``).  ``schedule(step)`` is the learning rate of the step
    after ``step`` updates.  ``timer`` is the run's ``PhaseTimer``.
    """

    def __init__(self, towers: list, reducer, ema, schedule, *, l2: float, weights_mode: bool,
                 average_every: int, timer, threads: bool = False, device_data=None, sync_bn: bool = False):
        self.towers, self.reducer, self.ema, self.schedule = towers, reducer, ema, schedule
        self.l2, self.weights_mode, self.average_every = l2, weights_mode, average_every
        self.timer, self.device_data = timer, device_data
        self.step = 0
        self.n_averages = 0  # weight averages so far: the EMA's count in weights mode
        self.last_average = None  # step count right after the last weight average
        self.all_reduces = 0  # collectives issued, for the communication report
        self._pool = None
        n = len(towers)
        if (threads or sync_bn) and n > 1:
            self._pool = TowerThreads(n)
            # A reducer that takes slices splits the all-reduce and the update
            # among the threads; else (NCCL, GPUs, across hosts) tower 0's thread
            # does both over whole buffers once every tower has its gradients.
            self._parts = (chunks(towers[0].replica.params.size, n) if reducer.splittable and threads
                           else [None] * n)
        if sync_bn and n > 1:
            mean = SyncMean(n, reducer, self._pool.barrier)
            for t in towers:
                t.replica.context.sync = mean.for_tower(t.index)
        self._losses = [None] * n

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    # -- one step ----------------------------------------------------------------------

    def run(self, x, y, want_loss: bool = False, indices=None):
        """One step on host batch ``x``, ``y`` (or device rows ``indices``); the towers' losses when ``want_loss``."""
        lr, step = self.schedule(self.step), self.step
        if self._pool is None:
            self._stage_indices(indices)
            self._work(range(len(self.towers)), None, x, y, indices, want_loss, lr, step)
        else:
            # The arguments are bound to this step's call, not stored on self:
            # without a barrier (weights mode) a late tower thread of the last
            # step could otherwise read this step's batch.
            self._pool.run(lambda i: self._work([i], self._parts[i], x, y, None, want_loss, lr, step, threaded=True))
            if not self.weights_mode and not self.reducer.noop:
                self.all_reduces += 1  # one all-reduce (shared out in slices among the threads)
            elif want_loss:
                self._pool.wait()  # no barrier in weights mode: wait for every tower's loss
        return self._step_done(list(self._losses) if want_loss else None)

    def _stage_indices(self, indices) -> None:
        if indices is not None:
            with self.timer("stage"):
                self.device_data.upload(indices)  # the step's indices: one copy per GPU

    def _work(self, mine, part, x, y, indices, want_loss, lr, step, threaded: bool = False) -> None:
        """A worker's share of a step: compute its towers; then reduce and update ``part`` of every tower.

        ``part`` None: whole buffers, by the worker that owns every tower or, on
        threads, by tower 0's after the barrier.
        """
        for i in mine:
            self._losses[i] = self._compute(i, x, y, indices, want_loss, step)
        if self.weights_mode:  # each tower steps alone; averages happen every K steps
            for i in mine:
                self.towers[i].update(self.towers[i].replica.grads, lr, step)
            return
        on = mine[0]
        if threaded:
            with self.timer("barrier", on):
                self._pool.barrier.wait()  # every tower's gradients are complete
            if part is None and on != 0:
                return  # tower 0's thread reduces and updates whole buffers
        if part is None and not threaded:
            self._reduce([t.replica.grads for t in self.towers], on)
        elif part is None:
            with self.timer("all-reduce", on):
                self.reducer.average([t.replica.grads for t in self.towers])
        else:
            grads = [t.replica.grads[part] for t in self.towers]
            with self.timer("all-reduce", on):
                self.reducer.average(grads)
        for t in self.towers:
            t.update(t.replica.grads if part is None else t.replica.grads[part], lr, step, part,
                     timer=None if part is None else self.towers[on].timer)

    def _compute(self, i: int, x, y, indices, want_loss: bool, step: int):
        """Tower ``i``'s slice (rows ``i*r .. (i+1)*r`` of the host batch, or of the device rows) through stages 1-2.

        ``r`` is the tower's ``rows``: ``batch_size`` x ``accumulate``, run as that many micro-batches.
        """
        t = self.towers[i]
        if indices is not None:
            return t.compute(None, None, self.l2, want_loss, step, stage=lambda k: self.device_data.stage(i, k))
        r = t.rows
        return t.compute(x[i * r: (i + 1) * r], y[i * r: (i + 1) * r], self.l2, want_loss, step)

    def _reduce(self, buffers: list, on: int = 0) -> None:
        """The reducer over whole buffers, counted."""
        if self.reducer.noop:
            return
        with self.timer("all-reduce", on):
            self.reducer.average(buffers)
        self.all_reduces += 1

    def _step_done(self, losses):
        self.step += 1
        # Weights mode: every K steps average the weights, then the EMA follows.
        if self.weights_mode and self.step % self.average_every == 0:
            self.average_weights()
        self.timer.step_done()
        return losses

    # -- parameter servers: stages 1-3 and 4 apart -----------------------------------

    def gradients(self, x, y, want_loss: bool = False):
        """Stages 1-3 without the update: every tower's ``grads`` ends as the mean gradient."""
        self.synchronize()
        if self._pool is not None and self.towers[0].replica.context.sync is not None:
            raise UserError("`sync_bn` averages batch statistics inside a synchronous step of one host's towers: "
                            "not with a parameter server")
        losses = [self._compute(i, x, y, None, want_loss, self.step) for i in range(len(self.towers))]
        self._reduce([t.replica.grads for t in self.towers])
        return losses if want_loss else None

    def apply_gradients(self, grads) -> None:
        """Stage 4 with given mean gradients (one host array): every replica's update, then the step ends."""
        self.synchronize()
        lr, step = self.schedule(self.step), self.step
        for t in self.towers:
            with t.scope():
                t.replica.grads[...] = t.device.xp.asarray(grads)
            t.update(t.replica.grads, lr, step)
        self._step_done(None)

    # -- weights mode ------------------------------------------------------------------

    def average_weights(self) -> None:
        """Average parameters, optimizer state and model buffers over the towers, then update the EMA."""
        if self._pool is not None:
            self._pool.wait()  # the tower threads' updates are complete
        reps = [t.replica for t in self.towers]
        self._reduce([r.params for r in reps])
        for slot in self.towers[0].optimizer.state:
            self._reduce([t.optimizer.state[slot] for t in self.towers])
        if reps[0].buffers.size:
            self._reduce([r.buffers for r in reps])
        self.n_averages += 1
        with self.towers[0].scope():
            self.ema.update(reps[0].params, self.n_averages - 1)
        self.last_average = self.step

    def finish(self) -> None:
        """End of training: in weights mode, a last average if steps were taken since."""
        if self.weights_mode and self.last_average != self.step:
            self.average_weights()

    def agreed(self) -> None:
        """The replicas were just set to one value (a load, ``set_weights``): the next check compares against it."""
        self.last_average = self.step

    # -- keeping replicas together --------------------------------------------------------

    def check_replicas(self) -> bool:
        """Compare replicas now if they are meant to agree; return whether it ran."""
        if self.weights_mode and self.last_average != self.step:
            return False  # between averages replicas differ by design
        self.synchronize()
        atol = 0.0
        if self.weights_mode:  # an average leaves them equal up to the reducer's rounding
            atol = 1e-6 * max(1.0, float(abs(to_host(self.towers[0].replica.params)).max()))
        check_replicas([t.replica for t in self.towers], self.step, atol)
        return True

    def synchronize(self) -> None:
        """Host sync point: tower threads and GPU streams finish what was issued."""
        if self._pool is not None:
            self._pool.wait()
        for t in self.towers:
            if t.stream is not None:
                t.stream.synchronize()

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"step": numpy.int64(self.step), "sync/n_averages": numpy.int64(self.n_averages)}

    def prepare(self, state: dict, where: str):
        """Check ``step`` and ``sync/n_averages``; return the function that sets them."""
        step = count(state, "step", where)
        n_averages = count(state, "sync/n_averages", where) if "sync/n_averages" in state else 0

        def apply():
            self.step, self.n_averages = step, n_averages
            # Checkpoints are taken right after an average (weights mode) or hold
            # every replica's identical weights (grads mode).
            self.last_average = step
        return apply

    def close(self) -> None:
        """Stop the tower threads (idempotent)."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()


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
    indices = numpy.asarray(indices)
    if len(indices) != global_batch or not numpy.issubdtype(indices.dtype, numpy.integer) or (
            int(indices.min()) < 0 or int(indices.max()) >= n):  # the gather kernel does not check
        raise UserError(f"train_step_at takes one global batch of {global_batch} row numbers in "
                        f"0..{n - 1}, got {len(indices)} {indices.dtype} values")
    return indices
