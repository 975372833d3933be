"""The forms derived from one definition (``towers.ops.codegen.elementwise``) give the definition's bits.

Each definition below is traced once; its NumPy passes and its numba loop run
on the same inputs (special values included: NaN, infinities, signed zeros,
subnormals, overflow) and are compared bit for bit with the definition itself
run by NumPy on whole arrays (each operation one allocating pass).  Also: large
buffers (the passes' per-thread scratch grown), strided and float64 arrays,
outputs sharing an input's memory, the float32 constants that keep numba from
promoting to float64, and what a definition may not do.
"""
from __future__ import annotations

import numpy
import pytest

from tests.conftest import cpu_form
from towers.ops.codegen.elementwise import Elementwise
from towers.ops.codegen.expr import maximum, sqrt, trace, where


def _mean_both(a, b, s):
    v = (a + b) * s
    return {"a": v, "b": v}


def _swap_scaled(a, b, s):
    return {"a": b * s, "b": a * s}


# name -> (definition, outputs, scalars, rows)
DEFINITIONS = {
    "axpy": (lambda g, w, s: g + w * s, ("g",), ("s",), ()),
    "relu_out": (lambda x: maximum(x, 0), ("y",), (), ()),
    "mask": (lambda y, dy: dy * where(y > 0, 1, 0), ("dy",), (), ()),
    "leaky": (lambda x, k: where(x >= 0, x, x * k), ("y",), ("k",), ()),
    "sign": (lambda x: where(x > 0, 1, where(x < 0, -1, 0)), ("y",), (), ()),
    "adamish": (lambda m, v, g, b, eps: {"m": m * b + g * (1 - b), "v": v / (sqrt(v * v) + eps) - -g},
                ("m", "v"), ("b", "eps"), ()),
    "mean_both": (_mean_both, ("a", "b"), ("s",), ()),
    "swap": (_swap_scaled, ("a", "b"), ("s",), ()),  # each output reads the other's old value
    "consts": (lambda x: (x * 0.1 + 3) / 7 - maximum(-x, 0.25), ("y",), (), ()),
    "rows": (lambda y, b: y * b + b, ("y",), (), ("b",)),
    # masks that are added, subtracted or negated count as 1.0 and 0.0, not as bools
    "mask_sum": (lambda a, b: where(a > 0, 1, 0) + where(b > 0, 1, 0), ("y",), (), ()),
    "mask_sub": (lambda x: x - where(x > 0, 1, 0) * x - where(x < 0, 1, 0), ("y",), (), ()),
}

_N = {}


def _op(name) -> Elementwise:
    if name not in _N:
        fn, outs, scalars, rows = DEFINITIONS[name]
        _N[name] = Elementwise("test_" + name, fn, outs, scalars=scalars, rows=rows, module=False)
    return _N[name]


def _values(rng, n, dtype):
    specials = numpy.array([numpy.nan, numpy.inf, -numpy.inf, 0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 1.0, -1.0],
                           numpy.float32).astype(dtype)
    a = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(dtype)
    a[: min(n, len(specials))] = specials[: min(n, len(specials))]
    rng.shuffle(a)
    return a


def _args(op, n, dtype, seed=0):
    """The op's arguments in call order: arrays of n values (rows: of 7), scalars, output-only arrays poisoned."""
    rng = numpy.random.default_rng(seed)
    args = []
    for name in op.params:
        if name in op.traced.scalars:
            args.append(dtype(rng.uniform(0.05, 0.95)))
        elif name in op.traced.rows:
            args.append(_values(rng, 7, dtype))
        elif name in op.traced.args:
            args.append(_values(rng, n, dtype).reshape(-1, 7) if op.traced.rows else _values(rng, n, dtype))
        else:
            args.append(numpy.full((n // 7, 7) if op.traced.rows else n, 7.0, dtype))
    return args


def _reference(op, args):
    """The definition itself on whole arrays, allocating: the outputs' new values."""
    named = dict(zip(op.params, args))
    fn = DEFINITIONS[op.name[len("test_"):]][0]
    with numpy.errstate(all="ignore"):
        out = fn(**{k: v for k, v in named.items() if k in op.traced.args})
    out = out if isinstance(out, dict) else {next(iter(op.traced.outputs)): out}
    return {k: numpy.asarray(v, dtype=args[0].dtype) * numpy.ones_like(named[k]) for k, v in out.items()}


def _run(op, args, form):
    args = [a.copy() if isinstance(a, numpy.ndarray) else a for a in args]
    with cpu_form(form), numpy.errstate(all="ignore"):
        op(*args)
    return {k: args[op.params.index(k)] for k in op.traced.outputs}


@pytest.mark.parametrize("form", ["numpy", "numba"])
@pytest.mark.parametrize("name", DEFINITIONS)
@pytest.mark.parametrize("n, dtype", [(7 * 31, numpy.float32), (7 * 40000, numpy.float32), (7 * 29, numpy.float64)],
                         ids=["small", "large", "float64"])
def test_each_form_gives_the_definitions_bits(name, form, n, dtype):
    op = _op(name)
    args = _args(op, n, dtype)
    want = _reference(op, args)
    got = _run(op, args, form)
    for k in want:
        assert got[k].dtype == dtype and _bits(got[k]) == _bits(want[k]), (name, form, k)


def _bits(a):
    """The array's bytes, every NaN made the same NaN (a NaN's sign and payload are not values: LLVM may fold
    ``a - (-b)`` into ``a + b``, which gives a NaN ``b`` the other sign)."""
    a = a.copy()
    a[numpy.isnan(a)] = numpy.nan
    return a.tobytes()


@pytest.mark.parametrize("form", ["numpy", "numba"])
def test_strided_arrays_take_whole_array_passes_with_the_same_bits(form):
    op = _op("adamish")
    full = _args(op, 7 * 50, numpy.float32)
    strided = [a[::2] if isinstance(a, numpy.ndarray) else a for a in full]
    assert not strided[0].flags.c_contiguous
    want = _reference(op, strided)
    with cpu_form(form), numpy.errstate(all="ignore"):
        op(*strided)
    for k in want:
        assert _bits(strided[op.params.index(k)]) == _bits(want[k])


def test_the_passes_scratch_serves_calls_of_other_sizes_and_shapes():
    """The NumPy passes keep one scratch per thread, grown to the largest call: a large flat call, then a strided
    2-D one (scratch in the outputs' shape) and a small one each give the definition's bits."""
    op = _op("adamish")
    assert op.numpy_form.n_float > 0
    for view in (lambda a: a, lambda a: a.reshape(-1, 7)[::2], lambda a: a[:7]):
        args = [view(a) if isinstance(a, numpy.ndarray) else a for a in _args(op, 7 * 3000, numpy.float32)]
        want = _reference(op, args)
        with cpu_form("numpy"), numpy.errstate(all="ignore"):
            op(*args)
        for k in want:
            assert _bits(args[op.params.index(k)]) == _bits(want[k]), k


def test_a_large_call_leaves_no_array_of_its_size_behind():
    """``maximum`` against a constant reads a kept array of it, no longer than ``CONSTANT_ELEMENTS``: a pass
    longer than that (an evaluation chunk's relu) runs in pieces, flat or strided, with the definition's bits,
    and what stays in memory after it is no larger."""
    from towers.ops.codegen import numpy_form

    n = 3 * numpy_form.CONSTANT_ELEMENTS + 5
    x = _values(numpy.random.default_rng(4), 2 * n, numpy.float32)
    for name in ("relu_out", "consts"):
        op = _op(name)
        for arg in (x[:n], x[::2]):  # one flat array; a strided one
            want = _reference(op, [arg, numpy.full(n, 7.0, numpy.float32)])
            y = numpy.full(n, 7.0, numpy.float32)
            with cpu_form("numpy"), numpy.errstate(all="ignore"):
                op(arg, y)
            assert _bits(y) == _bits(want["y"]), name
    assert max(a.size for a in numpy_form._CONSTANTS.values()) <= numpy_form.CONSTANT_ELEMENTS


@pytest.mark.parametrize("form", ["numpy", "numba"])
def test_an_output_sharing_an_inputs_memory_is_read_before_it_is_written(form):
    """``y = relu(h + s)`` into ``h`` itself, and ``relu(x, x)``."""
    x = _values(numpy.random.default_rng(5), 1000, numpy.float32)
    add = Elementwise("test_add_relu_alias", lambda h, s: maximum(h + s, 0), ("y",), module=False)
    s = numpy.linspace(-1, 1, 1000, dtype=numpy.float32)
    with numpy.errstate(all="ignore"):
        want = numpy.maximum(x + s, numpy.float32(0))
    h = x.copy()
    with cpu_form(form), numpy.errstate(all="ignore"):
        add(h, s, h)
    assert h.tobytes() == want.tobytes()
    y = x.copy()
    with cpu_form(form):
        _op("relu_out")(y, y)
    assert y.tobytes() == numpy.maximum(x, numpy.float32(0)).tobytes()
    # where() writes its "else" value before it reads its condition and "then" value
    k = numpy.float32(0.5)
    want = numpy.empty_like(x)
    with cpu_form(form), numpy.errstate(all="ignore"):
        _op("leaky")(x, k, want)
        y = x.copy()
        _op("leaky")(y, k, y)
    assert y.tobytes() == want.tobytes()


@pytest.mark.parametrize("form", ["numpy", "numba"])
def test_arrays_of_the_wrong_size_are_refused_in_every_form(form):
    """The compiled loop indexes by the outputs' element, unchecked: sizes are checked before it runs."""
    y = numpy.zeros((4, 7), numpy.float32)
    with cpu_form(form), pytest.raises(ValueError):
        _op("rows")(y, numpy.ones(8, numpy.float32))
    with cpu_form(form), pytest.raises(ValueError):  # as many values as the outputs, but not a row long
        _op("rows")(y, numpy.ones(28, numpy.float32))
    with cpu_form(form), pytest.raises(ValueError):
        _op("axpy")(numpy.zeros(10, numpy.float32), numpy.zeros(9, numpy.float32), numpy.float32(1))


def test_updates_of_one_arithmetic_with_scalars_in_another_order_are_two_ops():
    """Optimizers share an op per arithmetic: the order of its arguments is part of what is shared."""
    from towers.optim.optimizers.adam import Adam

    class Reordered(Adam):
        scalars = ("b1", "b2", "eps", "lr_t")

        def _scalars(self, lr, step):
            lr_t, b1, b2, eps = super()._scalars(lr, step)
            return (b1, b2, eps, lr_t)

    rng = numpy.random.default_rng(3)
    p0, g = rng.standard_normal((2, 1000)).astype(numpy.float32)
    out = []
    for cls in (Adam, Reordered):
        p = p0.copy()
        cls(p).step(g, 0.01, 0)
        out.append(p.tobytes())
    assert out[0] == out[1]


def test_constants_keep_float32_in_the_compiled_loop():
    """numba computes int x float32 in float64: a definition's constants are made float32, so ``x * 0.1 - x / 10``
    rounds each operation in float32 (in float64 it would be about 1e-17 of x, not 1e-8)."""
    pytest.importorskip("numba", reason="numba is not installed")
    op = Elementwise("test_tenth", lambda x: x * 0.1 - x / 10, ("y",), module=False)
    x = numpy.random.default_rng(2).standard_normal(10000).astype(numpy.float32)
    y = numpy.empty_like(x)
    with cpu_form("numba"):
        op(x, y)
    f32 = x * numpy.float32(0.1) - x / numpy.float32(10)
    f64 = (x.astype(numpy.float64) * 0.1 - x.astype(numpy.float64) / 10).astype(numpy.float32)
    assert y.tobytes() == f32.tobytes() and not numpy.array_equal(f32, f64)


def test_the_passes_reuse_buffers_in_place():
    """Adam's moments and step with the EMA: one scratch buffer, as the hand-written passes had."""
    from towers.optim.ema import EMA
    from towers.optim.optimizers.adam import Adam

    params = numpy.zeros(8, numpy.float32)
    op = Adam(params, ema=EMA(params, 0.99))._op
    assert op.numpy_form.n_float == 1 and op.numpy_form.n_bool == 0
    assert op.numpy_form.source.count("xp.") == 15  # one pass per operation, no copies


def test_a_definition_branches_on_settings_not_on_values():
    with pytest.raises(TypeError, match="no truth value"):
        trace(lambda x: x if x > 0 else -x, ("x",), (), (), ("y",))
    with pytest.raises(TypeError, match="condition"):
        trace(lambda x: (x > 0) * x, ("x",), (), (), ("y",))
    with pytest.raises(TypeError, match="returns"):
        trace(lambda x: {"z": x}, ("x",), (), (), ("y",))
    with pytest.raises(ValueError, match="cannot name"):
        Elementwise("test_bad", lambda n: n, ("y",), module=False)
    with pytest.raises(ValueError, match="cannot name"):  # a C++ keyword: the kernel would not compile
        Elementwise("test_bad", lambda new: new, ("y",), module=False)
