"""An elementwise op's array form: one in-place NumPy (or CuPy) pass per operation of its definition.

From the traced definition (``towers.ops.codegen.expr``) this module writes the
Python source of one function that runs every operation as a ufunc call with
``out=``, in the definition's order, then compiles it (``exec``) once per op:

* operations on scalars and constants alone run once per call, on NumPy
  scalars of the arrays' dtype (``1 - beta1``);
* every other operation is one pass over the elements, written into a
  location chosen when the source is made: an output buffer whose old value is
  no longer read (``m *= beta1``), an operand whose value dies in this pass
  (in place), or a scratch buffer (as few as the definition's live values
  need: one for Adam with the EMA);
* ``where(c, 1, 0)`` that is only multiplied (or read by a ``where``) is no
  pass: the boolean mask itself is the operand (a float times a bool is the
  float times 1.0 or 0.0, with a quarter of a float mask's memory traffic);
* ``maximum`` against a constant reads an array of that constant (NumPy's
  array-array loop is SIMD, several times faster than its array-scalar one),
  kept at most ``CONSTANT_ELEMENTS`` long: a longer pass runs in pieces;
* an output whose value ends elsewhere is copied there last.

Each pass rounds as the operation does in any form (IEEE float32 ``+ - * /``
and ``sqrt``), so the passes give the bits of the compiled loop and of the CUDA
kernel on the same inputs.

Each call runs every pass over the whole arrays.  Scratch buffers for host
arrays are kept per thread (CPU towers update their slices concurrently) and
grow to the largest call; a device call (CuPy: the GPU's fallback for dtypes
and sizes its kernels do not take) makes its own.

Measured (``--cpu-kernels numpy``, 2 CPU towers, CPU ms per step of one
process alternating the forms, on 2 shared cores): the definition itself on
whole arrays, one temporary per operation, costs 1.15-1.6x these passes on
the MLP, LeNet-5, ResNet-20 and the default job (fresh memory per operation;
10-25x on an optimizer's update alone); without the masks 1.06-1.29x, without
the constant's array 1.0-1.12x (``relu`` takes these passes in every mode).
Running the passes block by block to stay in L2 showed no gain in any of them
(0.93-1.03x), so the passes run whole.

Aliasing: an op's in-place outputs are its own buffers; an output-only buffer
is written no earlier than the pass that last reads the op's input arrays
(after it, when that pass is a ``where``, which writes before it reads), so
an output given the same memory as an input, ``relu(y, y)``, is safe.
"""
from __future__ import annotations

import threading

import numpy

from towers.arrays import on_host
from towers.ops.codegen.expr import Traced, render

_UFUNC = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "neg": "negative", "sqrt": "sqrt",
          "max": "maximum", "gt": "greater", "ge": "greater_equal", "lt": "less", "le": "less_equal"}
_NEVER = 1 << 30  # the last use of an output's final value: after every pass


def _masks(passes) -> set:
    """Ids of the ``where(c, 1, 0)`` whose comparison's boolean array stands for them: those only multiplied
    (into a float pass: a float times a bool is the float times 1.0 or 0.0) or read by a ``where``.  Added,
    subtracted or negated, a bool would not count as 1 and 0, so such a ``where`` is a float pass."""
    consumers = {}
    for n in passes:
        for a in n.args:
            consumers.setdefault(a.id, []).append(n.op)
    return {n.id for n in passes
            if n.op == "where" and n.args[1].op == "const" and n.args[1].value == 1.0
            and n.args[2].op == "const" and n.args[2].value == 0.0
            and all(op in ("mul", "where") for op in consumers.get(n.id, ()))}


def source(traced: Traced, params: tuple) -> tuple[str, int, int]:
    """(Python source of ``passes(xp, S, B, dt, *params)``, float scratch count, bool scratch count).

    ``params``: the function's parameters, the op's arrays and scalars in its
    call order; ``S``, ``B``: the float and bool scratch arrays; ``dt``: the
    arrays' scalar type.  The values computed once per call come first, then
    one line per pass (``_Places`` says where each writes), then the copies of
    outputs whose value ends elsewhere.
    """
    number = {n.id: k for k, n in enumerate(traced.nodes)}  # names numbered per op

    def name(n) -> str:
        return f"c{number[n.id]}"

    passes = [n for n in traced.nodes if not traced.scalar_only(n) and n.op != "arg"]
    masks = _masks(passes)
    places = _Places(traced, passes)

    def operand(a) -> str:
        if not traced.scalar_only(a):
            return _at(places.of[a.id])
        return a.value if a.op == "arg" else name(a)

    body = []
    for j, n in enumerate(passes):
        if n.id in masks:  # no pass: the condition's mask stands for it
            places.share(n, n.args[0])
            continue
        out = _at(places.put(n, j))
        if n.op == "where":
            body.append(f"    xp.copyto({out}, {operand(n.args[2])})")
            body.append(f"    xp.copyto({out}, {operand(n.args[1])}, where={operand(n.args[0])})")
        elif n.op == "max" and any(map(_constant_only, n.args)):
            # maximum against a constant reads an array of it (module doc); a per-call scalar stays a scalar
            first = _constant_only(n.args[0])
            other, const = (n.args[1], n.args[0]) if first else n.args
            body.append(f"    _max_constant(xp, {operand(other)}, {operand(const)}, {out}, {first})")
        else:
            args = ", ".join(operand(a) for a in n.args)
            body.append(f"    xp.{_UFUNC[n.op]}({args}, out={out})")
    copies = [(o, operand(node)) for o, node in traced.outputs.items() if places.of.get(node.id) != "buf:" + o]
    if any(src in {o for o, _ in copies} for _, src in copies):
        raise NotImplementedError(f"outputs {[o for o, _ in copies]} would be copied over one another")
    body += [f"    xp.copyto({o}, {src})" for o, src in copies]
    head = [f"    {name(n)} = {_scalar_text(n, name)}" for n in _per_call(traced, passes, masks)]
    text = ("def passes(xp, S, B, dt, " + ", ".join(params) + "):\n" + "\n".join(head + body or ["    pass"]) + "\n")
    return text, places.count["S"], places.count["B"]


def _per_call(traced: Traced, passes: list, masks: set) -> list:
    """The scalar-only operations a pass or an output reads, in order (a mask's 1 and 0 are no operands)."""
    needed = {a.id for n in passes if n.id not in masks for a in n.args} | {n.id for n in traced.outputs.values()}
    for n in reversed(traced.nodes):
        if n.id in needed and traced.scalar_only(n):
            needed.update(a.id for a in n.args)
    return [n for n in traced.nodes if traced.scalar_only(n) and n.op != "arg" and n.id in needed]


class _Places:
    """Where each pass writes: the locations ``buf:<array>``, ``S[k]`` (float scratch) and ``B[k]`` (bool
    scratch), and the values each holds, pass by pass.

    A pass writes, in this order of preference: its output's buffer (when it
    is an output's final value), the location of an operand whose value dies
    in this pass, any location whose values are all dead, a new scratch.  An
    output's buffer is written only when it is an in-place output or the
    pass reads the op's input arrays for the last time or later (an
    output-only buffer may share an input's memory), and a ``where``, which
    writes its "else" value before it reads its condition and "then" value,
    writes neither of those two's locations and no output-only buffer in the
    pass that reads the inputs last.  An output's final value never sits in
    another output's buffer (the copies stay simple).
    """

    def __init__(self, traced: Traced, passes: list):
        self.outs = traced.outputs
        self.in_place = set(traced.args)
        self.last = {a.id: j for j, n in enumerate(passes) for a in n.args}  # the last pass reading each value
        self.last.update({node.id: _NEVER for node in self.outs.values()})
        self.homes = {}  # node id -> the buffers of the outputs whose final value it is
        for name, node in self.outs.items():
            self.homes.setdefault(node.id, []).append("buf:" + name)
        inputs = [a for a in traced.arrays if a not in self.outs and a in traced.args]
        self.safe_from = max((self.last.get(traced.args[a].id, -1) for a in inputs), default=-1)
        self.held = {"buf:" + a: [traced.args[a].id] if a in traced.args else [] for a in traced.arrays}
        self.of = {traced.args[a].id: "buf:" + a for a in traced.arrays if a in traced.args}  # node id -> location
        self.count = {"S": 0, "B": 0}

    def share(self, n, like) -> None:
        """``n`` stands in ``like``'s location (a mask)."""
        self.of[n.id] = self.of[like.id]
        self.held[self.of[n.id]].append(n.id)

    def put(self, n, j: int) -> str:
        """The location pass ``j`` (node ``n``) writes, recorded as holding it."""
        kind = "B" if n.is_bool else "S"
        excluded = {self.of.get(a.id) for a in n.args[:2]} if n.op == "where" else set()
        home = self.homes.get(n.id, [])
        candidates = home + [self.of.get(a.id) for a in n.args] + list(self.held)
        if home:
            candidates = [c for c in candidates if c in home or not (c or "").startswith("buf:")]
        loc = next((c for c in candidates if c is not None and c not in excluded and self._takes(c, kind, j, n)),
                   None)
        if loc is None:
            loc = f"{kind}[{self.count[kind]}]"
            self.count[kind] += 1
            self.held[loc] = []
        self.held[loc] = [x for x in self.held[loc] if self.last.get(x, -1) > j] + [n.id]
        self.of[n.id] = loc
        return loc

    def _takes(self, loc: str, kind: str, j: int, n) -> bool:
        """Whether pass ``j`` may write ``loc``: the right kind, writable (class doc), its values all dead."""
        if ("B" if loc.startswith("B[") else "S") != kind:
            return False
        if loc.startswith("buf:"):
            name = loc[4:]
            if name not in self.outs or not (name in self.in_place or j > self.safe_from
                                             or (j == self.safe_from and n.op != "where")):
                return False
        return all(self.last.get(x, -1) <= j for x in self.held[loc])


def _constant_only(node) -> bool:
    """Whether ``node`` depends on the definition's constants alone (the same value at every call)."""
    return node.op == "const" or (node.op not in ("arg",) and bool(node.args) and all(map(_constant_only, node.args)))


def _at(loc: str) -> str:
    return loc[4:] if loc.startswith("buf:") else loc


_SCALAR_SPELLING = {"sqrt": "numpy.sqrt({0})", "max": "numpy.maximum({0}, {1})", "where": "({1} if {0} else {2})"}


def _scalar_text(n, name) -> str:
    """A scalar-only node on NumPy scalars of the arrays' dtype ``dt`` (``name``: a node's local)."""
    return render(n, lambda a: a.value if a.op == "arg" else name(a), _SCALAR_SPELLING, lambda v: f"dt({v!r})")


#: The longest array of a constant kept (elements): a longer pass runs in pieces of this length, so a large call
#: (an evaluation chunk, a prediction batch) leaves no array of its size behind.
CONSTANT_ELEMENTS = 1 << 20
_CONSTANTS: dict = {}  # (value, dtype) -> a read-only host array of it, up to CONSTANT_ELEMENTS (shared by all threads)


def _max_constant(xp, x, value, out, first: bool) -> None:
    """``maximum(x, value)`` into ``out`` (``maximum(value, x)`` when ``first``: the order NumPy's ``maximum``
    takes its operands in, which decides between -0.0 and 0.0).  On the host ``value`` is read from an array of
    it (module doc): over flat arrays in pieces of at most ``CONSTANT_ELEMENTS``; an ``out`` longer than that
    whose ``x`` is not a flat array of its size takes the scalar.  On a device, the scalar."""
    n = out.size
    if not on_host(out) or (n > CONSTANT_ELEMENTS and not (
            out.flags.c_contiguous and x.flags.c_contiguous and x.size == n)):
        xp.maximum(value, x, out=out) if first else xp.maximum(x, value, out=out)
        return
    if n <= CONSTANT_ELEMENTS:
        c = _constant(value, n).reshape(out.shape)
        numpy.maximum(c, x, out=out) if first else numpy.maximum(x, c, out=out)
        return
    xf, of = x.reshape(-1), out.reshape(-1)
    for i in range(0, n, CONSTANT_ELEMENTS):
        m = min(CONSTANT_ELEMENTS, n - i)
        c, xs, os_ = _constant(value, m), xf[i: i + m], of[i: i + m]
        numpy.maximum(c, xs, out=os_) if first else numpy.maximum(xs, c, out=os_)


def _constant(value, size: int):
    """A read-only flat host array of ``size`` (at most ``CONSTANT_ELEMENTS``) copies of ``value``."""
    key = (value.tobytes(), value.dtype.str)  # by its bits: -0.0 is not 0.0, and a NaN finds itself
    a = _CONSTANTS.get(key)
    if a is None or a.size < size:
        a = numpy.full(min(max(size, 1 << 16), CONSTANT_ELEMENTS), value)
        a.flags.writeable = False
        _CONSTANTS[key] = a  # a thread that grew it concurrently just made one more
    return a[:size]


class NumpyForm:
    """The op's passes (``source``), compiled once, run over whole arrays (module doc)."""

    def __init__(self, traced: Traced, params: tuple, name: str):
        self.source, self.n_float, self.n_bool = source(traced, params)
        self.name, self.rows = name, bool(traced.rows)
        scope = {"numpy": numpy, "_max_constant": _max_constant}
        exec(compile(self.source, f"<{name}: numpy form>", "exec"), scope)
        self._passes = scope["passes"]
        self._local = threading.local()

    def __call__(self, xp, args: list, arrays: list, lead) -> None:
        """Run the passes: ``args`` in the op's call order, ``arrays`` the array ones, ``lead`` an output.

        Host arrays that are C-contiguous and of the outputs' size run as flat
        arrays (whatever their shapes, as the compiled loop takes them); an op
        with row operands keeps the shapes, so NumPy's broadcasting refuses a
        row operand that is not a row long."""
        n, shape = lead.size, lead.shape
        if not on_host(lead):
            S = [xp.empty(shape, lead.dtype) for _ in range(self.n_float)]
            B = [xp.empty(shape, bool) for _ in range(self.n_bool)]
        else:
            if not self.rows and all(a.flags.c_contiguous and a.size == n for a in arrays):
                shape = (n,)
                args = [a.reshape(-1) if on_host(a) else a for a in args]
            S, B = self._scratch(lead.dtype, n, shape)
        self._passes(xp, S, B, lead.dtype.type, *args)

    def _scratch(self, dtype, n: int, shape: tuple):
        """This thread's scratch of ``dtype`` in ``shape`` (``n`` elements), made once per thread and dtype and
        grown to the largest call: fresh memory costs a page fault per page on its first pass."""
        pool = self._local.__dict__
        have = pool.get(dtype.str)
        if have is None or (have[0] and have[0][0].size < n) or (have[1] and have[1][0].size < n):
            size = max(n, 1)
            have = pool[dtype.str] = ([numpy.empty(size, dtype) for _ in range(self.n_float)],
                                      [numpy.empty(size, bool) for _ in range(self.n_bool)])
        return [s[:n].reshape(shape) for s in have[0]], [b[:n].reshape(shape) for b in have[1]]
