"""towers: single-host multi-GPU tower training with CuPy + NCCL, NumPy on the CPU.

One process holds one model replica (a tower) per device.  Each step the towers
compute gradients on their slice of one global batch, the gradients are averaged
with one all-reduce (``towers.allreduce``), every replica applies the same update
and an exponential moving average of the weights is kept (``towers.optimizer``).

Where things live:

=====================  ==============================================
``towers.placement``   which device each tower runs on, and why
``towers.model``       the layer API, models, loss, one replica's buffers
``towers.allreduce``   the gradient all-reduce (NCCL or on-device mean)
``towers.sync``        sync modes (gradients / weights every K) and the replica check
``towers.optimizer``   learning-rate schedule, SGD update and EMA
``towers.data``        npz input, shuffling, background batches, staging
``towers.summaries``   progress bar, log lines, metrics.jsonl
``towers.train``       the training script (``python -m towers.train``)
=====================  ==============================================
"""


class UserError(Exception):
    """A mistake in the user's input (flags, files, placement).

    The command-line entry points print its message as one line and exit with
    status 2; it is never shown as a traceback.
    """


class TrainingError(Exception):
    """A run that cannot go on (replicas diverged, the loss is not finite).

    Printed as one line by the entry points, with a non-zero exit status.
    """


__all__ = ["UserError", "TrainingError"]
