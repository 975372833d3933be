"""The loss: mean sparse softmax cross-entropy from logits, and its gradient.

TensorFlow's ``sparse_softmax_cross_entropy_with_logits``, averaged over the
batch.  Computed with the log-sum-exp shift, never from a softmax that can
underflow.  The gradient with respect to the logits is ``(softmax - onehot) / n``.
"""
from __future__ import annotations

import numpy

from towers.nn.layers import Workspace


def softmax_cross_entropy(logits, labels, ws: Workspace, want_loss: bool = True):
    """Mean sparse softmax cross-entropy from logits and its gradient.

    Uses the log-sum-exp shift (never the log of a softmax, which underflows).
    Returns (loss or None, dlogits); dlogits lives in ``ws``.
    """
    xp = ws.xp
    n, c = logits.shape
    m = ws.array("max", (n, 1), logits.dtype)
    xp.max(logits, axis=1, keepdims=True, out=m)
    z = ws.array("z", (n, c), logits.dtype)
    xp.subtract(logits, m, out=z)
    prob = ws.array("prob", (n, c), logits.dtype)
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


def accuracy_count(logits, labels) -> int:
    """Number of correct predictions (host int: a sync point, used at eval only)."""
    return int((logits.argmax(axis=1) == labels).sum())
