"""Every CUDA kernel of towers compiles under NVRTC, without a GPU, for sm_80 and sm_90.

NVRTC needs no device (``nvidia-cuda-nvrtc-cu12``, in requirements.txt), so a
syntax or type error in a kernel fails here, with NVRTC's log and its line
numbers, instead of on the GPU machine.  CuPy's own ``compile_using_nvrtc``
asks for a device first, so the program is built through
``cupy_backends.cuda.libs.nvrtc`` directly.  Compiled:

* the one CUDA module of the layer, data and reducer kernels
  (``towers.devices.kernels.source()``), and every name of ``kernel_names()``
  is a ``__global__`` function in it;
* every optimizer update (``Optimizer._op``, generated from the optimizer's
  one definition: ``towers.ops.codegen.cuda_form``) of every optimizer of the
  registry, in each of its variants, with and without the EMA, with the
  kernel's own compile options;
* the EMA's standalone update (``EMA.update`` on the GPU);
* every other generated kernel compiled on its own that the process has made
  (``towers.ops.codegen.elementwise.made``): none is left out.

Every generated kernel and the update kernels are checked for what makes them
round as NumPy's passes do: no ``fma.`` in the machine code, IEEE division and
square root.
"""
import re

import numpy as np
import pytest

import towers  # noqa: F401 - registers the layers' kernels into the module
from towers.devices import kernels
from towers.ops.codegen import elementwise
from towers.optim import ema
from towers.optim.ema import EMA
from towers.optim.optimizers import OPTIMIZERS

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy is not installed")
try:
    NVRTC_VERSION = nvrtc.getVersion()
except Exception as e:  # the library itself is missing: nvidia-cuda-nvrtc-cu12 is not installed
    pytest.skip(f"NVRTC cannot be loaded ({type(e).__name__}: {e}); pip install nvidia-cuda-nvrtc-cu12",
                allow_module_level=True)

ARCHS = ["sm_80", "sm_90"]

# Constructor arguments of each variant whose kernel source differs; an optimizer of the registry that is not
# listed here is compiled with its defaults (a new optimizer is covered; list its variants here).
VARIANTS = {
    "sgd": {"plain": {}, "momentum": dict(momentum=0.9), "nesterov": dict(momentum=0.9, nesterov=True)},
    "adam": {"plain": {}},
    "adamw": {"plain": {}},
    "rmsprop": {"plain": {}, "centered": dict(centered=True), "momentum": dict(momentum=0.9)},
}
CASES = [(name, variant) for name in OPTIMIZERS for variant in VARIANTS.get(name, {"plain": {}})]


def compile_cuda(source: str, name: str, options=(), arch="sm_90") -> str:
    """Compile ``source`` with NVRTC and return its PTX; a failure's message holds NVRTC's log and the source
    lines it names."""
    opts = [*options, f"-arch={arch}"]
    prog = nvrtc.createProgram(source, name + ".cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, opts)
            ptx = nvrtc.getPTX(prog)
            return ptx.decode() if isinstance(ptx, bytes) else ptx
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    pytest.fail(f"{name} does not compile with {' '.join(opts)} ({error}):\n{log}\n{_lines_named(source, log)}",
                pytrace=False)


def _lines_named(source: str, log: str, around: int = 3) -> str:
    """The source lines NVRTC's log names (``name.cu(12): error``), numbered, with ``around`` lines each side."""
    lines = source.splitlines()
    wanted = sorted({k for n in re.findall(r"\.cu\((\d+)\)", log)
                     for k in range(int(n) - around, int(n) + around + 1) if 1 <= k <= len(lines)})
    return "source lines:\n" + "\n".join(f"{k:5d}  {lines[k - 1]}" for k in wanted) if wanted else ""


def _params():
    return np.linspace(-1, 1, 64, dtype=np.float32)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_kernel_module_compiles(arch):
    ptx = compile_cuda(kernels.source(), "towers_kernels", kernels.MODULE_OPTIONS, arch)  # as the build compiles it
    for op in elementwise.made():  # the generated kernels in the module round as NumPy's passes
        if op.in_module:
            _rounds_as_numpy(_function(ptx, "towers_" + op.name), op.name)


def _function(ptx: str, name: str) -> str:
    """The PTX of the entry ``name`` (to its closing brace)."""
    start = ptx.index(f".entry {name}(")
    return ptx[start: ptx.index("\n}", start)]


def test_every_registered_kernel_is_defined_in_the_module():
    defined = set(re.findall(r"__global__\s+void\s+(\w+)\s*\(", kernels.source()))
    missing = [n for n in kernels.kernel_names() if "towers_" + n not in defined]
    assert not missing, f"kernel_names() lists kernels the module does not define: {missing}"
    assert len(kernels.kernel_names()) >= 3


def test_every_optimizer_has_its_variants_listed():
    """A variant table naming an optimizer the registry lacks is stale."""
    assert set(VARIANTS) <= set(OPTIMIZERS), set(VARIANTS) - set(OPTIMIZERS)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("with_ema", [False, True], ids=["no-ema", "ema"])
@pytest.mark.parametrize("name, variant", CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_every_fused_optimizer_update_compiles(name, variant, with_ema, arch):
    params = _params()
    ema = EMA(params, 0.99) if with_ema else None
    opt = OPTIMIZERS[name](params, ema=ema, **VARIANTS.get(name, {}).get(variant, {}))
    _compiles_on_its_own(opt._op.kernel(), arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_standalone_ema_update_compiles(arch):
    _compiles_on_its_own(ema._UPDATE.kernel(), arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_generated_kernel_made_so_far_compiles(arch):
    """Whatever else the process generated (an optimizer variant made by another test, a user's op)."""
    ops = [op for op in elementwise.made() if not op.in_module]
    assert ops, "no generated kernel outside the module: the EMA's standalone update at least"
    for op in ops:
        _compiles_on_its_own(op.kernel(), arch)


def _compiles_on_its_own(kernel, arch) -> None:
    from towers.ops.codegen.cuda_form import OPTIONS

    assert f"void {kernel.name}(" in kernel.source
    _rounds_as_numpy(compile_cuda(kernel.source, kernel.name, OPTIONS, arch), kernel.name)


def _rounds_as_numpy(ptx: str, name: str) -> None:
    """The kernel rounds each product and sum on its own, as NumPy's passes do (``towers.ops.codegen.cuda_form``): no
    fused multiply-add in its machine code, and IEEE-rounded division and square root."""
    assert "fma." not in ptx, f"{name}: NVRTC contracted a multiply-add into an FMA (compile with --fmad=false)"
    for op in re.findall(r"\b(div|sqrt)\.(\w+)\.f32", ptx):
        assert op[1] == "rn", f"{name}: {op[0]}.{op[1]}.f32 is not IEEE round-to-nearest"
