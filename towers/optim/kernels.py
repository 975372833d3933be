"""Fused GPU update kernels, built once per variant and cached.

An update pass (SGD or Adam, with or without the EMA) over a replica's flat
buffer is one raw CUDA kernel: one launch per replica and step, whatever the
number of parameters.  Each thread loads its element of every buffer into a
local of the buffer's name, runs the update's CUDA source on the locals and
stores the output buffers' locals back, the arithmetic a
``cupy.ElementwiseKernel`` of the same source would do, launched through
``towers.devices.kernels.launch`` (a few microseconds of host time instead of the
ElementwiseKernel's argument inspection, about 20).  CuPy compiles a kernel
on its first launch and caches the binary on disk (``CUPY_CACHE_DIR``), so
later runs skip NVRTC.

Exactness: the kernels are compiled with ``--fmad=false`` (``OPTIONS``), so
NVRTC does not contract ``a * b + c`` into one fused multiply-add: each
product and sum rounds to float32 on its own, as NumPy's passes do.  An
optimizer's ``GPU_BODY`` writes its products and sums in the order of its
NumPy passes (``_cpu_update``; ``sqrt`` and ``/`` are IEEE-rounded, NVRTC's
default), so the GPU update gives the CPU's bits on the same inputs
(``tests/test_gpu.py`` compares them for every optimizer).

Limits: float32, C-contiguous flat buffers of one size (the replica's
parameter, gradient, slot and shadow buffers are), at most
``towers.devices.kernels.MAX_ELEMENTS`` elements (32-bit index arithmetic).
"""
from __future__ import annotations

import numpy

_CACHE: dict = {}
OPTIONS = ("--fmad=false",)  # NVRTC options of every update kernel (see the module docstring)


class FlatKernel:
    """``kernel(*arrays_in, *scalars, *arrays_out)``: ``body`` once per element of the flat buffers."""

    def __init__(self, arrays_in: tuple, scalars: tuple, arrays_out: tuple, body: str, name: str):
        import cupy

        params = ([f"const float* __restrict__ {a}_" for a in arrays_in] + [f"float {s}" for s in scalars]
                  + [f"float* __restrict__ {o}_" for o in arrays_out] + ["int n"])
        load = "".join(f"const T {a} = {a}_[i]; " for a in arrays_in) + "".join(f"T {o} = {o}_[i]; " for o in arrays_out)
        store = "".join(f"{o}_[i] = {o}; " for o in arrays_out)
        self.source = (f'typedef float T;\nextern "C" __global__ void {name}({", ".join(params)}) {{\n'
                       f"    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {{\n"
                       f"        {load}\n{body}\n        {store}\n    }}\n}}\n")
        self.raw = cupy.RawKernel(self.source, name, options=OPTIONS)

    def __call__(self, *args) -> None:
        from towers.devices.kernels import MAX_ELEMENTS, launch

        n = args[0].size
        if n > MAX_ELEMENTS:
            from towers.errors import UserError

            raise UserError(f"the model has {n:,} parameters; the GPU's fused update takes at most "
                            f"{MAX_ELEMENTS:,} (32-bit indices): use a smaller model")
        for a in args:  # the kernel reads float32 buffers of n elements: anything else would be misread
            if hasattr(a, "dtype") and a.ndim and (a.dtype != numpy.float32 or a.size != n):
                raise TypeError(f"fused update of {a.dtype} {a.shape} buffers beside {n} float32: float32 only")
        launch(self.raw, n, *args, numpy.int32(n))


def flat_kernel(arrays_in: tuple, scalars: tuple, arrays_out: tuple, body: str, name: str) -> FlatKernel:
    """The cached ``FlatKernel`` of these buffers, scalars and source (CuPy is imported only on the GPU path)."""
    key = (tuple(arrays_in), tuple(scalars), tuple(arrays_out), body, name)
    kernel = _CACHE.get(key)
    if kernel is None:
        kernel = _CACHE[key] = FlatKernel(*key)
    return kernel
