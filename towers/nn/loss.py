"""The loss: mean sparse softmax cross-entropy from logits, and its gradient.

TensorFlow's ``sparse_softmax_cross_entropy_with_logits``, averaged over the
batch.  Computed with the log-sum-exp shift, never from a softmax that can
underflow.  The gradient with respect to the logits is ``(softmax - onehot) / n``.

Label smoothing ``eps`` (TensorFlow's ``label_smoothing``, Szegedy et al.):
the target is ``(1 - eps) * onehot + eps / C``, so the loss is the plain
cross-entropy plus ``eps * mean_rows(z_y - mean_c z_c)`` and the gradient
``(softmax - onehot) / n + eps * (onehot - 1 / C) / n``: the plain loss and
gradient, then two corrections (array operations on either device).

``softmax`` turns logits (``Trainer.predict``'s) into probabilities on the
host, with the same max shift.
"""
from __future__ import annotations

import numpy

from towers.arrays import array_module, check_host
from towers.nn.layers import Workspace
from towers.ops.softmax_xent import softmax_xent


def softmax_cross_entropy(logits, labels, ws: Workspace, want_loss: bool = True, smoothing: float = 0.0):
    """Mean sparse softmax cross-entropy from logits and its gradient.

    Uses the log-sum-exp shift (never the log of a softmax, which underflows).
    Returns (loss or None, dlogits); dlogits lives in ``ws``.  On a GPU it is
    one fused kernel (``towers.ops.softmax_xent``).  ``smoothing``:
    label smoothing (module doc).
    """
    # Host labels of device logits (a replica driven by hand) go to the device: the kernel and the smoothing's
    # indexing take device labels.
    labels = ws.xp.asarray(labels)
    loss, d = softmax_xent(logits, labels, ws, want_loss)
    if not smoothing:
        return loss, d
    xp = ws.xp
    n, c = logits.shape
    t = logits.dtype.type
    rows = xp.arange(n)
    if want_loss:
        loss = loss + t(smoothing) * (xp.mean(logits[rows, labels]) - xp.mean(logits))
    d[rows, labels] += t(smoothing / n)
    d -= t(smoothing / (n * c))
    return loss, d


def accuracy_count(logits, labels) -> int:
    """Number of correct predictions (host int: a sync point, used at eval only)."""
    return int((logits.argmax(axis=1) == labels).sum())


def top_k_count(logits, labels, k: int) -> int:
    """Number of examples whose label is among their ``k`` largest logits (host int: a sync point, at eval only).

    A label's rank is the count of logits strictly above its own, so a tie with the k-th largest counts
    as in; ``k`` = 1 is ``accuracy_count`` up to such ties.
    """
    own = logits[array_module(logits).arange(len(labels)), labels]
    return int(((logits > own[:, None]).sum(axis=1) < k).sum())


def softmax(logits, axis: int = -1) -> numpy.ndarray:
    """Probabilities from logits (``towers.softmax``): ``exp(z - max z) / sum exp(z - max z)`` along ``axis``.

    A host (NumPy) array in, float32 out.  Subtracting each row's largest
    logit first keeps ``exp`` from overflowing (logits of 1000 give 1, not
    inf / inf = nan) and changes nothing else: the factor ``exp(-max z)``
    cancels.  The largest probability of a row is at its largest logit, so the
    argmax (the predicted class) is the logits' own.
    """
    check_host(logits, "softmax: logits")
    z = numpy.asarray(logits, dtype=numpy.float32)
    e = numpy.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)
