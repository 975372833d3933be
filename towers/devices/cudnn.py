"""Convolutions by cuDNN on CuPy arrays: forward, data gradient, weight gradient, through NVIDIA's cuDNN frontend.

Operands are C-contiguous CuPy arrays in cuDNN's channels-last layouts:
activations NHWC, kernels KRSC ((F, kh, kw, C): filter-major, channels
innermost).  cuDNN describes every tensor by dimensions in NCHW order and
strides:

* an NHWC activation (n, h, w, c): dims ``[n, c, h, w]``, strides ``[h*w*c, 1, w*c, c]``;
* a KRSC kernel (f, kh, kw, c): dims ``[f, c, kh, kw]``, strides ``[kh*kw*c, 1, kw*c, c]``.

The layer hands its HWIO kernel over as a KRSC copy (``Conv2D``): cuDNN's
graph API accepts a kernel of other strides but computed wrong results on one
(docs/architecture.md, "On GPUs", says what has run on a GPU).

Each operation is one cuDNN graph (``cudnn.pygraph``: ``conv_fprop``,
``conv_dgrad``, ``conv_wgrad``), built once per shape, padding, stride, data
type, TF32 setting and pointer alignment, and cached per device and thread; the first
step of each shape pays for the build (heuristics, then the first plan that
builds, ``heur_mode.A`` then ``FALLBACK``).  A call then is one ``execute``:
a dict of the operands' device pointers and the workspace.  ``tf32`` off (the
default, ``towers.devices.matmul``) deselects the engines that round inputs to
TF32 (``TENSOR_CORE``, ``DOWN_CONVERT_INPUTS``): float32 in, float32 products;
non-deterministic engines (atomics, ``NONDETERMINISTIC``) are always
deselected, so a run repeats its bits.  Padding is ``pre``/``post`` per side,
so TensorFlow's asymmetric SAME padding is expressed as it is.

Handles and workspaces: one cuDNN handle per CUDA stream and thread (a
handle is bound to its stream once; towers sharing a GPU share its stream,
and with sync-BN they run on threads of their own, which must not share a
handle: cuDNN's are not thread-safe), and one workspace per handle, grown
to the largest graph's need and kept (the first step allocates it: nothing
is allocated in later steps).  A graph is built by the thread that first
needs it, with its handle, and runs in that thread only.  Handles, workspaces
and graphs live as long as the process (a new stream, as a new ``Trainer``
makes, gets a handle of its own; ``clear`` frees them all).

Limits: float32 and bfloat16 operands (``dtype`` of the arrays); dilation 1;
a shape cuDNN refuses raises ``Unsupported``, and the caller (``Conv2D``) runs
its im2col form for that shape instead (``refused`` lists them).  Nothing
here synchronizes: every call is queued on the current stream.

The frontend (``pip install nvidia-cudnn-frontend``, with the cuDNN library
of CUDA's major version, ``nvidia-cudnn-cu12``/``-cu13``) is imported on the
first call only: towers never imports it on the CPU.  Versions 1.23 to 1.32
(the extras' range): up to 1.31 its tensors take the operands' byte alignment
(``set_alignment``); 1.32 builds graphs in Python and describes every operand
as 16-byte aligned (``_set_alignment``).  Any error the frontend raises while a
graph is described or built (an API that moved included) is ``Unsupported``
with its reason, never a crash.  ``describe`` is the graph description alone:
with 1.32 it runs without a GPU (tests/devices/test_cudnn_graphs.py builds
every convolution of ResNet-20 and the CIFAR-10 model that way).
"""
from __future__ import annotations

import threading

import numpy

_LOCK = threading.RLock()  # graph builds and the caches (tower threads run layers concurrently with sync-BN)
_MOD: dict = {}  # the imported frontend, once
_HANDLES: dict = {}  # (device, stream pointer, thread) -> _Handle
_GRAPHS: dict = {}  # key (device, op, shapes, ...) -> _Graph, or the reason it was refused
refused: dict = {}  # key -> cuDNN's message, for the shapes left to im2col (tests, the benchmark's notes)
calls = {"fprop": 0, "dgrad": 0, "wgrad": 0}  # executions so far: tests check cuDNN really ran


class Unsupported(RuntimeError):
    """cuDNN has no engine for this operation as asked: the caller runs another form."""


def frontend():
    """The ``cudnn`` module (ImportError when the frontend or cuDNN is missing)."""
    mod = _MOD.get("cudnn")
    if mod is None:
        import cudnn  # noqa: PLC0415 - optional, GPU only

        mod = _MOD["cudnn"] = cudnn
    return mod


def available() -> str | None:
    """None when the frontend imports and a handle can be made on the current device; else why not."""
    try:
        frontend()
    except Exception as e:  # ImportError, or a cuDNN library that does not load
        return f"the cuDNN frontend does not import ({type(e).__name__}: {e}); pip install nvidia-cudnn-frontend"
    try:
        _handle()
    except Exception as e:
        return f"cuDNN does not start on this GPU ({type(e).__name__}: {e})"
    return None


class _Handle:
    """A cuDNN handle bound to one stream, and its workspace."""

    def __init__(self, stream_ptr: int):
        import cupy

        cudnn = frontend()
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=stream_ptr)
        self.workspace = cupy.empty(1 << 20, dtype=numpy.uint8)  # grown by ``room``
        self.outgrown: list = []  # earlier workspaces, kept: a CUDA graph captured with one still writes it

    def room(self, nbytes: int) -> int:
        """The workspace's pointer, at least ``nbytes`` long (grown once; in the first step of a shape)."""
        if nbytes > self.workspace.size:
            import cupy

            self.outgrown.append(self.workspace)
            self.workspace = cupy.empty(int(nbytes), dtype=numpy.uint8)
        return self.workspace.data.ptr


def _handle() -> _Handle:
    import cupy

    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr, threading.get_ident())
    h = _HANDLES.get(key)
    if h is None:
        with _LOCK:
            h = _HANDLES.get(key)
            if h is None:
                h = _HANDLES[key] = _Handle(key[1])
    return h


class _Graph:
    """One built cuDNN graph: its operands' uids in call order, its workspace size in bytes and its engine."""

    def __init__(self, graph, uids: tuple, workspace: int, engine: str = "n/a"):
        self.graph, self.uids, self.workspace, self.engine = graph, uids, workspace, engine

    def run(self, *arrays) -> None:
        h = _handle()
        ptrs = {uid: a.data.ptr for uid, a in zip(self.uids, arrays)}
        self.graph._execute(ptrs, h.room(self.workspace), h.handle)


def _alignment(*arrays) -> tuple:
    """Each operand's byte alignment (16 at most): views into the flat buffers may sit at any float."""
    out = []
    for a in arrays:
        p, b = a.data.ptr, 16
        while p % b:
            b //= 2
        out.append(b)
    return tuple(out)


def _act(n, h, w, c):
    """An NHWC activation as cuDNN's (dims, strides)."""
    return [n, c, h, w], [h * w * c, 1, w * c, c]


def _kernel(f, kh, kw, c):
    """A KRSC kernel as cuDNN's (dims, strides)."""
    return [f, c, kh, kw], [kh * kw * c, 1, kw * c, c]


def _dtype(cudnn, dtype):
    if dtype == numpy.float32:
        return cudnn.data_type.FLOAT
    if str(dtype) == "bfloat16":
        return cudnn.data_type.BFLOAT16
    raise Unsupported(f"cuDNN convolutions here take float32 or bfloat16, not {dtype}")


def _tf32() -> bool:
    from cupy._core import _routines_linalg as linalg

    return linalg.get_compute_type(numpy.float32) == linalg.COMPUTE_TYPE_TF32


def _set_alignment(tensor, nbytes: int) -> None:
    """Declare an operand's pointer alignment in bytes, as the installed frontend allows.

    Up to 1.31 the frontend's tensors are its C++ ``Tensor_attributes``, whose
    ``set_alignment`` sets cuDNN's byte alignment (16 unless set).  From 1.32
    the graph is built in Python, where ``set_alignment_value`` is a promise
    about the tensor's values (not its address) and no byte alignment reaches
    cuDNN: every operand is described as 16-byte aligned, so a less aligned one
    is ``Unsupported`` (its operation runs by im2col).
    """
    set_alignment = getattr(tensor, "set_alignment", None)
    if set_alignment is not None:
        set_alignment(nbytes)
    elif nbytes < 16:
        raise Unsupported(f"an operand {nbytes}-byte aligned: the cuDNN frontend {_version()} describes every "
                          "operand as 16-byte aligned")


def _version() -> str:
    return str(getattr(frontend(), "__version__", "?"))


def describe(op: str, x, w, y, pre, post, stride: int, align: tuple, dtype, handle=None):
    """The cuDNN graph of ``op`` (``fprop``, ``dgrad``, ``wgrad``) described, not built: operands of ``dtype``
    shaped as ``x`` (NHWC), ``w`` (KRSC), ``y`` (NHWC), ``align`` their pointers' byte alignments in call
    order, uids 1, 2, 3 in call order (fprop: x, w -> y; dgrad: dy, w -> dx; wgrad: x, dy -> dw).

    Only the frontend's graph API is called (from 1.32 it needs no GPU and no
    cuDNN library up to here: ``handle`` may be None); any of its errors
    (an API that moved, arguments it refuses) is raised as it is.
    """
    cudnn = frontend()
    io = _dtype(cudnn, dtype)
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    dims = {"x": _act(*x), "w": _kernel(*w), "y": _act(*y)}
    names = {"fprop": ("x", "w", "y"), "dgrad": ("y", "w", "x"), "wgrad": ("x", "y", "w")}[op]
    t = {}
    for uid, (name, a) in enumerate(zip(names[:2], align[:2]), start=1):
        t[name] = g.tensor(name=name, dim=dims[name][0], stride=dims[name][1], data_type=io, uid=uid)
        _set_alignment(t[name], a)
    conv = dict(pre_padding=list(pre), post_padding=list(post), stride=[stride, stride], dilation=[1, 1],
                compute_data_type=cudnn.data_type.FLOAT)
    if op == "fprop":
        out = g.conv_fprop(image=t["x"], weight=t["w"], **conv)
    elif op == "dgrad":
        out = g.conv_dgrad(loss=t["y"], filter=t["w"], **conv)
    else:
        out = g.conv_wgrad(image=t["x"], loss=t["y"], **conv)
    name = names[2]
    out.set_output(True).set_dim(dims[name][0]).set_stride(dims[name][1]).set_data_type(io).set_uid(3)
    _set_alignment(out, align[2])
    return g


def _build(key, op: str, x, w, y, pre, post, stride, align, dtype) -> _Graph:
    """Build the graph of ``op`` for operands of ``dtype`` shaped as ``x`` (NHWC), ``w`` (KRSC), ``y`` (NHWC).

    Any error of the frontend, from the description (``describe``) to the
    plans, is ``Unsupported`` with its reason: the caller runs im2col.
    """
    cudnn = frontend()
    try:
        g = describe(op, x, w, y, pre, post, stride, align, dtype, _handle().handle)
        notes = [cudnn.numerical_note.NONDETERMINISTIC]
        if _dtype(cudnn, dtype) == cudnn.data_type.FLOAT and not _tf32():
            notes += [cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS]
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.deselect_numeric_notes(notes)  # marks the engine configs just made: before it there are none to mark
        g.check_support()
        g.build_plans()
        workspace = int(g.get_workspace_size())
    except Unsupported as e:
        raise Unsupported(f"cuDNN {op} {key[2:]}: {e}") from None
    except Exception as e:  # cudnnGraphNotSupportedError, a RuntimeError from a step above, a frontend API error
        raise Unsupported(f"cuDNN {op} {key[2:]} (frontend {_version()}): {type(e).__name__}: {e}") from None
    return _Graph(g, (1, 2, 3), workspace, _engine(g))


def _engine(g) -> str:
    """The name of the plan a built graph runs (its first: ``build_plans`` keeps the plans that build, in the
    heuristics' order); "n/a" where the frontend does not say."""
    try:
        return str(g.get_plan_name_at_index(0))
    except Exception:  # noqa: BLE001 - informational only
        return "n/a"


def _run(op: str, x_shape, w_shape, y_shape, pre, post, stride, a, b, out) -> None:
    import cupy

    align = _alignment(a, b, out)
    # Per thread too: sync-BN's tower threads would otherwise execute one plan at once (cuDNN's plans, like its
    # handles, are not shared across threads).
    key = (cupy.cuda.Device().id, op, tuple(x_shape), tuple(w_shape), tuple(y_shape), tuple(pre), tuple(post),
           stride, str(a.dtype), _tf32(), align, threading.get_ident())
    g = _GRAPHS.get(key)
    if g is None:
        with _LOCK:
            g = _GRAPHS.get(key)
            if g is None:
                try:
                    g = _build(key, op, x_shape, w_shape, y_shape, pre, post, stride, align, a.dtype)
                except Unsupported as e:
                    g = refused[key] = str(e)
                _GRAPHS[key] = g
    if isinstance(g, str):
        refused[key] = g  # again, after a ``refused.clear()``: each fallback stays visible
        raise Unsupported(g)
    for arr in (a, b, out):
        if not arr.flags.c_contiguous:
            raise Unsupported(f"cuDNN {op}: operands must be C-contiguous")
    g.run(a, b, out)
    calls[op] += 1


def conv_forward(x, w, y, pre, post, stride: int) -> None:
    """``y = conv(x, w)``: ``x`` (n, h, w, c) NHWC, ``w`` (f, kh, kw, c) KRSC, ``y`` (n, ho, wo, f), written whole."""
    _run("fprop", x.shape, w.shape, y.shape, pre, post, stride, x, w, y)


def conv_data_grad(dy, w, dx, pre, post, stride: int) -> None:
    """``dx``, the input gradient of ``y = conv(x, w)`` for ``dy`` (same layouts as ``conv_forward``), written whole."""
    _run("dgrad", dx.shape, w.shape, dy.shape, pre, post, stride, dy, w, dx)


def conv_weight_grad(x, dy, dw, pre, post, stride: int) -> None:
    """``dw`` (f, kh, kw, c), the kernel's gradient of ``y = conv(x, w)`` for ``dy``, written whole (not added)."""
    _run("wgrad", x.shape, dw.shape, dy.shape, pre, post, stride, x, dy, dw)


def built() -> list:
    """Every graph built so far, as dicts: ``op``, the ``x``, ``w``, ``y`` shapes, ``pre``, ``post``, ``stride``,
    ``dtype``, ``align``, ``engine`` and ``workspace`` (bytes); a refused one with ``refused`` (its reason)."""
    out = []
    with _LOCK:
        for key, g in _GRAPHS.items():
            _, op, x, w, y, pre, post, stride, dtype, _tf, align, _thread = key
            row = dict(op=op, x=x, w=w, y=y, pre=pre, post=post, stride=stride, dtype=dtype, align=align)
            row.update(refused=g) if isinstance(g, str) else row.update(engine=g.engine, workspace=g.workspace)
            out.append(row)
    return out


def clear() -> None:
    """Forget every graph, and destroy every handle (their workspaces are freed with them): not while a
    ``Trainer`` with ``cuda_graphs`` lives, whose captured graphs hold the handles' workspaces."""
    with _LOCK:
        _GRAPHS.clear()
        refused.clear()
        for h in _HANDLES.values():
            frontend().destroy_handle(h.handle)
        _HANDLES.clear()
