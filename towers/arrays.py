"""Arrays on the host or on a device: the one test of where an array lives, and the moves between them.

``on_host(a)`` is the one spelling of "is this a host (NumPy) array": every
op's form, every copy and every check asks it (a CuPy array is a device
array; CuPy is imported only when a device array is met).  ``array_module``
is the module an array's operations come from, ``to_host`` a device array's
copy on the host (a sync point), ``check_host`` the API's refusal of GPU
arrays of any library, ``empty_pinned`` page-locked host memory for
asynchronous copies to a device.  Nothing here chooses a device or a form:
that is ``towers.devices`` (placement) and ``towers.ops.forms``.
"""
from __future__ import annotations

import numpy

from towers.errors import UserError


def on_host(a) -> bool:
    """Whether ``a`` is a host (NumPy) array, not a device array."""
    return isinstance(a, numpy.ndarray)


def array_module(a):
    """The array module an array lives on: NumPy for host arrays, CuPy for device arrays."""
    if on_host(a):
        return numpy
    import cupy

    return cupy


def to_host(a, copy: bool = False) -> numpy.ndarray:
    """A device array as a NumPy array (a sync point on GPU); ``copy`` also copies host arrays."""
    if on_host(a):
        return numpy.array(a, copy=True) if copy else a
    return a.get() if hasattr(a, "get") else a


def check_host(a, what: str) -> None:
    """A ``UserError`` starting with ``what`` if ``a`` is a device array (CuPy's): the API takes host arrays.

    towers copies each tower's share of a batch, and weights, to its device
    itself; a device array handed in would be copied back and forth, and
    NumPy's and CuPy's refusals of each other's arrays are TypeErrors from
    deep inside the step.
    """
    if hasattr(a, "__cuda_array_interface__"):
        raise UserError(f"{what} is a {type(a).__module__.split('.')[0]}.{type(a).__name__} in GPU memory; give a "
                        "host (NumPy) array, e.g. its .get(): towers copies each tower's share to its device itself")


def empty_pinned(shape, dtype):
    """An uninitialized NumPy array in page-locked host memory (GPU copies from it run async).

    What ``cupyx.empty_pinned`` does, without importing ``cupyx``: its package
    import pulls in cupyx.scipy.sparse, 0.37 s of the GPU job's start-up on the
    H200 machine.
    """
    import cupy

    shape = tuple(shape)
    nbytes = max(int(numpy.prod(shape, dtype=numpy.int64)) * numpy.dtype(dtype).itemsize, 1)
    return numpy.ndarray(shape, dtype=dtype, buffer=cupy.cuda.alloc_pinned_memory(nbytes))
