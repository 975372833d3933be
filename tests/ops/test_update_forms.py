"""Every CPU form of every optimizer's update gives the bits of its definition run by NumPy on whole arrays.

The update is written once (``Optimizer.update``, with the EMA's ``ema``);
the reference here evaluates that definition directly on the whole slice
``part`` (each operation one allocating NumPy pass over the whole slice).
The forms derived from it (``towers.ops.codegen.elementwise``): the NumPy passes,
in place with scratch reused, and numba's compiled loop, one element at a
time.  Buffers are a few hundred thousand elements, of an odd length, and
``part`` starts and ends off any round boundary (slices of the whole, and a
short one: the passes' per-thread scratch serves calls of several sizes).
"""
import types

import numpy as np
import pytest

from tests.conftest import cpu_form
from towers.optim.ema import EMA, ema, ema_decay
from towers.optim.optimizers import OPTIMIZERS

CHUNK = 128 * 1024  # float32 elements in 512 KiB: where the reference must have changed every chunk of a part
N = 3 * CHUNK + 1237

VARIANTS = {
    "sgd": dict(momentum=0.0),
    "sgd-momentum": dict(momentum=0.9),
    "sgd-nesterov": dict(momentum=0.9, nesterov=True),
    "adam": dict(),
    "adamw": dict(weight_decay=0.05),
    "rmsprop": dict(),
    "rmsprop-momentum": dict(momentum=0.9),
    "rmsprop-centered": dict(momentum=0.5, centered=True),
}
PARTS = {"whole": None, "mid": slice(CHUNK // 2 + 3, N - 5), "short": slice(CHUNK - 10, CHUNK + 20)}


def test_every_optimizer_is_covered():
    assert {v.split("-")[0] for v in VARIANTS} == set(OPTIMIZERS)


def _pair(variant, with_ema):
    """Two identical optimizers (and EMAs) over a random float32 buffer of N elements."""
    rng = np.random.default_rng(sum(map(ord, variant)))
    params = rng.standard_normal(N).astype(np.float32)
    cls = OPTIMIZERS[variant.split("-")[0]]
    out = []
    for _ in range(2):
        ema = EMA(params, 0.99) if with_ema else None
        out.append(cls(params.copy(), ema=ema, **VARIANTS[variant]))
    return out, rng


def _reference_step(opt, grads, lr, step, part):
    """The definition itself on NumPy arrays: ``update`` then ``ema`` over the whole slice, allocating."""
    t = opt.dtype
    part = slice(None) if part is None else part
    k = types.SimpleNamespace(**dict(zip(opt.scalars, (t(v) for v in opt._scalars(lr, step)))))
    slot = types.SimpleNamespace(**{name: buf[part].copy() for name, buf in opt.state.items()})
    p_new = opt.update(opt.params[part].copy(), grads, slot, k)
    for name, buf in opt.state.items():
        buf[part] = getattr(slot, name)
    opt.params[part] = p_new
    if opt.ema is not None:
        opt.ema.shadow[part] = ema(opt.ema.shadow[part], p_new, t(1.0 - ema_decay(opt.ema.decay, step + 1)))


def _bits(a):
    return a.tobytes()


@pytest.mark.parametrize("part", PARTS, ids=str)
@pytest.mark.parametrize("with_ema", [False, True], ids=["no-ema", "ema"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", ["numpy", "numba"])
def test_each_form_of_the_update_gives_the_definitions_bits(variant, with_ema, part, form):
    """``form`` numpy: the NumPy passes; numba: the compiled loop (``cpu_kernels`` numba)."""
    (derived, old), rng = _pair(variant, with_ema)
    part = PARTS[part]
    for step in range(3):
        grads = (rng.standard_normal(N) * 0.1).astype(np.float32)
        g = grads if part is None else grads[part]
        lr = 0.05 / (1 + step)
        with cpu_form(form):
            derived.step(g.copy(), lr, step, part)
        _reference_step(old, g.copy(), lr, step, part)
    assert _bits(derived.params) == _bits(old.params)
    for slot in old.state:
        assert _bits(derived.state[slot]) == _bits(old.state[slot]), slot
    if with_ema:
        assert _bits(derived.ema.shadow) == _bits(old.ema.shadow)
    # the reference changed each chunk of the slice, and nothing outside it
    (fresh, _), _ = _pair(variant, with_ema)
    lo, hi, _ = (part or slice(None)).indices(N)
    chunks = [slice(i, min(i + CHUNK, hi)) for i in range(lo, hi, CHUNK)]
    assert all((old.params[c] != fresh.params[c]).any() for c in chunks)
    outside = np.ones(N, bool)
    outside[lo:hi] = False
    assert _bits(derived.params[outside]) == _bits(fresh.params[outside])


@pytest.mark.parametrize("form", ["numpy", "numba"])
def test_standalone_ema_update_gives_the_definitions_bits(form):
    rng = np.random.default_rng(3)
    params = rng.standard_normal(N).astype(np.float32)
    derived, old = EMA(params, 0.999), EMA(params, 0.999)
    for n in range(4):
        params = params + (rng.standard_normal(N) * 0.1).astype(np.float32)
        with cpu_form(form):
            derived.update(params, n)
        old.shadow = ema(old.shadow, params, np.float32(1.0 - ema_decay(old.decay, n)))
    assert _bits(derived.shadow) == _bits(old.shadow)
    assert not np.array_equal(derived.shadow, EMA(params, 0.999).shadow)
