"""towers: multi-GPU tower training with CuPy + NCCL, NumPy on the CPU.

One process holds one model replica (a tower) per device.  Each step the towers
compute gradients on their slice of one global batch, the gradients are averaged
with one all-reduce, every replica applies the same update and an exponential
moving average of the weights is kept.

The folders follow the data flow of a step::

    towers/data/      datasets, shuffled global batches, staging onto devices
    towers/devices/   placement on GPUs or the CPU, CPU tower threads
    towers/ops/       the ops' kernels by op: each op's arithmetic once, its NumPy, numba and CUDA forms
    towers/nn/        layers, models, the loss, one replica's flat buffers
    towers/parallel/  the all-reduce, sync modes, the replica check
    towers/optim/     learning-rate schedule, the optimizers, the EMA
    towers/output/    checkpoints, logs, TensorBoard
    towers/step/      one step over a host's towers: stage, forward and backward, average, update
    towers/run/       the ``Trainer``, its executors (``local``; ``cluster/`` for ``hosts`` > 1), the loop,
                      its extensions, profiling, resume policy
    towers/cluster/   hosts as Ray actors (imported only for ``hosts`` > 1)

and at the top: the public API (``Trainer``, ``Config``, ``load``), the
settings (``config``, ``settings``), ``inference`` (``towers.load``: a
finished run's model for predictions), low utilities (``errors``,
``files``: atomic writes and npz, ``state``) and the command lines:
``train``, ``eval``, ``export``, ``fetch_data`` and the converters
``tfrecord_to_npz``, ``npz_to_tfrecord``, ``images_to_tfrecord`` (their
shared parsing in ``cli``).

    >>> import towers
    >>> with towers.Trainer(towers.Config(n_gpu=2, devices="cpu", steps=500)) as tr:
    ...     metrics = tr.fit()
    ...     weights = tr.get_weights()
    ...     logits = tr.predict(x)               # x: examples of the data's shape; towers.softmax(logits)

A finished run loads without its training data (``inference``)::

    >>> model = towers.load("runs/a")            # a logdir, a ckpt-*.npz or a final.npz
    >>> model.predict(x), model.evaluate()       # its logits; loss and accuracy on its test data
"""
from towers.config import Config
from towers.data.dataset import Dataset
from towers.data.loading import load_dataset
from towers.errors import TrainingError, UserError
from towers.inference import Predictor, load
from towers.nn.conv import Conv2D
from towers.nn.dropout import Dropout
from towers.nn.layers import Dense, Flatten, ReLU, Sequential
from towers.nn.loss import softmax
from towers.nn.normalization import LRN, BatchNorm
from towers.nn.pooling import AvgPool2D, GlobalAvgPool, MaxPool2D
from towers.nn.residual import PadShortcut, Residual
from towers.run.extensions import Extension
from towers.run.trainer import Trainer

__all__ = ["Config", "Trainer", "ClusterTrainer", "Dataset", "load_dataset", "load", "Predictor", "softmax",
           "Sequential", "Dense", "ReLU", "Flatten",
           "Conv2D", "MaxPool2D", "AvgPool2D", "GlobalAvgPool", "BatchNorm", "LRN", "Dropout", "Residual",
           "PadShortcut", "Extension",
           "UserError", "TrainingError"]


ClusterTrainer = Trainer  # the name older code uses for several hosts: one Trainer now runs either
