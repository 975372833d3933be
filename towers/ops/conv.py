"""A convolution's form on device arrays: cuDNN where the current forms chose it, else the caller's im2col.

``towers.nn.conv.Conv2D`` runs its three products through here: each of
``forward``, ``weight_grad`` and ``data_grad`` runs the product on cuDNN
(``towers.devices.cudnn``: NHWC activations, a KRSC kernel) and returns True
when the arrays are device arrays and the current forms take cuDNN
(``towers.ops.forms``: ``gpu_conv``); it returns False, having done nothing,
on host arrays, under im2col, and for a shape cuDNN refuses, and the layer
then runs its im2col form.  ``on_cudnn`` says beforehand whether an array
would take cuDNN (the layer makes the KRSC copy of its kernel only then).
"""
from __future__ import annotations

from towers.arrays import on_host
from towers.devices import cudnn
from towers.ops.forms import current as current_forms


def on_cudnn(a) -> bool:
    """Whether a convolution on ``a`` runs on cuDNN: a device array, and the current forms take cuDNN."""
    return not on_host(a) and current_forms().cudnn


def forward(x, w_krsc, y, pad, post_pad, stride) -> bool:
    """``y = conv(x, w)`` on cuDNN (``x`` NHWC, ``w_krsc`` (F, kh, kw, C)); False where the im2col form runs."""
    return _run(cudnn.conv_forward, x, w_krsc, y, pad, post_pad, stride)


def weight_grad(x, dy, dw_krsc, pad, post_pad, stride) -> bool:
    """``dw_krsc`` = the kernel's gradient from ``x`` and ``dy`` on cuDNN; False where the im2col form runs."""
    return _run(cudnn.conv_weight_grad, x, dy, dw_krsc, pad, post_pad, stride)


def data_grad(dy, w_krsc, dx, pad, post_pad, stride) -> bool:
    """``dx`` = the input's gradient from ``dy`` and the kernel on cuDNN; False where the im2col form runs."""
    return _run(cudnn.conv_data_grad, dy, w_krsc, dx, pad, post_pad, stride)


def _run(op, a, b, out, pad, post_pad, stride) -> bool:
    if not on_cudnn(a):
        return False
    try:
        op(a, b, out, pad, post_pad, stride)
    except cudnn.Unsupported:
        return False
    return True
