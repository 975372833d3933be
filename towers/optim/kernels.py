"""Fused GPU update kernels, built once per variant and cached.

An update pass (SGD or Adam, with or without the EMA) over a replica's flat
buffer is one ``cupy.ElementwiseKernel``: one launch per replica and step,
whatever the number of parameters.  CuPy compiles a kernel on its first call
and caches the binary on disk (``CUPY_CACHE_DIR``), so later runs skip NVRTC.
"""
from __future__ import annotations

_CACHE: dict = {}


def elementwise_kernel(in_params: str, out_params: str, body: str, name: str):
    """A cached ``cupy.ElementwiseKernel`` (CuPy is imported only on the GPU path)."""
    key = (in_params, out_params, body, name)
    kernel = _CACHE.get(key)
    if kernel is None:
        import cupy

        kernel = _CACHE[key] = cupy.ElementwiseKernel(in_params, out_params, body, name)
    return kernel


def array_module(a):
    """NumPy for host arrays, CuPy for device arrays."""
    import numpy

    return numpy if isinstance(a, numpy.ndarray) else __import__("cupy")
