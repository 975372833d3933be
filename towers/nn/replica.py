"""One replica (tower) of the model on its device: flat buffers, forward, backward.

A replica owns two contiguous buffers on its device, one for all trainable
parameters and one for all gradients; named parameters are views into them,
so the all-reduce and the optimizer each touch one array per step.
L2-regularized parameters come first in the buffer so that the L2 term and
its gradient are one operation on a contiguous prefix.  A third flat buffer
holds the model's buffers (non-trainable state such as batch norm's moving
statistics; often empty), which layers update in place while training.

``context`` (``towers.nn.context.StepContext``) tells the layers whether they
train, the step, the tower, the seed and the sync-BN callable;
``loss_and_grads`` runs in training mode, ``forward`` (by default),
``evaluate`` and ``predict`` in evaluation mode.

Low precision (``precision`` bf16 or fp16, ``--precision``): the float32
parameter buffer stays the master copy the optimizer and the EMA update; a
training step computes on a copy of it rounded to the format (a fourth flat
buffer, rounded once per step), on its input rounded, with every top-level
layer's output and every gradient passed between layers in backward rounded
in place, and with the parameter gradients rounded as backward leaves them
(``towers.ops.precision``); sums and products run in float32 between those
roundings, as tensor cores accumulate.  So on the CPU the step computes what a
GPU holding those values in bf16/fp16 computes, up to the order of its float32
sums.  The loss and its gradient (softmax cross-entropy) are float32 from the
rounded logits; L2's gradient is added in float32 from the masters.  Layers
inside a residual block compute in float32 between the block's rounded input
and output.  Evaluation and prediction use the float32 masters.
"""
from __future__ import annotations

import contextlib
import functools

import numpy

from towers.arrays import to_host
from towers.data.dataset import input_scale
from towers.nn.context import StepContext
from towers.nn.layers import Sequential, Workspace
from towers.nn.loss import accuracy_count, softmax_cross_entropy, top_k_count
from towers.ops.l2 import add_scaled
from towers.ops.precision import PRECISIONS, round_to

EVAL_CHUNK_BYTES = 256 << 20  # float32 examples per chunk of evaluation and prediction, at most (one at least)


# Evaluation reports top-5 accuracy too for models of more classes than this (top-5 of 10 says little).
TOP5_CLASSES = 10


class Replica:
    """One tower's copy of the model: flat parameter, gradient and buffer arrays on a device.

    ``params`` and ``grads`` are contiguous 1-D arrays; ``param[name]`` and
    ``grad[name]`` are views into them; ``buffers`` and ``buffer[name]`` the
    same for the buffers, set to the model's initial values.  All arrays live
    on ``xp`` (NumPy or CuPy; for CuPy the caller makes the right device
    current).  ``label_smoothing`` applies to the training loss only.
    ``params``, when given, is the parameter buffer to use (another
    replica's: the two then share their weights); gradients and buffers are
    always the replica's own.  ``precision``: the format a training step
    computes in (module doc; ``fp32``: the masters themselves).  ``input_scale``: the setting that says what
    ``evaluate`` and ``predict`` multiply uint8 examples by (``towers.data.dataset.input_scale``).
    """

    def __init__(self, model: Sequential, xp, dtype=numpy.float32, label_smoothing: float = 0.0, params=None,
                 precision: str = "fp32"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
        if precision != "fp32" and numpy.dtype(dtype) != numpy.float32:
            raise ValueError(f"precision {precision} rounds float32 masters, not {numpy.dtype(dtype)}")
        self.model, self.xp, self.dtype = model, xp, numpy.dtype(dtype)
        self.precision = precision
        self.input_scale = "1/255"
        self.label_smoothing = float(label_smoothing)
        self.context = StepContext()
        if params is not None and (params.shape != (model.size,) or params.dtype != self.dtype
                                   or not params.flags.c_contiguous):
            raise ValueError(f"a shared parameter buffer must be a contiguous ({model.size},) {self.dtype} array, "
                             f"got {params.shape} {params.dtype}")
        # ``params``: another replica's buffer, shared (CPU towers in grads mode, towers.step.tower).
        self.params = params if params is not None else xp.zeros(model.size, dtype=self.dtype)
        self.grads = xp.zeros(model.size, dtype=self.dtype)
        self.buffers = xp.asarray(model.init_buffers(), dtype=self.dtype)
        self.param, self.grad, self.buffer = {}, {}, {}
        for name, shape, off, size in model.layout():
            # copy=False raises rather than silently copying: the views must alias.
            self.param[name] = self.params[off : off + size].reshape(shape, copy=False)
            self.grad[name] = self.grads[off : off + size].reshape(shape, copy=False)
        for name, shape, off, size in model.buffer_layout():
            self.buffer[name] = self.buffers[off : off + size].reshape(shape, copy=False)
        self._nreg = model.n_regularized
        self._first_param_layer = min((li for li, _, prm in model.params if prm.trainable), default=0)
        self._spans = model.layer_spans()  # per layer, its ranges of the flat buffers
        self._local = []  # per layer: (params and buffers dict, grads dict, workspace)
        by_layer: dict[int, list[tuple[str, str, bool]]] = {}
        for li, name, prm in model.params:
            by_layer.setdefault(li, []).append((prm.name, name, prm.trainable))
        views = {**self.param, **self.buffer}
        # Low precision: the rounded copy of the weights the training step's layers read (module doc).
        self._low = None if precision == "fp32" else xp.zeros(model.size, dtype=self.dtype)
        low_views = views if self._low is None else {**self._views(self._low), **self.buffer}
        self._train_params = []  # per layer: the parameters and buffers a training step reads
        self._grad_names = []  # per layer: (its name of a gradient, the model's name)
        for li in range(len(model.layers)):
            names = by_layer.get(li, [])
            self._grad_names.append([(k, n) for k, n, trainable in names if trainable])
            self._local.append(
                (
                    {k: views[n] for k, n, _ in names},
                    {k: self.grad[n] for k, n in self._grad_names[li]},
                    Workspace(xp, self.context, (li,)),
                )
            )
            self._train_params.append({k: low_views[n] for k, n, _ in names})
        self._input = None  # low precision: the rounded copy of a micro-batch's input
        self._loss_ws = Workspace(xp, self.context)
        self._scratch = None  # (flat buffer, per-layer views): where micro-batches after the first write
        # The last training step's correct predictions (``mean_loss_and_grads``' ``count_correct``) and examples.
        self.train_correct, self.train_seen = None, 0

    @classmethod
    def holding(cls, model: Sequential, xp, params, buffers, input_scale: str) -> "Replica":
        """A replica of ``model`` on ``xp`` holding copies of these flat weights and buffers (to evaluate or
        predict with: an EMA's weights, a run's, without touching the run's replicas); ``input_scale``: the
        run's setting."""
        r = cls(model, xp)
        r.input_scale = input_scale
        r.set_params(params)
        r.set_buffers(buffers)
        return r

    def start_step(self, step: int) -> None:
        """A training step after ``step`` updates begins: the layers' step context, and its per-step numbers on
        the device (``StepScalars.refresh``: at most one copy, queued on the current stream)."""
        self.context.step = step
        self.context.scalars.refresh(step)

    def reset_workspaces(self) -> None:
        """Every layer's workspace, and the loss's, replaced by an empty one: the next step allocates and fills
        its scratch afresh (after a failed CUDA graph capture, whose fills never ran: ``towers.devices.cuda_graphs``)."""
        self._local = [(p, g, Workspace(self.xp, self.context, (li,))) for li, (p, g, _) in enumerate(self._local)]
        self._loss_ws = Workspace(self.xp, self.context)

    def set_params(self, flat) -> None:
        """Copy a flat host or device array into the parameter buffer."""
        self.params[...] = self.xp.asarray(flat, dtype=self.dtype)

    def set_buffers(self, flat) -> None:
        """Copy a flat host or device array into the buffers (``model.buffer_layout()`` order)."""
        self.buffers[...] = self.xp.asarray(flat, dtype=self.dtype)

    def _views(self, flat) -> dict:
        """{name: view} of the model's weights in a flat buffer laid out as ``params``."""
        return {name: flat[off: off + size].reshape(shape, copy=False) for name, shape, off, size in self.model.layout()}

    def forward(self, x, training: bool = False):
        """The logits of ``x``: evaluation mode (moving statistics, no dropout) unless ``training``.

        Always on the float32 masters: a training step's low-precision forward is ``_train_forward``.
        """
        self.context.training = training
        for layer, (p, _, ws) in zip(self.model.layers, self._local):
            x = layer.forward(p, x, ws)
        return x

    def _train_forward(self, x):
        """A training step's forward: ``forward`` in fp32; in low precision on the rounded weights' copy, the
        input rounded into a copy and every layer's output rounded in place (module doc).  A layer that returns
        a view of its input (a reshape) hands on values rounded already: rounding again changes nothing."""
        if self._low is None:
            return self.forward(x, training=True)
        self.context.training = True
        if self._input is None or self._input.shape != x.shape:
            self._input = self.xp.empty(x.shape, dtype=self.dtype)
        self._input[...] = x
        x = self._input
        round_to(x, self.precision)
        for layer, p, (_, _, ws) in zip(self.model.layers, self._train_params, self._local):
            x = layer.forward(p, x, ws)
            round_to(x, self.precision)
        return x

    def loss_and_grads(self, x, labels, l2: float, want_loss: bool = True, timer=None):
        """Forward, mean softmax cross-entropy + L2, backward into ``grads``: the objective and its gradient.

        Returns the objective, the data loss plus the L2 term (whose
        gradient ``grads`` holds: what a gradient check differentiates), as
        a 0-d device array when ``want_loss`` (it is not fetched to the host
        here: that would be a sync point), else None.  ``timer(phase)``,
        when given, returns a context that times the ``forward`` and
        ``backward`` phases (``towers.run.profiling``).  A run's steps go
        through ``mean_loss_and_grads``, whose loss is the data loss alone.
        """
        loss = self.mean_loss_and_grads(((x, labels),), 1, l2, want_loss, timer)
        return loss + self.l2_term(l2) if want_loss else None

    def l2_term(self, l2: float):
        """The L2 term ``l2 * sum(w**2) / 2`` over the regularized weights, a 0-d device array (0 without any)."""
        w = self.params[: self._nreg]
        return self.dtype.type(l2 / 2) * self.xp.dot(w, w) if self._nreg and l2 else self.dtype.type(0)

    def mean_loss_and_grads(self, batches, count: int, l2: float, want_loss: bool = True, timer=None,
                            loss_scale: float = 1.0, ready=None, count_correct: bool | None = None):
        """Forward and backward over ``count`` micro-batches: their mean data loss and mean gradient, + L2's once.

        ``batches`` yields ``count`` (x, labels) pairs of equal size, taken one
        at a time (a generator may stage each into the same device buffer).
        The algorithm is docs/architecture.md's "Gradient accumulation": each
        micro-batch's logits gradient scaled by 1/K (K = ``count``), the first
        backward into ``grads``, each later one into a scratch buffer (made once)
        then added; L2's gradient and loss term added once, after the mean.  Layers see each micro-batch as a batch of its own (batch
        norm: its statistics; sync-BN: one pair of syncs per micro-batch).
        ``loss_scale`` S (fp16's dynamic loss scaling, a power of two:
        ``towers.optim.loss_scale``) multiplies the logits' gradient before
        backward, and L2's coefficient with it, so ``grads`` ends as S times
        the mean gradient (exactly, barring overflow: a power of two scales
        without rounding); the keeper unscales it after the all-reduce.  In low
        precision the weights' copy is rounded first, and each micro-batch's
        parameter gradients as backward leaves them (module doc).
        The loss returned is the data loss (mean cross-entropy, with label
        smoothing in training) without the L2 term: what a run logs, the
        quantity evaluation reports too, so a run at 100% accuracy does not log
        its weights' norm (``l2_term`` gives it).  With one micro-batch the
        gradient is exactly ``loss_and_grads``'.

        ``ready(layer)``, when given, is called during the last micro-batch's
        backward, right after layer ``layer``'s backward, once the gradients
        of that layer and of every later one are final (rounded, added to the
        earlier micro-batches', L2's added): the caller may average their
        ranges of ``grads`` (``Sequential.layer_spans``) while backward goes on
        (``towers.parallel.overlap``).  Those finishing operations then run per
        layer instead of once over the buffer; being elementwise, they give the
        same bits.  Layers before the first one with parameters are not
        walked, and not reported.  On a GPU "final" means queued on the
        current stream.

        ``count_correct`` (default: ``want_loss``): the training accuracy of
        this step from the logits its forward computed anyway (no second
        forward; training mode, so with dropout's masks): ``train_correct``
        holds how many of the ``train_seen`` examples' largest logit is their
        label, a 0-d device array (not fetched here), None when not counted.
        """
        if count_correct is None:
            count_correct = want_loss
        timer = timer or _no_timer
        scale = self.dtype.type(1 / count)
        loss, seen = None, 0
        self.train_correct, self.train_seen = None, 0  # set again below when counted
        if self._low is not None:
            with timer("forward"):
                self._low[...] = self.params  # this step's copy of the weights, in the compute format
                round_to(self._low, self.precision)
        for k, (x, labels) in enumerate(batches):
            with timer("forward"):
                logits = self._train_forward(x)
                if count_correct:  # before the loss's gradient, which may overwrite the logits' workspace
                    right = (logits.argmax(axis=1) == self.xp.asarray(labels)).sum()
                    self.train_correct = right if k == 0 else self.train_correct + right
                    self.train_seen += len(logits)
                part, dy = softmax_cross_entropy(logits, labels, self._loss_ws, want_loss, self.label_smoothing)
            with timer("backward"):
                if count > 1:
                    dy *= scale  # the loss workspace's array: safe in place
                if loss_scale != 1.0:
                    dy *= self.dtype.type(loss_scale)
                if ready is not None and k == count - 1:
                    # Each layer's gradient finished and reported as backward leaves it.
                    done = functools.partial(self._finish_layer, k=k, l2=l2 * loss_scale, ready=ready)
                    self._backward(dy, None if k == 0 else self._scratch_grads(), done)
                else:
                    self._backward(dy, None if k == 0 else self._scratch_grads())
                    # Low precision: the parameter gradients as backward hands them over, rounded.
                    round_to(self.grads if k == 0 else self._scratch[0], self.precision)
                    if k:
                        self.grads += self._scratch[0]
            if want_loss:
                part = part * scale if count > 1 else part
                loss = part if k == 0 else loss + part
            seen = k + 1
        if seen != count:
            raise ValueError(f"mean_loss_and_grads: {seen} micro-batches, {count} announced")
        with timer("backward"):
            if self._nreg and l2 and ready is None:  # (with ``ready``, added layer by layer)
                w = self.params[: self._nreg]
                # grads += l2 * w: one kernel on a GPU, one pass or two on the CPU (towers.ops.l2); scaled
                # with the loss (a power of two: l2 * S * w is S * (l2 * w) exactly).
                add_scaled(self.grads[: self._nreg], w, l2 * loss_scale)
        return loss

    def _backward(self, dy, grads, done=None) -> None:
        """Backward from ``dy`` (the logits' gradient) into ``grads`` (per layer; None: the replica's own);
        ``done(i)`` after layer i's."""
        layers = self.model.layers
        # Low precision: the loss's gradient and each layer's input gradient, as the next layer reads them, rounded.
        round_to(dy, self.precision)
        # Backward stops at the first layer with parameters, which needs no
        # input gradient (for the MLP that saves a third of the step's FLOPs).
        for i in range(len(layers) - 1, self._first_param_layer - 1, -1):
            _, g, ws = self._local[i]
            dy = layers[i].backward(self._train_params[i], g if grads is None else grads[i], dy, ws,
                                    need_dx=i > self._first_param_layer)
            if i > self._first_param_layer:
                round_to(dy, self.precision)
            if done is not None:
                done(i)

    def _finish_layer(self, i: int, k: int, l2: float, ready) -> None:
        """Micro-batch ``k``'s gradients of layer ``i`` as the rest of the step leaves them, then ``ready(i)``:
        rounded (low precision), added to ``grads`` (k > 0: they are in the scratch buffer), and L2's
        ``l2 * w`` added where regularized; the whole buffer's operations, restricted to the layer's ranges."""
        for lo, hi in self._spans[i]:
            src = self.grads if k == 0 else self._scratch[0]
            round_to(src[lo:hi], self.precision)
            if k:
                self.grads[lo:hi] += src[lo:hi]
            top = min(hi, self._nreg)
            if l2 and lo < top:
                add_scaled(self.grads[lo:top], self.params[lo:top], l2)
        ready(i)

    def _scratch_grads(self) -> list[dict]:
        """Per layer, its gradient views into the scratch buffer (made on the first call)."""
        if self._scratch is None:
            flat = self.xp.zeros_like(self.grads)
            views = self._views(flat)
            self._scratch = (flat, [{k: views[n] for k, n in names} for names in self._grad_names])
        return self._scratch[1]

    def _chunks(self, x, batch: int):
        """(start, logits) of each chunk of at most ``batch`` host examples of ``x``, in evaluation mode.

        Chunks are small because a convolution's im2col buffer grows with
        them, and hold at most ``EVAL_CHUNK_BYTES`` of float32 examples (at
        least one example): large images take fewer a chunk (250 images of
        1024 x 1024 x 3 would be 2.9 GiB at once).  The last one is short,
        never padded.  uint8 inputs are scaled on the device as in training
        (``input_scale``: by 1/255 unless the setting says 1).  The logits may live in a workspace that the next chunk
        overwrites: use them before asking for it.
        """
        xp = self.xp
        per_example = 4 * int(numpy.prod(x.shape[1:], dtype=numpy.int64))
        batch = max(1, min(batch, EVAL_CHUNK_BYTES // max(per_example, 1)))
        for start in range(0, len(x), batch):
            xb = xp.asarray(x[start : start + batch])
            scale = input_scale(xb.dtype, self.input_scale)
            xb = xb * scale if scale is not None else xb.astype(self.dtype, copy=False)
            yield start, self.forward(xb.astype(self.dtype, copy=False))

    def evaluate(self, x, y, batch: int = 250, progress=None) -> tuple[float, float]:
        """(mean loss, accuracy) over host arrays ``x``, ``y``: ``score``'s first two figures."""
        scores = self.score(x, y, batch, progress)
        return scores["loss"], scores["accuracy"]

    def score(self, x, y, batch: int = 250, progress=None) -> dict:
        """{"loss", "accuracy"} over host arrays ``x``, ``y``, and "top5_accuracy" when the model has more than
        ``TOP5_CLASSES`` classes (the label among the 5 largest logits, ``top_k_count``).

        The loss is the mean without L2 and label smoothing.  Evaluation mode
        (moving statistics, no dropout), in chunks of ``batch``
        (``_chunks``); counts real examples only.  Each chunk's loss and
        counts reach the host (a sync point per chunk on a GPU).
        ``progress(k)``, when given, is called after each chunk with its
        example count (a progress bar's ``update``).
        """
        xp = self.xp
        top5 = self.model.output_shape[-1] > TOP5_CLASSES
        total_loss, correct, in_top5 = 0.0, 0, 0
        for start, logits in self._chunks(x, batch):
            yb = xp.asarray(y[start : start + len(logits)])
            correct += accuracy_count(logits, yb)  # before the loss, whose workspace may hold the logits
            if top5:
                in_top5 += top_k_count(logits, yb, 5)
            loss, _ = softmax_cross_entropy(logits, yb, self._loss_ws, True)
            total_loss += float(loss) * len(yb)
            if progress is not None:
                progress(len(yb))
        n = max(len(x), 1)
        scores = {"loss": total_loss / n, "accuracy": correct / n}
        if top5:
            scores["top5_accuracy"] = in_top5 / n
        return scores

    def predict(self, x, batch: int = 250) -> numpy.ndarray:
        """The logits of host examples ``x`` as a host float32 array (len(x), classes).

        Evaluation mode, in chunks of ``batch`` (``_chunks``) gathered into one
        array on the device, which is copied to the host once at the end (the
        one sync point on a GPU).  ``len(x)`` may be 0.
        """
        out = self.xp.empty((len(x),) + tuple(self.model.output_shape), dtype=self.dtype)
        for start, logits in self._chunks(x, batch):
            out[start : start + len(logits)] = logits
        return to_host(out)


_NO_TIMER = contextlib.nullcontext()


def _no_timer(phase):
    return _NO_TIMER
