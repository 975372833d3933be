"""The loss: mean sparse softmax cross-entropy from logits, and its gradient.

TensorFlow's ``sparse_softmax_cross_entropy_with_logits``, averaged over the
batch.  Computed with the log-sum-exp shift, never from a softmax that can
underflow.  The gradient with respect to the logits is ``(softmax - onehot) / n``.
"""
from __future__ import annotations

from towers.nn import kernels
from towers.nn.layers import Workspace


def softmax_cross_entropy(logits, labels, ws: Workspace, want_loss: bool = True):
    """Mean sparse softmax cross-entropy from logits and its gradient.

    Uses the log-sum-exp shift (never the log of a softmax, which underflows).
    Returns (loss or None, dlogits); dlogits lives in ``ws``.  On a GPU it is
    one fused kernel (``towers.nn.kernels.softmax_xent``).
    """
    return kernels.softmax_xent(logits, labels, ws, want_loss)


def accuracy_count(logits, labels) -> int:
    """Number of correct predictions (host int: a sync point, used at eval only)."""
    return int((logits.argmax(axis=1) == labels).sum())
