"""An elementwise op's arithmetic, written once as a Python function of scalars, traced into an expression DAG.

A definition is a plain Python function whose arguments stand for one element
of each array (and for the op's scalars), built from ``+``, ``-``, ``*``,
``/``, unary ``-``, the comparisons ``<``, ``<=``, ``>``, ``>=`` and the
functions ``sqrt``, ``maximum`` and ``where`` of this module; Python ``if``
and loops are allowed on the op's own settings (an optimizer's momentum, say),
which are fixed when the function is traced, never on the traced values::

    def ema(shadow, params, one_minus_d):
        return shadow - (shadow - params) * one_minus_d

Called with ``Expr`` arguments (``trace``), the function records every
operation as a node of a DAG, in the order the function performs them; the
forms of the op are rendered from that DAG (``towers.ops.codegen.numpy_form``,
``numba_form``, ``cuda_form``), so each performs the same float operations on
the same operands.  Called with NumPy or CuPy arrays or float scalars, the
same function computes directly, each operation a whole-array pass: the
reference the tests compare the rendered forms with.

Types: every value has the arrays' float dtype.  A Python number in a
definition is a constant of that dtype (never an int or a float64: numba would
otherwise promote float32 arithmetic to float64); a comparison is a boolean,
usable only as ``where``'s condition.  ``maximum`` is ``numpy.maximum``
(NaN wins; the second operand on ties).  Limits: no integer arithmetic, no
reductions, no access to other elements (a row operand, one value per column,
is the one exception: ``towers.ops.codegen.elementwise``).
"""
from __future__ import annotations

import itertools

import numpy

#: The binary float operations and their symbol (in Python, C and the DAG's text).
BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
#: The comparisons: boolean results, only for ``where``.
COMPARE = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}

_ids = itertools.count()


class Expr:
    """One node of a traced definition: ``op`` over ``args`` (nodes), or a leaf.

    Leaves: ``arg`` (``value`` the argument's name) and ``const`` (``value`` a
    float).  ``id`` orders nodes as the definition made them: a node's
    arguments always have smaller ids.
    """

    __slots__ = ("op", "args", "value", "id")

    def __init__(self, op: str, args: tuple = (), value=None):
        self.op, self.args, self.value, self.id = op, args, value, next(_ids)

    @property
    def is_bool(self) -> bool:
        return self.op in COMPARE

    def __repr__(self) -> str:
        return text(self)

    def __bool__(self):
        raise TypeError("a traced value has no truth value: a definition branches on its settings only; "
                        "use where(condition, a, b)")

    __hash__ = object.__hash__

    # arithmetic (a Python number becomes a constant of the arrays' dtype)
    def __add__(self, o): return _binary("add", self, o)
    def __radd__(self, o): return _binary("add", o, self)
    def __sub__(self, o): return _binary("sub", self, o)
    def __rsub__(self, o): return _binary("sub", o, self)
    def __mul__(self, o): return _binary("mul", self, o)
    def __rmul__(self, o): return _binary("mul", o, self)
    def __truediv__(self, o): return _binary("div", self, o)
    def __rtruediv__(self, o): return _binary("div", o, self)
    def __neg__(self): return Expr("neg", (self,))
    def __gt__(self, o): return _binary("gt", self, o)
    def __ge__(self, o): return _binary("ge", self, o)
    def __lt__(self, o): return _binary("lt", self, o)
    def __le__(self, o): return _binary("le", self, o)


def _node(x) -> Expr:
    if isinstance(x, Expr):
        if x.is_bool:
            raise TypeError("a comparison is only a condition of where(), not a number")
        return x
    if isinstance(x, (bool, numpy.bool_)) or not isinstance(x, (int, float, numpy.floating, numpy.integer)):
        raise TypeError(f"a definition's constants are numbers, got {x!r}")
    return Expr("const", value=float(x))


def _binary(op: str, a, b) -> Expr:
    return Expr(op, (_node(a), _node(b)))


def _traced(*xs) -> bool:
    return any(isinstance(x, Expr) for x in xs)


def sqrt(x):
    """The IEEE square root (``numpy.sqrt``)."""
    if _traced(x):
        return Expr("sqrt", (_node(x),))
    return _module(x).sqrt(x)


def maximum(a, b):
    """``numpy.maximum(a, b)``: NaN wins, and ``b`` where they compare equal (so ``maximum(-0.0, 0)`` is +0)."""
    if _traced(a, b):
        return Expr("max", (_node(a), _node(b)))
    return _module(a, b).maximum(a, b)


def where(condition, a, b):
    """``a`` where ``condition`` holds, else ``b`` (``numpy.where``)."""
    if _traced(condition, a, b):
        if not (isinstance(condition, Expr) and condition.is_bool):
            raise TypeError("where()'s condition is a comparison")
        return Expr("where", (condition, _node(a), _node(b)))
    return _module(condition, a, b).where(condition, a, b)


def _module(*xs):
    for x in xs:
        mod = type(x).__module__.split(".")[0]
        if mod == "cupy":
            import cupy

            return cupy
    return numpy


def nodes(outputs) -> list:
    """Every node the ``outputs`` depend on, in the order the definition made them (arguments first)."""
    seen, todo = {}, list(outputs)
    while todo:
        n = todo.pop()
        if n.id not in seen:
            seen[n.id] = n
            todo.extend(n.args)
    return [seen[i] for i in sorted(seen)]


def render(node: Expr, ref, spelling: dict, const) -> str:
    """One operation of a traced definition as an expression of a target language (the forms' one writer).

    ``ref(arg_node)``: an operand's text; ``const(value)``: a constant's;
    ``spelling``: the language's format, over the operands' texts ``{0}``,
    ``{1}``, ``{2}``, of each operation not written infix (``sqrt``, ``max``,
    ``where``; ``mul`` or others where the language wants a call).
    Arithmetic, comparisons and ``neg`` are infix unless spelled.
    """
    if node.op == "const":
        return const(node.value)
    fmt = spelling.get(node.op)
    if fmt is None:
        if node.op == "neg":
            fmt = "-{0}"
        elif node.op in BINARY or node.op in COMPARE:
            fmt = "{0} " + (BINARY.get(node.op) or COMPARE[node.op]) + " {1}"
        else:
            raise ValueError(f"no spelling of {node.op!r}")
    return fmt.format(*(ref(a) for a in node.args))


def text(node: Expr) -> str:
    """A node as one fully parenthesized expression over the argument names (for messages and cache keys)."""
    if node.op == "arg":
        return node.value
    if node.op == "const":
        return repr(node.value)
    a = [text(x) for x in node.args]
    if node.op in BINARY or node.op in COMPARE:
        return f"({a[0]} {BINARY.get(node.op) or COMPARE[node.op]} {a[1]})"
    if node.op == "neg":
        return f"(-{a[0]})"
    return f"{node.op}({', '.join(a)})"


class Traced:
    """A definition traced over named arguments: the DAG of each output.

    ``arrays``: names of the per-element arguments, then of the output-only
    arrays (``rows``: those that hold one value per column of a row-major 2-D
    array); ``scalars``:
    names of the per-call scalars; ``outputs``: {array name: node}, in the
    op's output order.  ``scalar_only(node)``: whether ``node`` depends on
    scalars and constants alone (computed once per call, not per element).
    """

    def __init__(self, arrays: tuple, scalars: tuple, rows: tuple, outputs: dict):
        self.arrays, self.scalars, self.rows, self.outputs = tuple(arrays), tuple(scalars), tuple(rows), outputs
        self.nodes = nodes(outputs.values())
        self.args = {n.value: n for n in self.nodes if n.op == "arg"}
        self._scalar = {}
        for n in self.nodes:
            self._scalar[n.id] = (n.op == "const" or (n.op == "arg" and n.value in self.scalars)
                                  or (n.op not in ("arg", "const") and all(self._scalar[a.id] for a in n.args)))

    def scalar_only(self, node: Expr) -> bool:
        return self._scalar[node.id]

    def key(self) -> str:
        """The whole computation as text: two ops with the same key perform the same arithmetic."""
        return "; ".join(f"{o} = {text(n)}" for o, n in self.outputs.items())


def trace(fn, arrays: tuple, scalars: tuple = (), rows: tuple = (), outputs: tuple = ()) -> Traced:
    """Call ``fn`` with an ``Expr`` per name of ``arrays`` and ``scalars`` (keyword arguments) and record what
    it returns for each of ``outputs``: one node (a single output) or a dict {output: node}.  An output no operation changes (a node that is an argument) is
    allowed: it is copied.
    """
    args = {name: Expr("arg", value=name) for name in (*arrays, *scalars)}
    result = fn(**args)
    if not isinstance(result, dict):
        if len(outputs) != 1:
            raise TypeError(f"{getattr(fn, '__name__', fn)} returns one value for outputs {outputs}")
        result = {outputs[0]: result}
    if set(result) != set(outputs):
        raise TypeError(f"{getattr(fn, '__name__', fn)} returns {sorted(result)}, not the outputs {list(outputs)}")
    out = {}
    for name in outputs:
        node = result[name]
        if not isinstance(node, Expr):
            node = _node(node)
        if node.is_bool:
            raise TypeError(f"output {name} is a comparison: give where(condition, 1, 0)")
        out[name] = node
    for name in rows:
        if name not in arrays:
            raise TypeError(f"row operand {name} is not an array argument")
    return Traced((*arrays, *(o for o in outputs if o not in arrays)), scalars, rows, out)
