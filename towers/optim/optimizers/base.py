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
* ``scalars`` and ``_scalars(lr, step)``: the names and the values of the
  numbers its update reads per step (computed on the host in float64, then
  rounded to the buffers' dtype: bias corrections, ``lr``);
* ``update(p, g, slot, k)``: the update itself, written once, as a function of
  one element (``towers.ops.codegen.expr``): ``p`` and ``g`` the parameter and its
  gradient, ``slot`` its slots (read ``slot.adam_m``, assign the new value to
  it), ``k`` the scalars (``k.lr``); it returns the new parameter.  Python
  ``if`` on the optimizer's own settings chooses a variant (SGD's momentum).

The base class appends the EMA (``towers.optim.ema.ema``, when this replica
holds it) to the update and derives every form of the whole from that one
definition (``towers.ops.codegen.elementwise``): NumPy passes over the
flat buffers, a numba loop (one pass, the run's compiled CPU form), and one
CUDA kernel (one launch per replica and step).  Each performs the same
operations in the same order, so they give the same bits
(``tests/ops/test_update_forms.py``, ``tests/ops/test_cuda_emitter.py``).  The update
must be elementwise: no reduction over the buffer.

State buffers (``slots``) have the parameters' flat layout, so checkpoints name
them like the weights (``adam_m/layer1/weights``) and weights mode averages them
with the same all-reduce.  ``part`` restricts the CPU update to a slice, so
concurrent CPU tower threads can each update a share.
"""
from __future__ import annotations

import hashlib
import types

import numpy

from towers.arrays import array_module, on_host
from towers.ops.codegen import expr
from towers.ops.codegen.elementwise import Elementwise
from towers.optim.ema import ema

_OPS: dict = {}  # the update's argument order and traced text -> its Elementwise (one per distinct arithmetic, shared by replicas)


class Optimizer:
    """The update of one replica's flat buffer, with the EMA when this replica holds it."""

    name = ""  # the `optimizer` setting; empty: not an optimizer of the registry (a base)
    settings: dict = {}  # hyperparameters declared here: {field name: towers.settings.setting(...)}
    reads: tuple[str, ...] = ()  # Config fields the update reads (shown by the settings line)
    defaults: dict = {}  # lr, lr_decay, l2 (and model-defaulted hyperparameters) when the model gives none
    all_slots: tuple[str, ...] = ()  # every slot it may hold (checkpoints of it may hold these)
    slot_init: dict = {}  # slot -> initial value (others start at 0)
    slots: tuple[str, ...] = ()  # the slots this instance holds
    scalars: tuple[str, ...] = ()  # the names of ``_scalars``' values, as ``update`` reads them (``k.lr``)

    def __init__(self, params, ema=None):
        self.params = params
        self.xp = array_module(params)
        self.dtype = params.dtype.type
        self.ema = ema  # an EMA whose shadow lives on this replica's device, or None
        self.state = {name: self.xp.full_like(params, self.slot_init.get(name, 0)) for name in self.slots}
        self._op = self._make_op()

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
        ``grads`` is then that slice's gradients.  One call of the update's op:
        one kernel on a GPU, one compiled pass or the NumPy passes on
        the CPU (``towers.ops.codegen.elementwise``).
        """
        if part is None:
            part = slice(None)
        elif not on_host(self.params):
            raise ValueError("Optimizer.step(part=...) is for CPU buffers only")
        t = self.dtype
        scalars = [t(v) for v in self._scalars(lr, step)]
        arrays = [grads, self.params[part], *(buf[part] for buf in self.state.values())]
        if self.ema is not None:
            arrays.append(self.ema.shadow[part])
            scalars.append(self.ema.one_minus_d(step + 1))  # TF's global_step after this update
        self._op(*arrays, *scalars)

    def _make_op(self) -> Elementwise:
        """The update, with the EMA when this replica holds it, as one op (shared by optimizers of the same
        arithmetic)."""
        slots, with_ema = tuple(self.slots), self.ema is not None
        arrays = ("g", "p", *slots, *(("e",) if with_ema else ()))
        scalars = (*self.scalars, *(("one_minus_d",) if with_ema else ()))

        def definition(**a):
            slot = types.SimpleNamespace(**{name: a[name] for name in slots})
            k = types.SimpleNamespace(**{name: a[name] for name in self.scalars})
            p_new = self.update(a["p"], a["g"], slot, k)
            out = {"p": p_new, **{name: getattr(slot, name) for name in slots}}
            if with_ema:
                out["e"] = ema(a["e"], p_new, a["one_minus_d"])
            return out

        outputs = ("p", *slots, *(("e",) if with_ema else ()))
        # The arithmetic and the order its arguments come in: two updates of one arithmetic whose scalars come
        # in another order are two ops.
        key = repr((arrays, scalars, outputs)) + expr.trace(definition, arrays, scalars, (), outputs).key()
        op = _OPS.get(key)
        if op is None:
            # Named by its arithmetic: the same kernel and compiled loop (numba's disk cache) in every process.
            name = f"{self.name or type(self).__name__.lower()}_{hashlib.sha1(key.encode()).hexdigest()[:10]}"
            op = _OPS[key] = Elementwise(name, definition, outputs, scalars=scalars, params=arrays + scalars,
                                         module=False, distinct=True)
        return op

    # -- subclasses

    def _scalars(self, lr: float, step: int) -> tuple[float, ...]:
        """The values of ``scalars`` for this step (host floats)."""
        raise NotImplementedError

    def update(self, p, g, slot, k):
        """The new parameter from one element of ``p``, ``g`` and the slots (module doc)."""
        raise NotImplementedError

    def warm_up(self) -> None:
        """Load (or compile) the update's compiled CPU form now, where the current forms take it: not in a step."""
        if on_host(self.params):
            self._op.warm_up()
