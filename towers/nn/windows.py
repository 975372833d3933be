"""The shape rules of 2-D windows (convolution, pooling), TensorFlow's.

Images are per-example (H, W) (one channel) or (H, W, C).  A k x k window at
``stride`` with padding:

* ``same``: ceil(H / stride) outputs; ``max((Ho - 1) * stride + k - H, 0)``
  rows of padding in all, half on top (rounded down), the odd one at the
  bottom;
* ``valid``: ``(H - k) // stride + 1`` outputs, no padding;
* ``p`` pixels: ``(H + 2p - k) // stride + 1`` outputs, ``p`` rows on top
  (the rows a window never reaches on the bottom are not read).
"""
from __future__ import annotations

from towers.errors import UserError


def nhwc(in_shape: tuple, who: str) -> tuple:
    """Per-example (H, W) or (H, W, C) -> (H, W, C); anything else is a UserError."""
    if len(in_shape) == 2:
        return tuple(in_shape) + (1,)
    if len(in_shape) == 3:
        return tuple(in_shape)
    hint = ("; flat examples need their image shape: for TFRecord bytes `decode` NAME:uint8:H,W "
            "(e.g. image_raw:uint8:28,28), for an npz x reshaped to (N, H, W)") if len(in_shape) == 1 else ""
    raise UserError(f"{who}: takes images (N, H, W) or (N, H, W, C), got per-example shape {in_shape}{hint}")


def window_geometry(hw: tuple, k: int, stride: int, padding, who: str) -> tuple[tuple, tuple]:
    """((Ho, Wo), (top, left)) of k x k windows at ``stride`` over (H, W) with ``padding`` (see the module doc)."""
    out, pad = [], []
    for n in hw:
        if padding == "same":
            o = -(-n // stride)
            p = max((o - 1) * stride + k - n, 0) // 2
        elif padding == "valid":
            o, p = (n - k) // stride + 1, 0
        else:
            o, p = (n + 2 * padding - k) // stride + 1, padding
        if o < 1:
            raise UserError(f"{who}: a {k}x{k} window with padding {padding!r} does not fit images of "
                            f"{hw[0]}x{hw[1]}")
        out.append(o)
        pad.append(p)
    return tuple(out), tuple(pad)


def check_padding(padding, who: str):
    """``same``/``valid`` (any case) or pixels >= 0, normalized; anything else is a UserError."""
    if isinstance(padding, str) and padding.lower() in ("same", "valid"):
        return padding.lower()
    if isinstance(padding, int) and not isinstance(padding, bool) and padding >= 0:
        return padding
    raise UserError(f"{who}: padding must be 'same', 'valid' or a number of pixels >= 0, got {padding!r}")


def positive(v, what: str, who: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f"{who}: {what} must be an integer >= 1, got {v!r}")
    return v
