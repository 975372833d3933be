"""The CUDA emitter (``towers.ops.codegen.cuda_form``) writes the definition's operations one per statement, in its order.

Every generated kernel of the process (the layers' ops, every optimizer of
the registry in each variant with and without the EMA, the EMA's own update,
a new optimizer from one file: ``tests/fixtures/lion.py``) is read back here
statement by statement and run on the CPU, each statement one float32 NumPy
operation over all elements (``__fmul_rn`` a product, ``sqrtf`` the IEEE
square root, ``np_max`` NumPy's maximum with NaN winning, ``c ? a : b``
``where``).  The reader takes only what the emitter promises: loads of
element ``i`` (a row operand's ``i % cols``) into a local named as the array,
then one operation a statement over loaded values, earlier locals, scalars and
float literals, then the stores.  The result must be the bits of the op's
NumPy passes: so each kernel performs the definition's operations, in its
order and association, on the same elements, with constants of the same
float32 value.  That the products do not contract into FMAs and that
division and square root are IEEE-rounded under the options the build uses is
NVRTC's part (``tests/devices/test_kernels_compile.py``); the bits on a GPU
are ``tests/gpu/``'s.  No test holds a kernel's text: a new op or optimizer
needs no CUDA written by hand.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import towers  # noqa: F401 - the layers' ops
from tests.conftest import cpu_form
from tests.ops.test_new_ops import _load
from tests.ops.test_update_forms import VARIANTS
from towers.ops.codegen import cuda_form, elementwise
from towers.ops.codegen.elementwise import Elementwise
from towers.optim.ema import EMA
from towers.optim.optimizers import OPTIMIZERS

_NAME = r"[A-Za-z_]\w*"
_OPERAND = rf"(?:{_NAME}|-?\d[\d.]*(?:e[-+]?\d+)?f)"
_LOAD = re.compile(rf"const float ({_NAME}) = ({_NAME})_\[(i|i % cols)\];")
_LOCAL = re.compile(rf"const (float|bool) (t\d+) = (.+);")
_STORE = re.compile(rf"({_NAME})_\[i\] = ({_OPERAND});")
_CALL = re.compile(rf"(__fmul_rn|sqrtf|np_max)\(({_OPERAND})(?:, ({_OPERAND}))?\)")
_INFIX = re.compile(rf"({_OPERAND}) (\+|-|/|>=|<=|>|<) ({_OPERAND})")
_SELECT = re.compile(rf"({_OPERAND}) \? ({_OPERAND}) : ({_OPERAND})")
_NEG = re.compile(rf"-({_NAME})")
_INFIX_OPS = {"+": np.add, "-": np.subtract, "/": np.divide, ">": np.greater, ">=": np.greater_equal,
              "<": np.less, "<=": np.less_equal}


def _body(source: str) -> list:
    """The statements of the grid-stride loop, one a line."""
    start = source.index("gridDim.x) {") + len("gridDim.x) {")
    return [s.strip() for s in source[start: source.rindex("}", 0, source.rindex("}"))].strip().splitlines()]


def run_on_cpu(source: str, buffers: dict, scalars: dict) -> None:
    """Run the kernel body of ``source`` over the flat float32 ``buffers`` ({array name: array}, written in
    place) with ``scalars``; raises AssertionError on any statement the emitter does not promise (module doc)."""
    n = max(b.size for b in buffers.values())
    cols = min(b.size for b in buffers.values())
    env = {k: np.float32(v) for k, v in scalars.items()}
    stored = False

    def val(tok):
        if tok in env:
            return env[tok]
        assert tok.endswith("f") and tok[0] in "-0123456789", f"{tok!r} is neither defined before nor a literal"
        v = np.float32(float(tok[:-1]))
        assert float(v) == float(tok[:-1]), f"literal {tok} is not a float32 value"
        return v

    for line in _body(source):
        if m := _LOAD.fullmatch(line):
            assert not stored, f"{line!r}: a load after a store"
            name, array, index = m.groups()
            assert name == array and name not in env, line
            b = buffers[array]
            env[name] = b.copy() if index == "i" else b[np.arange(n) % cols]
        elif m := _LOCAL.fullmatch(line):
            assert not stored, f"{line!r}: an operation after a store"
            kind, name, expr = m.groups()
            assert name not in env, f"{name} defined twice"
            with np.errstate(all="ignore"):
                if c := _CALL.fullmatch(expr):
                    fn, a, b = c.groups()
                    x = val(a)
                    if fn == "sqrtf":
                        assert b is None, expr
                        v = np.sqrt(x)
                    elif fn == "__fmul_rn":
                        v = np.multiply(x, val(b))
                    else:  # np_max: NaN wins, else the larger, the first on ties
                        y = val(b)
                        v = np.where((x > y) | (x != x), x, y)
                elif c := _SELECT.fullmatch(expr):
                    cond, a, b = c.groups()
                    v = np.where(val(cond), val(a), val(b))
                elif c := _INFIX.fullmatch(expr):
                    a, op, b = c.groups()
                    v = _INFIX_OPS[op](val(a), val(b))
                elif c := _NEG.fullmatch(expr):
                    v = np.negative(val(c.group(1)))
                elif re.fullmatch(_OPERAND, expr):
                    v = val(expr)
                else:
                    raise AssertionError(f"{line!r} is not one operation over defined operands")
            v = np.asarray(v)
            assert (v.dtype == np.bool_) == (kind == "bool") and (kind == "bool" or v.dtype == np.float32), line
            env[name] = v
        elif m := _STORE.fullmatch(line):
            stored = True
            array, operand = m.groups()
            buffers[array][...] = val(operand)
        else:
            raise AssertionError(f"{line!r} is not a load, one operation or a store")
    assert stored, "the kernel stores nothing"


def _arguments(op: Elementwise, seed: int) -> list:
    """Random float32 arguments in the op's call order: (7, 13) arrays, a row operand a row of 13."""
    rng = np.random.default_rng(seed)
    traced = op.traced
    out = []
    for p in op.params:
        if p in traced.scalars:
            out.append(np.float32(rng.uniform(0.05, 0.95)))
        elif p in traced.rows:
            out.append(rng.standard_normal(13).astype(np.float32))
        else:
            out.append((rng.standard_normal((7, 13)) * 10.0 ** rng.integers(-3, 3, (7, 13))).astype(np.float32))
    return out


def _same_bits_as_numpys_passes(op: Elementwise, source: str | None = None) -> None:
    """``source`` (default: the op's kernel) run by ``run_on_cpu`` gives the bits of the op's NumPy passes."""
    args = _arguments(op, len(op.name))
    ref = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    with cpu_form("numpy"), np.errstate(all="ignore"):
        op(*ref)
    buffers = {p: a.ravel() for p, a in zip(op.params, args) if p not in op.traced.scalars}
    scalars = {p: a for p, a in zip(op.params, args) if p in op.traced.scalars}
    run_on_cpu(source or op.cuda_source, buffers, scalars)
    for p, want, got in zip(op.params, ref, args):
        if p in op.traced.outputs:
            assert got.tobytes() == want.tobytes(), f"{op.name}: output {p} differs from NumPy's passes"


def _optimizer_ops():
    """Every optimizer of the registry in every variant, with and without the EMA: {id: its update's op}."""
    ops = {}
    for variant, kw in VARIANTS.items():
        for with_ema in (False, True):
            params = np.linspace(-1, 1, 8, dtype=np.float32)
            opt = OPTIMIZERS[variant.split("-")[0]](params, ema=EMA(params, 0.99) if with_ema else None, **kw)
            ops[f"{variant}-{'ema' if with_ema else 'no-ema'}"] = opt._op
    return ops


def test_every_layer_op_kernel_computes_numpys_bits():
    ops = [op for op in elementwise.made() if op.in_module]
    assert {"bias_add", "relu", "relu_backward", "add_relu", "add_scaled", "mean2"} <= {op.name for op in ops}
    for op in ops:
        _same_bits_as_numpys_passes(op)


@pytest.mark.parametrize("case", list(_optimizer_ops()))
def test_every_optimizer_update_kernel_computes_numpys_bits(case):
    _same_bits_as_numpys_passes(_optimizer_ops()[case])


def test_a_new_optimizer_in_one_file_needs_no_cuda_text():
    """Lion, from its one file: its generated kernel (with the EMA) is held to its own NumPy passes."""
    lion = _load("lion")
    params = np.linspace(-1, 1, 8, dtype=np.float32)
    _same_bits_as_numpys_passes(lion.Lion(params, ema=EMA(params, 0.99))._op)


def test_another_association_is_told_apart():
    """The check sees a kernel that rounds otherwise: ``(a * b) * c`` run as ``a * (b * c)`` differs."""
    left = Elementwise("assoc_left", lambda a, b, c: (a * b) * c, ("a",), module=False)
    right = Elementwise("assoc_right", lambda a, b, c: a * (b * c), ("a",), module=False)
    assert "__fmul_rn(a, b)" in left.cuda_source and "__fmul_rn(b, c)" in right.cuda_source
    with pytest.raises(AssertionError, match="differs from NumPy's passes"):
        _same_bits_as_numpys_passes(left, right.cuda_source)
    _same_bits_as_numpys_passes(left)


def test_a_statement_of_two_operations_is_refused():
    """One operation a statement is what fixes the order; an emitter writing ``a + b * c`` is caught."""
    source = ("__global__ void k(float* a_, int n) {\n    for (int i = 0; i < n; i += blockDim.x * gridDim.x) {\n"
              "        const float a = a_[i];\n        const float t1 = a + a / a;\n        a_[i] = t1;\n    }\n}\n")
    with pytest.raises(AssertionError, match="not one operation"):
        run_on_cpu(source, {"a": np.ones(4, np.float32)}, {})


def test_literals_are_the_float32_values():
    for v in (0.1, 1.0, 1e-8, 3.4e38, -2.5, 1 / 3):
        assert np.float32(float(cuda_form.literal(v)[:-1])) == np.float32(v)
