"""Rounding float32 values to bfloat16 or float16, in place: the one rounding of the low-precision compute.

``round_to(x, precision)`` leaves in the float32 array ``x`` the float32 value
of each element rounded to ``precision`` (``bf16`` or ``fp16``; ``fp32``
leaves it as it is): what a GPU holding the value in that format would read
back.  ``--precision`` (``towers.nn.replica``) calls it where a GPU holds
values in low precision (the weights' copy of a step, the activations between
layers, the gradients out of backward); ``--allreduce-dtype bf16``
(``towers.parallel.sync``) on the gradients before the all-reduce.  The values
stay in float32 buffers, so every sum and product after it accumulates in
float32, as tensor cores do.

The rounding is IEEE round-to-nearest, ties to even, with the target's
subnormals, overflow to infinity and NaN kept NaN (quiet; its sign and upper
payload bits kept for bf16):

* ``bf16`` (8 exponent bits like float32, 8 significant bits): integer
  arithmetic on the float's bits, ``(u + 0x7FFF + ((u >> 16) & 1)) &
  0xFFFF0000``; a carry out of the significand raises the exponent (and the
  largest finite values round to infinity), a subnormal rounds in the same
  formula; a NaN is made quiet before its low half is cleared, which would
  otherwise turn a NaN whose payload sits in the low bits into infinity;
* ``fp16`` (5 exponent bits, 11 significant bits): the conversion to
  float16 and back (NumPy's and CuPy's ``astype``; the PTX ``cvt.rn.f16.f32``
  in the kernel), which rounds so: values of 65520 and beyond become infinity,
  values under 2**-24 underflow through fp16's subnormals.

Why integer arithmetic rather than ``ml_dtypes``' bfloat16: the rounding
happens in place on the float32 buffers the layers already use (no second
dtype, no copies), the kernel does the same integer steps, and the library
needs no new dependency (``ml_dtypes`` is the tests' reference).  Why not an
``Elementwise`` definition (``towers.ops.codegen.expr``): the definitions have no
integer arithmetic and no access to a float's bits, so the forms sit side by
side here instead.

Forms: the array form (the NumPy passes above; CuPy runs the same ones on a
device array the kernel does not take), and on a GPU one CUDA kernel per
format, registered into the one CUDA module (``towers.devices.kernels``), so
``tests/devices/test_kernels_compile.py`` compiles them.  No compiled-CPU form: the
integer passes are a few streaming passes per call.  A launch goes on the
current stream; nothing synchronizes.
"""
from __future__ import annotations

import numpy

from towers.arrays import array_module, on_host
from towers.devices import kernels as device

#: The values of ``--precision``: the format the forward and backward compute in.
PRECISIONS = ("fp32", "bf16", "fp16")
#: The values of ``--allreduce-dtype``: the format the gradients are rounded to before the all-reduce.
ALLREDUCE_DTYPES = ("fp32", "bf16")

_SOURCE = r"""// x rounded in place to bfloat16 (round to nearest even; NaN stays a quiet NaN): towers.ops.precision
__global__ void towers_round_bf16(float* x, int n) {
    LOOP(i, n) {
        unsigned int u = __float_as_uint(x[i]);
        if ((u & 0x7fffffffu) > 0x7f800000u) u |= 0x00400000u;
        else u += 0x7fffu + ((u >> 16) & 1u);
        x[i] = __uint_as_float(u & 0xffff0000u);
    }
}

// x rounded in place to float16 and back (round to nearest even, fp16's subnormals and infinities)
__global__ void towers_round_fp16(float* x, int n) {
    LOOP(i, n) {
        unsigned short h;
        float r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x[i]));
        asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
        x[i] = r;
    }
}

"""
device.register(_SOURCE, ("round_bf16", "round_fp16"))


def round_to(x, precision: str) -> None:
    """Round the float32 array ``x`` (host or device) in place to ``precision`` (module doc); ``fp32``: nothing.

    A ``ValueError`` for another dtype or an unknown precision.
    """
    if precision == "fp32":
        return
    if precision not in PRECISIONS:
        raise ValueError(f"round_to: precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if x.dtype != numpy.float32:
        raise ValueError(f"round_to rounds float32 arrays, got {x.dtype}")
    if x.size == 0:
        return
    if not on_host(x) and device.takes(x) and x.flags.c_contiguous:
        device.launch_named("round_" + precision, x.size, x, numpy.int32(x.size))
        return
    xp = array_module(x)
    if precision == "fp16":
        with numpy.errstate(over="ignore"):  # values past fp16's range become inf: that is the rounding
            x[...] = x.astype(numpy.float16)
        return
    round_bf16(xp, x)


def round_bf16(xp, x) -> None:
    """The bf16 rounding's array form over ``x`` (float32, any layout) with ``xp`` (NumPy or CuPy)."""
    u = x.view(xp.uint32) if x.flags.c_contiguous else None
    if u is None:  # a strided view: round a copy, write it back
        c = xp.ascontiguousarray(x)
        round_bf16(xp, c)
        x[...] = c
        return
    nan = x != x
    t = u >> 16
    t &= 1
    t += 0x7FFF
    t += u  # no wrap: the largest non-NaN pattern, -inf's 0xFF800000, plus 0x8000 stays below 2**32
    xp.copyto(t, u | 0x00400000, where=nan)  # a NaN: quiet, so clearing its low half leaves a NaN
    t &= 0xFFFF0000
    u[...] = t
