"""Mean sparse softmax cross-entropy from logits and its gradient ``(softmax - onehot) / n``, by rows.

Log-sum-exp shifted, never the log of a softmax.  A reduction over each row,
so its forms differ and sit side by side here: NumPy's max, subtract, exp,
sum, divide, fancy indexing (take/scatter) and multiply passes; on a GPU one
kernel, one thread per row (+2 launches for the loss, when asked).  The
kernel differs from NumPy by the last bits of ``expf``/``logf`` and of the row
sum's order.  No compiled CPU form (the passes over (n, C) logits are a
small part of a step).

Limits: the kernel takes float32, C-contiguous logits of at most
``towers.devices.kernels.MAX_ELEMENTS`` elements (others take the array
operations); the loss is a 0-d device array (no host sync).
"""
from __future__ import annotations

import numpy

from towers.arrays import on_host
from towers.devices.kernels import check_contiguous, launch_named, register, takes

_i = numpy.int32  # a kernel's int argument

register(r"""// One thread per row: log-sum-exp shifted cross-entropy and (softmax - onehot) / n.
__global__ void towers_softmax_xent(const float* logits, const int* labels, float* d, float* row_loss,
                                    int n, int c, float inv_n) {
    LOOP(r, n) {
        const float* l = logits + (long long)r * c;
        float* dr = d + (long long)r * c;
        float m = l[0];
        for (int j = 1; j < c; ++j) m = np_max(m, l[j]);
        float s = 0.f;
        for (int j = 0; j < c; ++j) { float e = expf(l[j] - m); dr[j] = e; s += e; }
        int y = labels[r];
        row_loss[r] = logf(s) - (l[y] - m);
        for (int j = 0; j < c; ++j) {
            float p = dr[j] / s;
            if (j == y) p = p - 1.f;
            dr[j] = p * inv_n;
        }
    }
}

""", ("softmax_xent",))


def softmax_xent(logits, labels, ws, want_loss: bool):
    """Mean sparse softmax cross-entropy from logits and its gradient ``(softmax - onehot) / n``.

    Log-sum-exp shifted, never the log of a softmax.  Returns (loss or None,
    dlogits); dlogits lives in the workspace ``ws``.  The loss is a 0-d device
    array (no host sync).
    """
    xp = ws.xp
    n, c = logits.shape
    prob = ws.array("prob", (n, c), logits.dtype)
    if on_host(logits) or not takes(logits):
        return _softmax_xent_arrays(xp, logits, labels, ws, prob, want_loss)
    check_contiguous(logits)
    if labels.dtype != numpy.int32 or not labels.flags.c_contiguous:
        lab = ws.array("labels", (n,), numpy.int32)
        lab[...] = labels
        labels = lab
    row_loss = ws.array("row_loss", (n,), logits.dtype)
    launch_named("softmax_xent", n, logits, labels, prob, row_loss, _i(n), _i(c), logits.dtype.type(1.0 / n))
    return (row_loss.sum() / logits.dtype.type(n) if want_loss else None), prob


def _softmax_xent_arrays(xp, logits, labels, ws, prob, want_loss):
    """The array-operation version (NumPy on the CPU; CuPy for arrays too big for the kernel)."""
    n, c = logits.shape
    m = ws.array("max", (n, 1), logits.dtype)
    xp.max(logits, axis=1, keepdims=True, out=m)
    z = ws.array("z", (n, c), logits.dtype)
    xp.subtract(logits, m, out=z)
    xp.exp(z, out=prob)
    s = ws.array("sum", (n, 1), logits.dtype)
    xp.sum(prob, axis=1, keepdims=True, out=s)
    rows = ws.array("rows", (n,), numpy.int64)
    if ws.saved.get("rows_n") != n:
        rows[...] = xp.arange(n)
        ws.saved["rows_n"] = n
    loss = None
    if want_loss:
        loss = (xp.sum(xp.log(s)) - xp.sum(z[rows, labels])) / logits.dtype.type(n)
    xp.divide(prob, s, out=prob)
    prob[rows, labels] -= 1
    prob *= logits.dtype.type(1.0 / n)
    return loss, prob
