"""The built-in models, the defaults each one trains well with, and ``build_model``.

A model is a ``Sequential`` of layers (``towers.nn.layers``).  Besides its
layers, a built-in model carries the training settings it is known to train
well with (``BuiltinModel.defaults``): the optimizer, and for each optimizer the
learning rate, its decay and the momentum.  ``towers.config`` fills every
setting the user left unset from these, so ``--model lenet5`` alone trains.
A user's model (``package.module:function``, or a model object handed to the
``Trainer``) gets the generic defaults (``GENERIC``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from towers.errors import UserError
from towers.nn.conv import Conv2D, MaxPool2D
from towers.nn.layers import Dense, Flatten, Layer, ReLU, Sequential


def mlp(input_shape: tuple, num_classes: int, hidden: int = 500) -> Sequential:
    """The book's ``mnist_inference``: input -> hidden ReLU -> logits."""
    return Sequential(
        [Flatten(), Dense("layer1", hidden), ReLU(), Dense("layer2", num_classes)]
    )


def lenet5(input_shape: tuple, num_classes: int) -> Sequential:
    """The book's chapter 6 LeNet-5 (``LeNet5_infernece``), without dropout.

    conv 5x5x32 SAME + ReLU, max-pool 2x2, conv 5x5x64 SAME + ReLU, max-pool
    2x2, fc 512 + ReLU, fc ``num_classes``.  As in the book: weights
    truncated-normal(0.1); conv biases 0, fc biases 0.1; L2 only on the fully
    connected weights.

    Each ReLU runs AFTER its pool: max-pooling commutes with the monotone ReLU
    (relu(max(a, b)) == max(relu(a), relu(b))), so the function and its
    gradient are the book's, while the ReLU touches 4x fewer values.
    """
    return Sequential([
        Conv2D("layer1-conv1", 32, 5),
        MaxPool2D(2),  # layer2-pool1: no parameters, so no scope
        ReLU(),
        Conv2D("layer3-conv2", 64, 5),
        MaxPool2D(2),  # layer4-pool2
        ReLU(),
        Flatten(),
        Dense("layer5-fc1", 512, bias=0.1),
        ReLU(),
        Dense("layer6-fc2", num_classes, bias=0.1),
    ])


# Per optimizer: the settings a run uses when the user gives none.  ``adam``'s
# learning rate is TensorFlow's AdamOptimizer default.
GENERIC = {"sgd": {"lr": 0.8, "lr_decay": 0.99, "momentum": 0.0},
           "adam": {"lr": 0.001, "lr_decay": 1.0, "momentum": 0.0}}


@dataclass(frozen=True)
class BuiltinModel:
    build: Callable[..., Sequential]
    optimizer: str  # the optimizer it uses by default
    defaults: dict = field(default_factory=lambda: GENERIC)  # optimizer -> settings


MODELS: dict[str, BuiltinModel] = {
    # The book's MNIST example settings (batch 100, lr 0.8 decayed 0.99 per epoch).
    "mlp": BuiltinModel(mlp, "sgd"),
    "lenet5": BuiltinModel(lenet5, "adam", {
        "adam": {"lr": 0.001, "lr_decay": 1.0, "momentum": 0.0},
        # Measured on MNIST: 98.6% EMA accuracy in 3,000 steps (README).
        "sgd": {"lr": 0.01, "lr_decay": 0.99, "momentum": 0.9},
    }),
}


def model_defaults(spec, optimizer: str | None) -> tuple[str, dict]:
    """(optimizer, settings) a model trains with when the user sets neither."""
    entry = MODELS.get(spec) if isinstance(spec, str) else None
    opt = optimizer or (entry.optimizer if entry else "sgd")
    table = entry.defaults if entry else GENERIC
    return opt, dict(table.get(opt, GENERIC[opt]))


def as_sequential(model, where: str) -> Sequential:
    """A ``Sequential`` from a model object or a list of layers; anything else is a UserError."""
    if isinstance(model, (list, tuple)):
        bad = [type(m).__name__ for m in model if not isinstance(m, Layer)]
        if bad or not model:
            raise UserError(f"{where} gave a list that is {'empty' if not model else 'not all layers (' + bad[0] + ')'}: "
                            "return a towers.Sequential or a non-empty list of towers layers")
        model = Sequential(list(model))
    if not isinstance(model, Sequential):
        raise UserError(f"{where} gave {type(model).__name__}, not a towers.Sequential or a list of layers")
    return model


def build_model(spec, input_shape: tuple, num_classes: int, hidden: int = 500) -> Sequential:
    """``mlp``, ``lenet5``, ``package.module:function``, or a model object.

    A user's function is called as ``function(input_shape, num_classes)`` and
    returns a ``Sequential`` (or a list of layers).  A model object (a
    ``Sequential`` or a list of layers) is built as it is.
    """
    if not isinstance(spec, str):
        model, where = as_sequential(spec, "the model object"), "the model object"
    elif spec in MODELS:
        fn, where = MODELS[spec].build, f"`model` {spec}"
        model = fn(input_shape, num_classes, hidden=hidden) if spec == "mlp" else fn(input_shape, num_classes)
    elif ":" in spec:
        where = f"`model` {spec}"
        mod_name, _, fn_name = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise UserError(f"{where}: cannot load it ({e}); give package.module:function") from None
        if not callable(fn):
            raise UserError(f"{where}: {fn_name} in {mod_name} is a {type(fn).__name__}, not a function; "
                            "give package.module:function")
        model = as_sequential(fn(tuple(input_shape), num_classes), f"{where}: the function")
    else:
        raise UserError(
            f"`model` {spec!r} is unknown: use one of {', '.join(sorted(MODELS))} or package.module:function"
        )
    model.build(input_shape)
    if model.output_shape != (num_classes,):
        raise UserError(
            f"{where}: it outputs per-example shape {model.output_shape}, "
            f"but the data has {num_classes} classes"
        )
    return model
