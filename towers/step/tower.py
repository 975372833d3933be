"""A tower: one model replica on its device, with everything that works on it.

``Tower`` holds its device and stream, the forms its ops run (``towers.ops.forms``:
compiled CPU loops or NumPy's passes, cuDNN or im2col, the GEMM binding), its
replica (flat parameter, gradient and buffer arrays; ``towers.nn.replica``),
its stager (its slice of the batch onto the device; ``towers.data.staging``),
its optimizer and its phase timer; its ``scope`` makes the device, the stream
and the forms current.  ``build_towers`` makes them for a placement: the forms
chosen once for all of them, every replica from the same seeded values,
towers sharing a GPU sharing its stream.

``ModelState`` is the model's part of a state dict: the weights
(``params/<name>``) and the non-trainable buffers (``buffers/<name>``), read
from the first replica and written to every replica, because every replica holds
the same values when a state is taken (right after an average in weights mode);
a parameter server's one replica (``towers.cluster.ps``) has one too.

"""
from __future__ import annotations

import contextlib

import numpy

from towers.data.staging import Stager
from towers.devices.cuda_graphs import StepGraphs
from towers.devices.placement import on_stream
from towers.errors import UserError
from towers.nn.replica import Replica
from towers.ops import forms as op_forms
from towers.state import Layout, under

# A diverging run overflows to inf/NaN: the loop reports it as one line at the
# next loss check, so NumPy's RuntimeWarnings are noise.
QUIET = dict(over="ignore", invalid="ignore", divide="ignore")


class Tower:
    """One tower: device, stream, replica, stager, optimizer (set by the trainer), timer."""

    def __init__(self, index: int, device, stream, replica: Replica, stager: Stager, timer, accumulate: int = 1,
                 global_index: int | None = None, shares_params: bool = False, graphs=None,
                 forms: op_forms.Forms = op_forms.NUMPY):
        self.index, self.device, self.stream = index, device, stream
        self.forms = forms  # the forms its ops run (``towers.ops.forms``), current in its ``scope``
        # A GPU tower's CUDA graphs of its forward and backward (``cuda_graphs``), or None: eager steps.
        self.graphs = graphs
        self.replica, self.stager, self.timer = replica, stager, timer
        self.accumulate = accumulate  # micro-batches per step
        self.optimizer = None
        # Its replica's parameters are an earlier tower's buffer (``build_towers``): that tower's update is its own.
        self.shares_params = shares_params
        self.global_index = index if global_index is None else global_index  # among every host's towers

    @property
    def rows(self) -> int:
        """Examples of one step on this tower: ``accumulate`` micro-batches of the stager's size."""
        return self.stager.x.shape[0] * self.accumulate

    @contextlib.contextmanager
    def scope(self):
        """This tower's device, stream and forms current, NumPy's overflow warnings off."""
        with self.device.scope(), on_stream(self.stream), self.forms.active(), numpy.errstate(**QUIET):
            yield

    def compute(self, x, y, l2: float, want_loss: bool, step: int, stage=None, loss_scale: float = 1.0,
                ready=None):
        """Phases 1-2 over the tower's ``accumulate`` micro-batches: each onto the device, forward, backward.

        ``x``, ``y``: the tower's ``rows`` host examples, micro-batch k being
        rows ``k*B .. (k+1)*B``; or ``stage(k)`` puts micro-batch k on the
        device.  The gradient is the micro-batches' mean
        (``Replica.mean_loss_and_grads``).  Dropout draws each micro-batch's
        masks as a tower of its own (draw index ``tower * K + k``, which is
        the tower's index when K = 1).  ``step``: updates done so far (the
        layers' step context).  ``loss_scale``: what the loss's gradient is
        multiplied by (fp16's loss scaling; the gradient comes out scaled).
        ``ready(layer)``: told during the last micro-batch's backward that the
        gradients of ``layer`` and every later layer are final
        (``Replica.mean_loss_and_grads``).  With ``graphs`` (one micro-batch,
        no ``ready``: ``cuda_graphs``' limits) the staged batch runs through
        them (``towers.devices.cuda_graphs``).
        Returns the mean loss as a device scalar when ``want_loss``, else None.
        """
        with self.scope():
            self.replica.start_step(step)
            if self.graphs is None:
                return self.replica.mean_loss_and_grads(self._micro_batches(x, y, stage), self.accumulate, l2,
                                                        want_loss, self.timer, loss_scale, ready)
            if self.accumulate != 1 or ready is not None:
                raise ValueError("CUDA graphs run one micro-batch a step, without gradient buckets")
            batch = next(self._micro_batches(x, y, stage))

            def forward_backward(xb, yb, timer):  # the loss always: one graph for steps with and without it
                # (no training accuracy: its count would be one more array for the graph to keep)
                return self.replica.mean_loss_and_grads(((xb, yb),), 1, l2, True, timer, loss_scale,
                                                        count_correct=False)

            return self.graphs.run((loss_scale, l2), batch, forward_backward, self.timer, want_loss)

    def _micro_batches(self, x, y, stage):
        b, k_all, ctx = self.stager.x.shape[0], self.accumulate, self.replica.context
        for k in range(k_all):
            ctx.tower = self.global_index * k_all + k
            with self.timer("stage"):
                batch = stage(k) if stage is not None else self.stager.stage(x[k * b: (k + 1) * b],
                                                                              y[k * b: (k + 1) * b])
            yield batch

    def update(self, grads, lr: float, step: int, part: slice | None = None, timer=None) -> None:
        """Phase 4: this replica's optimizer step (``part``: a slice of the flat buffers, CPU only).

        Nothing for a tower that ``shares_params``: the owner's step updated the buffer they share.
        """
        if self.shares_params:
            return
        with self.scope(), (timer or self.timer)("update+EMA"):
            self.optimizer.step(grads, lr, step, part)

    def __str__(self) -> str:
        return str(self.device)


def choose_forms(cfg, model, devices) -> op_forms.Forms:
    """The forms of the ops (``towers.ops.forms.choose``) for ``model``'s towers on ``devices``, from a run's
    settings (``cpu_kernels``, ``gpu_conv``, ``cuda_graphs``: a ``Config``, or a checkpoint's settings as
    attributes).  The one choice of ``build_towers`` and of a loaded run (``towers.inference.Predictor``, one
    tower)."""
    gpus = [d for d in devices if d.is_gpu]
    return op_forms.choose(cfg.cpu_kernels, model, len(gpus) < len(devices), cfg.gpu_conv, gpus[0] if gpus else None,
                           cuda_graphs=cfg.cuda_graphs and bool(gpus))


def build_towers(placement, model, dataset, cfg, timer, first_tower: int = 0, share: bool = False) -> list[Tower]:
    """One tower per placed device, replicas identical (one seeded draw), streams per GPU.

    ``first_tower``: the global index of this host's first tower (dropout masks
    are drawn per global tower).  ``share``: the keeper applies the same update
    to every replica (``Keeping.same_updates``), so CPU towers share the first
    CPU tower's parameter buffer and only that tower's optimizer steps.
    With ``cuda_graphs`` each GPU tower gets its ``StepGraphs``
    (``towers.devices.cuda_graphs``); a model that draws on the host each
    step (dropout) is refused.
    """
    batch_size, seed = cfg.batch_size, cfg.seed
    init = model.init_params(seed)
    streams: dict[int, object] = {}
    # The towers' forms of the ops (towers.ops.forms): on host arrays, the GPU towers' convolutions and GEMM
    # binding; chosen once here.  numba's kernels are loaded and cuDNN started now, not inside the first step.
    gpus = [d for d in placement.towers if d.is_gpu]
    graphs = cfg.cuda_graphs and bool(gpus)  # (CPU towers run eagerly: the setting is for GPU towers)
    if cfg.cuda_graphs and any(layer.draws_on_host() for layer in model.layers):
        raise UserError("`cuda_graphs` replays each GPU step as it was captured, but dropout draws new masks on the "
                        "host every step: drop `cuda_graphs` (or the dropout layers)")
    forms = choose_forms(cfg, model, placement.towers)
    # ``share`` (a keeper whose replicas apply the same update to the same
    # weights: grads mode): CPU towers (one process's memory) share the first
    # CPU tower's parameter buffer, and its optimizer step is the only one: the
    # update, the EMA and their memory traffic once, not once per tower.
    cpu_params = None
    towers = []
    for i, dev in enumerate(placement.towers):
        with dev.scope():
            # Non-blocking streams are not ordered with the legacy default
            # stream, so all of a tower's work stays inside its stream.  Towers
            # sharing a GPU share its stream: CuPy drives cuBLAS through one
            # handle per device, whose default workspace is not safe for GEMMs
            # running concurrently on two streams.
            stream = None
            if dev.is_gpu:
                stream = streams.get(dev.index) or dev.xp.cuda.Stream(non_blocking=True)
                streams[dev.index] = stream
            shares = share and not dev.is_gpu and cpu_params is not None
            replica = Replica(model, dev.xp, label_smoothing=cfg.label_smoothing, params=cpu_params if shares else None,
                              precision=cfg.precision)
            if share and not dev.is_gpu and cpu_params is None:
                cpu_params = replica.params
            replica.set_params(init)
            replica.context.tower, replica.context.seed = first_tower + i, seed
        stager = Stager(dev, stream, batch_size, dataset.example_shape, dataset.x.dtype, cfg.input_scale)
        towers.append(Tower(i, dev, stream, replica, stager, timer.for_tower(i), cfg.accumulate,
                            first_tower + i, shares_params=shares, forms=forms,
                            graphs=StepGraphs(stream, replica.context.scalars, replica.reset_workspaces,
                                              f"tower {i} ({dev})") if graphs and dev.is_gpu else None))
    return towers


class ModelState:
    """The model's state over every replica: ``params/<name>`` and ``buffers/<name>``.

    ``scopes``: one context per replica in which its copies are queued (a
    tower's ``scope``: its device and stream); none: the replicas are host arrays.
    """

    def __init__(self, replicas: list[Replica], model, scopes=None):
        self.replicas = replicas
        self.scopes = scopes or [contextlib.nullcontext] * len(replicas)
        self.weights = Layout(model.layout())
        self.buffers = Layout(model.buffer_layout(), model.minimums())

    def state_dict(self) -> dict:
        r = self.replicas[0]
        return {**self.weights.split(r.params, "params/"), **self.buffers.split(r.buffers, "buffers/")}

    def named(self, params=None) -> dict:
        """{name: host array}: the weights (``params``: another flat buffer of them, e.g. the EMA's), then the buffers."""
        r = self.replicas[0]
        return {**self.weights.split(r.params if params is None else params), **self.buffers.split(r.buffers)}

    def read_named(self, named: dict, where: str, buffers_optional: bool = False):
        """(weights flat, buffers flat or None) from {name: array}: exactly the model's names, else a ``UserError``."""
        if not isinstance(named, dict):
            raise UserError(f"{where}: give a dict of name -> array, got {type(named).__name__}")
        bnames = set(self.buffers.names)
        weights = {k: v for k, v in named.items() if k not in bnames}
        bufs = {k: v for k, v in named.items() if k in bnames}
        w = self.weights.join(self.weights.check(weights, where))
        if not bufs and (buffers_optional or not bnames):
            return w, None
        return w, self.buffers.join(self.buffers.check(bufs, where, "buffer"))

    def set_named(self, named: dict, where: str, ema=None, ema_scope=contextlib.nullcontext) -> None:
        """Every replica's weights and buffers from {name: array}, checked as ``read_named`` checks them; with
        ``ema`` (an ``EMA``) its weights instead, copied in ``ema_scope`` (its device's), and the buffers, which
        are then optional, when given."""
        flat, buffers = self.read_named(named, where, buffers_optional=ema is not None)
        if ema is None:
            self.set(flat, buffers)
            return
        with ema_scope():
            ema.set_state(flat)
        self.set(None, buffers)  # the buffers, when given, are every replica's

    def prepare(self, state: dict, where: str):
        """Check ``params/`` and ``buffers/`` of ``state``; return the function that sets every replica."""
        named = under(state, "params")
        if not named:
            raise UserError(f"{where}: no params/ weights")
        w = self.weights.join(self.weights.check(named, f"{where} (params)"))
        b = None
        if self.buffers.rows:
            b = self.buffers.join(self.buffers.check(under(state, "buffers"), f"{where} (buffers)", "buffer"))
        elif under(state, "buffers"):
            raise UserError(f"{where}: {next(iter(under(state, 'buffers')))!r} is not a buffer of this model")
        return lambda: self.set(w, b)

    def set(self, weights, buffers=None) -> None:
        """Every replica's weights and buffers from host flat arrays (None: left as they are).

        The copies are queued on each tower's stream (its scope), so the
        tower's next step reads the new values: its stream is not ordered with
        CuPy's legacy default stream.
        """
        for r, scope in zip(self.replicas, self.scopes):
            with scope():
                if weights is not None:
                    r.set_params(weights)
                if buffers is not None:
                    r.set_buffers(buffers)
