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
  array-array loop is SIMD and about 1.8x faster than its array-scalar one);
* an output whose value ends elsewhere is copied there last.

Each pass rounds as the operation does in any form (IEEE float32 ``+ - * /``
and ``sqrt``), so the passes give the bits of the compiled loop and of the CUDA
kernel on the same inputs.

Host arrays that are C-contiguous and of one size run block by block
(``host_blocks``: every pass over one block of each buffer, then the next
block), so an op's passes over a block hit L1/L2 instead of each streaming the
whole buffer from memory; elementwise passes give the same bits blocked or
not.  Scratch buffers are a block long, kept per thread (CPU towers update
their slices concurrently).  Other arrays (strided, a row operand, CuPy
arrays: the GPU's fallback for dtypes and sizes its kernels do not take) run
as whole-array passes with scratch made per call.

Aliasing: an op's in-place outputs are its own buffers; an output-only buffer
is written no earlier than the pass that last reads the op's input arrays
(after it, when that pass is a ``where``, which writes before it reads), so
an output given the same memory as an input, ``relu(y, y)``, is safe.
"""
from __future__ import annotations

import threading

import numpy

from towers.ops.codegen.expr import Traced, render

# Bytes of each buffer in one block of a blocked host pass.  Several in-place
# NumPy passes over one block (Adam + EMA: 15 passes over 6 buffers) then run in
# L1/L2 instead of each streaming a multi-megabyte buffer from memory.  Smaller
# blocks mean more NumPy calls, each a hand-off of the GIL when CPU tower
# threads update concurrently.  Measured on this project's 2-core Xeon (48 KiB
# L1d, 2 MiB L2 per core), Adam + EMA of one tower and Adam of the other over
# half of LeNet-5's 1.66M parameters, ms per step: one thread 5.26 unblocked,
# 3.13 at 256 KiB, 3.16 at 512, 3.41 at 768, 3.81 at 1 MiB; two threads at once
# (each its half) 5.30 unblocked, 5.46 at 256 KiB, 4.26 at 512, 4.20 at 768,
# 4.36 at 1 MiB.  In bytes, so float64 (gradient checks) keeps the working set.
HOST_BLOCK_BYTES = 512 * 1024

_UFUNC = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "neg": "negative", "sqrt": "sqrt",
          "max": "maximum", "gt": "greater", "ge": "greater_equal", "lt": "less", "le": "less_equal"}
_NEVER = 1 << 30  # the last use of an output's final value: after every pass


def host_blocks(start: int, stop: int, itemsize: int):
    """Slices that cut ``[start, stop)`` into consecutive blocks of ``HOST_BLOCK_BYTES`` (the last one shorter).

    For host passes that are elementwise: running all of them block by block
    gives the same bits as running each over the whole range.
    """
    step = max(1, HOST_BLOCK_BYTES // itemsize)
    return [slice(i, min(i + step, stop)) for i in range(start, stop, step)]


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
    arrays' scalar type.
    """
    outs = traced.outputs
    number = {n.id: k for k, n in enumerate(traced.nodes)}  # names numbered per op

    def _name(n) -> str:
        return f"c{number[n.id]}"

    def _scalar_expr(n) -> str:
        return _scalar_text(n, _name)

    passes = [n for n in traced.nodes if not traced.scalar_only(n) and n.op != "arg"]
    masks = _masks(passes)
    last = {}
    for j, n in enumerate(passes):
        for a in n.args:
            last[a.id] = j
    for node in outs.values():
        last[node.id] = _NEVER
    finals = {}
    for name, node in outs.items():
        finals.setdefault(node.id, []).append(name)
    inputs = [a for a in traced.arrays if a not in outs]
    # An output-only buffer may alias an input array: written no earlier than the inputs' last read.
    safe_from = max((last.get(traced.args[a].id, -1) for a in inputs if a in traced.args),
                                            default=-1)

    occupants = {}  # location -> node ids it holds ("buf:<name>", "S[k]", "B[k]")
    where_is = {}  # node id -> location
    for name in traced.arrays:
        loc = "buf:" + name
        occupants[loc] = []
        if name in traced.args:
            occupants[loc].append(traced.args[name].id)
            where_is[traced.args[name].id] = loc
    counts = {"S": 0, "B": 0}

    def free(loc, j) -> bool:
        return all(last.get(x, -1) <= j for x in occupants[loc])

    def writable(loc, j, two_steps) -> bool:
        if not loc.startswith("buf:"):
            return True
        name = loc[4:]
        # A pass that reads the inputs' last values may write over them elementwise, but a where() writes its
        # "else" value before it reads its condition and "then" value: it needs the inputs read already.
        return name in outs and (name in traced.args or j > safe_from or (j == safe_from and not two_steps))

    def new_scratch(kind):
        loc = f"{kind}[{counts[kind]}]"
        counts[kind] += 1
        occupants[loc] = []
        return loc

    head, body = [], []
    # Scalar-only values: once per call, those a pass or an output reads (a mask's 1 and 0 are no operands).
    needed = {a.id for n in passes if n.id not in masks for a in n.args} | {n.id for n in outs.values()}
    for n in reversed(traced.nodes):
        if n.id in needed and traced.scalar_only(n):
            needed.update(a.id for a in n.args)
    for n in traced.nodes:
        if traced.scalar_only(n) and n.op != "arg" and n.id in needed:
            head.append(f"    {_name(n)} = {_scalar_expr(n)}")

    def operand(a, j, like=None):
        if traced.scalar_only(a):
            name = a.value if a.op == "arg" else _name(a)
            return f"_constant(xp, {name}, {like})" if like else name
        return _at(where_is[a.id])

    def usable(loc, kind, j, excluded, two_steps) -> bool:
        return (loc is not None and loc not in excluded and ("B" if loc.startswith("B[") else "S") == kind
                and writable(loc, j, two_steps) and free(loc, j))

    for j, n in enumerate(passes):
        if n.id in masks:  # no pass: the condition's mask stands for it
            loc = where_is[n.args[0].id]
            occupants[loc].append(n.id)
            where_is[n.id] = loc
            continue
        kind = "B" if n.is_bool else "S"
        # where() writes its "else" value first: its condition and "then" value must stay intact until read.
        excluded = {where_is.get(a.id) for a in n.args[:2]} if n.op == "where" else set()
        home = ["buf:" + name for name in finals.get(n.id, ())]
        candidates = (home  # an output's final value, at home
                      + [where_is.get(a.id) for a in n.args]  # in place over an operand that dies here
                      + list(occupants))  # any free location
        if n.id in finals:  # an output's final value never sits in another output's buffer (copies stay simple)
            candidates = [c for c in candidates if c in home or not (c or "").startswith("buf:")]
        loc = next((c for c in candidates if usable(c, kind, j, excluded, n.op == "where")), None) or new_scratch(kind)
        occupants[loc] = [x for x in occupants[loc] if last.get(x, -1) > j] + [n.id]
        where_is[n.id] = loc
        out = _at(loc)
        if n.op == "where":
            body.append(f"    xp.copyto({out}, {operand(n.args[2], j)})")
            body.append(f"    xp.copyto({out}, {operand(n.args[1], j)}, where={operand(n.args[0], j)})")
        else:
            # maximum against a constant reads an array of it (module doc); a per-call scalar stays a scalar
            args = ", ".join(operand(a, j, out if n.op == "max" and _constant_only(a) else None) for a in n.args)
            body.append(f"    xp.{_UFUNC[n.op]}({args}, out={out})")
    copies = []
    for name, node in outs.items():
        loc = "buf:" + name
        if where_is.get(node.id) == loc:
            continue
        src = operand(node, len(passes)) if traced.scalar_only(node) else _at(where_is[node.id])
        copies.append((name, src))
    targets = {_at("buf:" + name) for name, _ in copies}
    if any(src in targets for _, src in copies):
        raise NotImplementedError(f"outputs {[c[0] for c in copies]} would be copied over one another")
    body += [f"    xp.copyto({name}, {src})" for name, src in copies]
    text = ("def passes(xp, S, B, dt, " + ", ".join(params) + "):\n" + "\n".join(head + body or ["    pass"]) + "\n")
    return text, counts["S"], counts["B"]


def _constant_only(node) -> bool:
    """Whether ``node`` depends on the definition's constants alone (the same value at every call)."""
    return node.op == "const" or (node.op not in ("arg",) and bool(node.args) and all(map(_constant_only, node.args)))


def _at(loc: str) -> str:
    return loc[4:] if loc.startswith("buf:") else loc


_SCALAR_SPELLING = {"sqrt": "numpy.sqrt({0})", "max": "numpy.maximum({0}, {1})", "where": "({1} if {0} else {2})"}


def _scalar_text(n, name) -> str:
    """A scalar-only node on NumPy scalars of the arrays' dtype ``dt`` (``name``: a node's local)."""
    return render(n, lambda a: a.value if a.op == "arg" else name(a), _SCALAR_SPELLING, lambda v: f"dt({v!r})")


_CONSTANTS: dict = {}  # (value, dtype) -> a read-only host array of it, grown as needed (shared by all threads)


def _constant(xp, value, like):
    """``value`` as an operand of ``maximum``: on the host a read-only array of it shaped like the pass's output
    ``like`` (see the module doc), on a device the scalar."""
    if xp is not numpy:
        return value
    key = (value.tobytes(), value.dtype.str)  # by its bits: -0.0 is not 0.0, and a NaN finds itself
    shape = like.shape
    size = like.size
    a = _CONSTANTS.get(key)
    if a is None or a.size < size:
        a = numpy.full(max(size, 1 << 16), value)
        a.flags.writeable = False
        _CONSTANTS[key] = a  # a thread that grew it concurrently just made one more
    return a[:size].reshape(shape)


class NumpyForm:
    """The op's passes (``source``), run block by block on host arrays, whole on other arrays (module doc)."""

    def __init__(self, traced: Traced, params: tuple, name: str):
        self.source, self.n_float, self.n_bool = source(traced, params)
        self.name, self.rows = name, traced.rows
        scope = {"numpy": numpy, "_constant": _constant}
        exec(compile(self.source, f"<{name}: numpy form>", "exec"), scope)
        self._passes = scope["passes"]
        self._local = threading.local()

    def __call__(self, xp, args: list, arrays: list, lead) -> None:
        """Run the passes: ``args`` in the op's call order, ``arrays`` the array ones, ``lead`` an output."""
        dt = lead.dtype.type
        n = lead.size
        if xp is numpy and not self.rows and all(a.flags.c_contiguous and a.size == n for a in arrays):
            step = max(1, HOST_BLOCK_BYTES // lead.itemsize)
            S, B = self._scratch(lead.dtype, min(n, step))
            flat = [a.reshape(-1) if isinstance(a, numpy.ndarray) else a for a in args]
            if n <= step:
                self._passes(xp, [s[:n] for s in S], [b[:n] for b in B], dt, *flat)
                return
            is_array = [isinstance(a, numpy.ndarray) for a in flat]
            for block in host_blocks(0, n, lead.itemsize):
                m = block.stop - block.start
                self._passes(xp, [s[:m] for s in S], [b[:m] for b in B], dt,
                             *[a[block] if arr else a for a, arr in zip(flat, is_array)])
            return
        S = [xp.empty(lead.shape, lead.dtype) for _ in range(self.n_float)]
        B = [xp.empty(lead.shape, bool) for _ in range(self.n_bool)]
        self._passes(xp, S, B, dt, *args)

    def _scratch(self, dtype, n: int):
        """This thread's scratch of ``dtype``, at least ``n`` long (a block: made once per thread)."""
        pool = self._local.__dict__
        key = dtype.str
        have = pool.get(key)
        if have is None or (have[0] and have[0][0].size < n) or (have[1] and have[1][0].size < n):
            size = max(n, 1)
            have = pool[key] = ([numpy.empty(size, dtype) for _ in range(self.n_float)],
                                [numpy.empty(size, bool) for _ in range(self.n_bool)])
        return have
