"""What every optimizer is: the update each replica applies after the all-reduce.

After the all-reduce each replica's flat gradient buffer holds the same averaged
gradient ``g`` (L2 included: ``g += l2 * w`` on regularized weights, in
``towers.nn.replica``); every replica then runs the same arithmetic on the same
inputs, so replicas stay bit-identical.  The first tower's optimizer also
updates the EMA of the weights (``towers.optim.ema``) in the same pass.

An optimizer is one file in this package with one ``Optimizer`` subclass that
declares, beside its update:

* ``name``: the ``optimizer`` setting that picks it;
* ``settings``: the hyperparameters it declares, ``towers.settings.hyperparameter``
  (numbers: unset until the optimizer that reads them is known) or ``switch``
  fields that ``towers.Config`` gets (flags, checks, help, resume rule);
* ``reads``: every setting its update reads, its own and others' (AdamW reads
  Adam's ``beta1``), in the order the settings line shows them;
* ``defaults``: the learning rate, its decay and L2 (``towers.nn.models``'
  ``GENERIC``) a run gets with it when the model gives none;
* ``all_slots`` and ``slot_init``: its state buffers' names, as checkpoints
  store them, and their initial values;
* the update itself, three times: ``GPU_BODY`` (CUDA source of one fused
  elementwise kernel, ``towers.optim.kernels``), ``_cpu_update`` (in-place NumPy
  passes over preallocated scratch: no allocation per step) and ``cpu_loop``
  (the same arithmetic element by element, with the EMA, for numba: one pass
  with the run's fused CPU kernels, ``towers.nn.fused_cpu``).  ``cpu_loop``
  and ``GPU_BODY`` must round as ``_cpu_update`` does, operation by operation:
  the same products and sums in the same order (the GPU kernel is compiled
  without FMA contraction; ``tests/test_blocked_update.py`` compares the CPU
  forms' bits for every optimizer, ``tests/test_gpu.py`` the GPU's).  ``_cpu_update`` must be
  elementwise (no reduction over the buffer): ``step`` runs it, then the EMA,
  block by block (``towers.devices.kernels.host_blocks``, 512 KiB per buffer),
  so the passes over a block hit L1/L2 instead of each streaming the whole
  buffer from memory (Adam + EMA: 15 passes over 13 MB buffers for LeNet-5);
  the bits are those of whole-buffer passes.

State buffers (``slots``) have the parameters' flat layout, so checkpoints name
them like the weights (``adam_m/layer1/weights``) and weights mode averages them
with the same all-reduce.  ``part`` restricts the CPU update to a slice, so
concurrent CPU tower threads can each update a share.
"""
from __future__ import annotations

import numpy

from towers.devices.kernels import host_blocks
from towers.devices.placement import array_module
from towers.optim.ema import ema_decay
from towers.optim.kernels import flat_kernel


class Optimizer:
    """The update of one replica's flat buffer, with the EMA when this replica holds it."""

    name = ""  # the `optimizer` setting; empty: not an optimizer of the registry (a base)
    settings: dict = {}  # hyperparameters declared here: {field name: towers.settings.setting(...)}
    reads: tuple[str, ...] = ()  # Config fields the update reads (shown by the settings line)
    defaults: dict = {}  # lr, lr_decay, l2 (and model-defaulted hyperparameters) when the model gives none
    all_slots: tuple[str, ...] = ()  # every slot it may hold (checkpoints of it may hold these)
    slot_init: dict = {}  # slot -> initial value (others start at 0)
    slots: tuple[str, ...] = ()  # the slots this instance holds
    variant = ""  # distinguishes kernels of one class whose source differs

    def __init__(self, params, ema=None):
        self.fused = None  # the fused CPU kernels (towers.nn.fused_cpu), set by the executor; None: NumPy passes
        self.params = params
        self.xp = array_module(params)
        self.dtype = params.dtype.type
        self.ema = ema  # an EMA whose shadow lives on this replica's device, or None
        self.state = {name: self.xp.full_like(params, self.slot_init.get(name, 0)) for name in self.slots}
        self._tmp = numpy.empty_like(params) if self.xp is numpy else None
        self._kernel = None  # the fused GPU update, built on the first GPU step

    @classmethod
    def from_config(cls, cfg, params, ema=None) -> "Optimizer":
        """This optimizer for one replica's flat buffer, with ``cfg``'s hyperparameters."""
        raise NotImplementedError

    @staticmethod
    def every_slot() -> tuple[str, ...]:
        """Every optimizer's slot names, as checkpoints may hold them (a subclass walk, not the registry:
        the registry imports this module, and every optimizer is imported with the package)."""
        slots, todo = {}, [Optimizer]
        while todo:
            cls = todo.pop(0)
            slots.update(dict.fromkeys(cls.all_slots))
            todo.extend(cls.__subclasses__())
        return tuple(slots)

    @classmethod
    def check(cls, cfg) -> None:
        """Rules between this optimizer's settings, on the resolved config (a ``UserError``)."""

    # -- state: the slots, named like the weights (``momentum/layer1/weights``)

    def state_dict(self, layout) -> dict:
        """{slot/name: host array} for every slot (``layout``: ``towers.state.Layout`` of the weights)."""
        return {k: v for slot, buf in self.state.items() for k, v in layout.split(buf, slot + "/").items()}

    def read_state(self, state: dict, layout, where: str) -> dict:
        """This optimizer's slots in ``state`` as checked host flat buffers (a ``UserError`` names a bad one).

        Slots of another optimizer (``SLOTS``) are checked and left out: after a
        change of optimizer or momentum the slots this one lacks start at their initial values.
        """
        from towers.state import under

        flats = {}
        for slot in Optimizer.every_slot():
            named = under(state, slot)
            if named:
                flat = layout.join(layout.check(named, f"{where} ({slot})"))
                if slot in self.state:
                    flats[slot] = flat
        return flats

    def set_state(self, flats: dict) -> None:
        """Set the slots from ``read_state``'s output; slots it lacks get their initial value."""
        for slot, buf in self.state.items():
            buf[...] = self.xp.asarray(flats[slot]) if slot in flats else self.slot_init.get(slot, 0)

    def step(self, grads, lr: float, step: int, part: slice | None = None) -> None:
        """Apply one update with learning rate ``lr``; ``step`` counts earlier updates.

        ``part`` (CPU only) limits the update to a slice of the flat buffer;
        ``grads`` is then that slice's gradients.
        """
        t = self.dtype
        one_minus_d = t(1.0 - ema_decay(self.ema.decay, step)) if self.ema is not None else t(0.0)
        scalars = [t(v) for v in self._scalars(lr, step)]
        if self.xp is numpy and self.fused is not None:
            # One compiled pass over the slice, element by element: the same roundings as the passes below.
            part = slice(None) if part is None else part
            e = self.ema.shadow[part] if self.ema is not None else self.params[:0]
            self.fused.loop(self.cpu_loop)(self.params[part], grads, e, one_minus_d, *self._loop_args(part, scalars))
            return
        if self.xp is numpy:
            # Block by block: the update then the EMA of one block while it is in cache.
            lo, hi, _ = (slice(None) if part is None else part).indices(self.params.size)
            for b in host_blocks(lo, hi, self.params.itemsize):
                p, tmp = self.params[b], self._tmp[b]
                self._cpu_update(p, grads[b.start - lo: b.stop - lo], tmp, scalars,
                                 {k: v[b] for k, v in self.state.items()})
                if self.ema is not None:
                    self.ema.apply(p, one_minus_d, tmp, b)
            return
        if part is not None:
            raise ValueError("Optimizer.step(part=...) is for CPU buffers only")
        if self._kernel is None:
            self._kernel = self._gpu_kernel()
        self._kernel(grads, *scalars, one_minus_d, self.params, *self.state.values(),
                     *([self.ema.shadow] if self.ema is not None else []))

    def _gpu_kernel(self):
        names = list(self.state)
        outs = ("p", *names, *(("e",) if self.ema is not None else ()))
        body = self.GPU_BODY + "p = p_new;\n" + (self.ema.GPU_BODY.format(p="p_new") if self.ema is not None else "")
        return flat_kernel(("g",), (*self._scalar_names(), "one_minus_d"), outs, body,
                           f"towers_{type(self).__name__.lower()}_{len(names)}_e{int(self.ema is not None)}"
                           + self.variant)

    # -- subclasses
    GPU_BODY = ""  # CUDA source that sets ``T p_new`` (and updates the slots)

    def _scalar_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _scalars(self, lr: float, step: int) -> tuple[float, ...]:
        raise NotImplementedError

    def _cpu_update(self, p, g, tmp, scalars, state) -> None:
        raise NotImplementedError

    # The update and the EMA over a slice, one element at a time, as ``_cpu_update``'s passes round them:
    # ``cpu_loop(p, g, e, one_minus_d, *_loop_args(part, scalars))`` (``e`` empty without an EMA), compiled
    # by numba (``towers.nn.fused_cpu.loop``) when the run has the fused CPU kernels.
    @staticmethod
    def cpu_loop(p, g, e, one_minus_d, *args):  # pragma: no cover - interface
        raise NotImplementedError

    def _loop_args(self, part: slice, scalars: list) -> tuple:
        raise NotImplementedError

    def warm_up(self) -> None:
        """Compile (or load from numba's cache) the fused loop on a one-element copy of every buffer: not in a step."""
        if self.fused is None:
            return
        saved = (self.params, self.state, self.ema)
        try:
            self.params = self.params[:1].copy()
            self.state = {k: v[:1].copy() for k, v in self.state.items()}
            if self.ema is not None:
                self.ema = type(self.ema)(self.params, self.ema.decay)
            self.step(self.params.copy(), 0.0, 0)
        finally:
            self.params, self.state, self.ema = saved
