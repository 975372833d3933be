"""The built-in models, the defaults each one trains well with, and ``build_model``.

A model is a ``Sequential`` of layers (``towers.nn.layers``).  Besides its
layers, a built-in model carries the training settings it is known to train
well with (``BuiltinModel.defaults``): the optimizer, and for each optimizer the
learning rate, its decay and the momentum.  ``towers.config`` fills every
setting the user left unset from these, so ``--model lenet5`` alone trains.
Some also carry their paper's whole recipe (``Recipe``: batch, schedule in
epochs, augmentation), which a run takes when its data is what the recipe was
made for (``model_recipe``: 32x32x3 for the CIFAR models, 3-channel images for
the ImageNet ResNets).
A user's model (``package.module:function``, or a model object handed to the
``Trainer``) gets the generic defaults (``GENERIC``).

Every model takes any image shape (H, W) or (H, W, C) and any class count.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from towers.errors import UserError
from towers.nn.conv import Conv2D
from towers.nn.dropout import Dropout
from towers.nn.layers import Dense, Flatten, Layer, ReLU, Sequential
from towers.nn.normalization import LRN, BatchNorm
from towers.nn.pooling import GlobalAvgPool, MaxPool2D
from towers.nn.residual import Residual
from towers.optim.optimizers import defaults as optimizer_defaults


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


def cifar10(input_shape: tuple, num_classes: int) -> Sequential:
    """The model of TensorFlow's CIFAR-10 multi-GPU tutorial (``cifar10.inference``).

    conv 5x5x64 + ReLU, max-pool 3x3 stride 2, LRN, conv 5x5x64 + ReLU, LRN,
    max-pool 3x3 stride 2, fully connected 384 and 192 + ReLU, linear
    ``num_classes``; the tutorial's names and initializers (truncated normal:
    conv 5e-2, fc 0.04, softmax_linear 1/192; biases 0, 0.1 for conv2, local3
    and local4), L2 (its weight decay 0.004, the ``l2`` default) on local3 and
    local4 weights only; LRN ``depth_radius 4, bias 1, alpha 0.001/9, beta
    0.75``.  The first ReLU runs after its pool, as in ``lenet5`` (the same
    function at a quarter of the cost).
    """
    lrn = dict(depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75)
    return Sequential([
        Conv2D("conv1", 64, 5, stddev=5e-2),
        MaxPool2D(3, 2),  # pool1
        ReLU(),
        LRN(**lrn),  # norm1
        Conv2D("conv2", 64, 5, stddev=5e-2, bias=0.1),
        ReLU(),
        LRN(**lrn),  # norm2
        MaxPool2D(3, 2),  # pool2
        Flatten(),
        Dense("local3", 384, stddev=0.04, bias=0.1, regularize=True),
        ReLU(),
        Dense("local4", 192, stddev=0.04, bias=0.1, regularize=True),
        ReLU(),
        Dense("softmax_linear", num_classes, stddev=1 / 192.0, regularize=False),
    ])


def resnet(n: int):
    """He et al. 2016's CIFAR ResNet of 6n+2 layers (``resnet20``: n = 3, ``resnet32``: 5, ``resnet56``: 9).

    conv 3x3x16 + BN + ReLU, then three stages of n residual blocks (16, 32,
    64 filters; the first block of stages 2 and 3 halves height and width with
    a stride-2 convolution and an option-A shortcut), global average pooling
    and a fully connected layer.  A block is conv 3x3 + BN + ReLU + conv 3x3 +
    BN, added to its shortcut, then ReLU.  Convolutions have no bias (BN's
    beta is one) and He et al.'s normal(0, sqrt(2 / fan_in)) weights, padded
    1 pixel (PyTorch's and the paper's alignment: a stride-2 window's centre
    is the pixel the shortcut keeps); L2 on the convolution and fc weights,
    not on BN's gamma and beta.
    """
    def build(input_shape: tuple, num_classes: int) -> Sequential:
        def conv(scope, filters, stride=1):
            return Conv2D(scope, filters, 3, padding=1, stride=stride, bias=False, stddev="he", regularize=True)

        layers = [conv("conv1", 16), BatchNorm("bn1"), ReLU()]
        for stage, filters in enumerate((16, 32, 64), 1):
            for block in range(1, n + 1):
                stride = 2 if stage > 1 and block == 1 else 1
                layers.append(Residual(
                    [conv("conv1", filters, stride), BatchNorm("bn1"), ReLU(), conv("conv2", filters), BatchNorm("bn2")],
                    shortcut="A" if stride > 1 else None, scope=f"stage{stage}/block{block}"))
        return Sequential(layers + [GlobalAvgPool(), Dense("fc", num_classes, stddev=0.125, regularize=True)])

    build.__name__ = f"resnet{6 * n + 2}"
    build.__doc__ = resnet.__doc__
    return build


# Batch norm of the ImageNet models: torchvision's epsilon, and its momentum 0.1 written as TensorFlow's decay.
IMAGENET_BN = dict(momentum=0.9, epsilon=1e-5)
# Bottleneck blocks per stage (He et al. 2016, table 1).
BOTTLENECK_DEPTHS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


def bottleneck_resnet(blocks=(3, 4, 6, 3), width: int = 64, zero_init_residual: bool = False):
    """ImageNet's ResNet of bottleneck blocks, v1.5 (``resnet50``: blocks (3, 4, 6, 3); 101: (3, 4, 23, 3);
    152: (3, 8, 36, 3)), torchvision's ``resnet50`` layer for layer and name for name.

    conv 7x7 stride 2 padding 3 (``width`` filters) + BN + ReLU, max-pool 3x3 stride 2 padding 1, four
    stages (``layer1`` .. ``layer4``) of bottleneck blocks with ``width`` x 1, 2, 4, 8 inner filters and 4
    times that out; the first block of stages 2-4 halves height and width: ResNet v1.5 strides its 3x3
    convolution, not the first 1x1 (torchvision, NVIDIA's recipes; v1 as in Keras' ``ResNet50`` strides
    the 1x1).  A block (``layerS/i``) is conv 1x1 + BN + ReLU, conv 3x3 (the stride) + BN + ReLU, conv
    1x1 + BN, added to its shortcut (``downsample/0`` a 1x1 convolution at the stride and
    ``downsample/1`` a BN where the shape changes, option B; else the identity), then ReLU; then global
    average pooling and ``fc``.  Any image size ((H, W) or (H, W, C)); each stride rounds up.

    Initialization: convolutions He et al.'s normal(0, sqrt(2 / fan_in)) without bias, BN gamma 1 and
    beta 0 (with ``zero_init_residual`` the last BN of each block starts at gamma 0: Goyal et al.'s
    option, each block starts as the identity), ``fc`` truncated normal(0.01) and bias 0.  BN:
    epsilon 1e-5 and momentum 0.9 (``IMAGENET_BN``: torchvision's 0.1 as the moving average's decay).
    L2 on the convolution and fc weights, not on BN's gamma and beta or on biases.  At 224x224x3 and
    1000 classes ``resnet50`` has 25,557,032 parameters, as torchvision's.
    """
    def build(input_shape: tuple, num_classes: int) -> Sequential:
        def conv(scope, filters, k, stride=1):
            return Conv2D(scope, filters, k, padding=(k - 1) // 2, stride=stride, bias=False, stddev="he",
                          regularize=True)

        def bn(scope, gamma=1.0):
            return BatchNorm(scope, gamma_init=gamma, **IMAGENET_BN)

        last = 0.0 if zero_init_residual else 1.0
        layers = [conv("conv1", width, 7, 2), bn("bn1"), ReLU(), MaxPool2D(3, 2, padding=1)]
        channels = width
        for stage, n in enumerate(blocks):
            inner = width * 2 ** stage
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                body = [conv("conv1", inner, 1), bn("bn1"), ReLU(), conv("conv2", inner, 3, stride), bn("bn2"),
                        ReLU(), conv("conv3", 4 * inner, 1), bn("bn3", last)]
                shortcut = None
                if stride != 1 or channels != 4 * inner:
                    shortcut = [conv("downsample/0", 4 * inner, 1, stride), bn("downsample/1")]
                layers.append(Residual(body, shortcut, scope=f"layer{stage + 1}/{i}"))
                channels = 4 * inner
        return Sequential(layers + [GlobalAvgPool(), Dense("fc", num_classes, stddev=0.01, regularize=True)])

    depth = 3 * sum(blocks) + 2
    build.__name__ = f"resnet{depth}"
    build.__doc__ = bottleneck_resnet.__doc__
    return build


# VGG-16's convolutions (filters; "M": a 2x2 max-pool), configuration D of Simonyan and Zisserman.
VGG16_CONVS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg16(input_shape: tuple, num_classes: int, width: int = 64, hidden: int = 4096) -> Sequential:
    """VGG-16 (Simonyan and Zisserman's configuration D), torchvision's ``vgg16`` layer for layer and name for name.

    Thirteen 3x3 convolutions padded 1 pixel, with bias, each + ReLU, in five stages of 64, 128, 256, 512,
    512 filters (``width`` x 1, 2, 4, 8, 8), each stage ended by a 2x2 max-pool; then fully connected
    ``hidden`` (4096) + ReLU + dropout 0.5, ``hidden`` + ReLU + dropout 0.5, ``num_classes``.  Named as
    torchvision's ``features.<index>`` and ``classifier.<index>``.  Any image size (the pools round up);
    the first fully connected layer takes the last pool's (H/32) x (W/32) x 512 values: at 224x224 these
    are torchvision's 7x7x512 (its adaptive pooling to 7x7 then does nothing), and the model has
    138,357,544 parameters at 1000 classes, as torchvision's; at other sizes that layer is sized to the
    image (torchvision would resample to 7x7 instead).

    Initialization: convolutions He et al.'s normal(0, sqrt(2 / fan_in)), the two hidden fully connected
    layers truncated normal(sqrt(2 / fan_in)) (torchvision's normal(0.01) vanishes at reduced widths: the
    signal shrinks by 0.01 x sqrt(fan_in) a layer), the last truncated normal(0.01); biases 0.  L2 on the
    weights, not the biases.  No batch norm.
    """
    layers, index, (h, w) = [], 0, tuple(input_shape[:2])
    for v in VGG16_CONVS:
        if v == "M":
            layers.append(MaxPool2D(2))
            index, h, w = index + 1, -(-h // 2), -(-w // 2)
            continue
        layers += [Conv2D(f"features/{index}", v * width // 64, 3, padding=1, stddev="he", regularize=True),
                   ReLU()]
        index += 2
    features = h * w * 8 * width
    return Sequential(layers + [
        Flatten(),
        Dense("classifier/0", hidden, stddev=(2 / features) ** 0.5, regularize=True), ReLU(), Dropout(0.5),
        Dense("classifier/3", hidden, stddev=(2 / hidden) ** 0.5, regularize=True), ReLU(), Dropout(0.5),
        Dense("classifier/6", num_classes, stddev=0.01, regularize=True),
    ])


# Per optimizer: the settings a run uses when the user gives none, as each
# optimizer's file declares them (``towers.optim.optimizers``).  A model's own
# table overrides these keys, and adds schedule settings (``towers.optim.schedule``).
GENERIC = optimizer_defaults()

# He et al.: SGD, momentum 0.9, weight decay 1e-4, lr 0.1 divided by 10 at
# 32k and 48k steps (batch 128).
_HE = {"lr": 0.1, "lr_decay": 1.0, "momentum": 0.9, "l2": 1e-4, "lr_schedule": "piecewise",
       "lr_boundaries": "32000,48000"}


# Goyal et al.'s optimizer when no recipe applies: SGD, momentum 0.9, weight decay 1e-4, lr 0.1.
_GOYAL = {"lr": 0.1, "lr_decay": 1.0, "momentum": 0.9, "l2": 1e-4}


@dataclass(frozen=True)
class Recipe:
    """A model's whole training recipe for the data it was made for, in epochs (so it holds for any data set
    size and tower count).

    It applies (``applies``) to examples of ``shape`` (None: any image of 3 channels, (H, W, 3)).
    ``settings`` are ``Config`` settings by name; ``global_batch`` sets ``batch_size`` to its share per
    tower (rounded, at least 1); ``lr_per_256`` sets ``lr`` to it x the examples of a step / 256 (Goyal
    et al.'s linear scaling rule).  ``towers.config.Config.resolved`` fills from it only what the user left
    unset; ``towers.run.trainer.Trainer`` decides whether it applies (see ``recipe_for``).
    """

    name: str
    shape: tuple | None
    settings: dict
    global_batch: int | None = None
    lr_per_256: float | None = None

    def applies(self, example_shape) -> bool:
        s = tuple(example_shape)
        return s == self.shape if self.shape is not None else len(s) == 3 and s[2] == 3


# He et al. 2016, section 4.2: SGD with momentum 0.9, weight decay 1e-4, batch 128, lr 0.1 divided by 10 at
# 32k and 48k steps, 64k steps in all, on 45k training images: epochs 91, 136 and 182; pad 4, random crop, flip.
HE_CIFAR = Recipe("He et al. 2016 (CIFAR-10)", (32, 32, 3), {
    "optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "l2": 1e-4, "lr_schedule": "piecewise",
    "lr_epochs": "91,136", "epochs": 182, "augment": "cifar"}, global_batch=128)
# TensorFlow's CIFAR-10 tutorial (cifar10_multi_gpu_train): plain SGD, batch 128 per tower, lr 0.1 divided by
# 10 every 350 epochs (staircase), 1,000,000 steps of 128 (2,560 epochs of 50k), its 24x24 crops, flips,
# brightness and contrast; weight decay 0.004 on local3 and local4 (the model's `l2`).
TF_CIFAR10 = Recipe("TensorFlow's CIFAR-10 tutorial", (32, 32, 3), {
    "optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "l2": 0.004, "lr_schedule": "piecewise",
    "lr_epochs": ",".join(str(350 * k) for k in range(1, 8)), "epochs": 2560, "augment": "tf-cifar10",
    "batch_size": 128})
# Goyal et al. 2017: SGD momentum 0.9, weight decay 1e-4 (not on batch norm or biases: the models'), 32 images a
# tower, lr 0.1 x global batch / 256 after a 5-epoch linear warm-up, divided by 10 at epochs 30, 60 and 80 of 90;
# random resized crops and flips, resize 256 and center crop 224 for evaluation (`augment` imagenet).
GOYAL = Recipe("Goyal et al. 2017 (ImageNet)", None, {
    "optimizer": "sgd", "momentum": 0.9, "l2": 1e-4, "lr_schedule": "piecewise", "lr_epochs": "30,60,80",
    "warmup_epochs": 5.0, "epochs": 90, "augment": "imagenet", "batch_size": 32}, lr_per_256=0.1)


@dataclass(frozen=True)
class BuiltinModel:
    build: Callable[..., Sequential]
    optimizer: str  # the optimizer it uses by default
    defaults: dict = field(default_factory=lambda: GENERIC)  # optimizer -> settings (over GENERIC's)
    recipe: Recipe | None = None  # its whole recipe, for the data it was made for


MODELS: dict[str, BuiltinModel] = {
    # The book's MNIST example settings (batch 100, lr 0.8 decayed 0.99 per epoch).
    "mlp": BuiltinModel(mlp, "sgd"),
    "lenet5": BuiltinModel(lenet5, "adam", {
        "adam": {"lr": 0.001, "lr_decay": 1.0, "momentum": 0.0},
        # Measured on MNIST: 98.6% EMA accuracy in 3,000 steps (docs/models.md).
        "sgd": {"lr": 0.01, "lr_decay": 0.99, "momentum": 0.9},
    }),
    # The tutorial: plain SGD, lr 0.1 decayed by 10x every 350 epochs (here per
    # epoch, continuously: 0.1 ** (1 / 350)), weight decay 0.004.
    "cifar10": BuiltinModel(cifar10, "sgd", {"sgd": {"lr": 0.1, "lr_decay": 0.1 ** (1 / 350), "l2": 0.004},
                                             "adam": {"l2": 0.004}}, TF_CIFAR10),
    **{f"resnet{6 * n + 2}": BuiltinModel(resnet(n), "sgd", {"sgd": _HE}, HE_CIFAR) for n in (3, 5, 9)},
    **{f"resnet{d}": BuiltinModel(bottleneck_resnet(b), "sgd", {"sgd": _GOYAL}, GOYAL)
       for d, b in BOTTLENECK_DEPTHS.items()},
    "vgg16": BuiltinModel(vgg16, "sgd", {"sgd": _GOYAL}),
}


# The models that start each residual block's last batch-norm gamma at 0 with `zero_init_residual`.
ZERO_INIT_MODELS = {f"resnet{d}": bottleneck_resnet(b, zero_init_residual=True) for d, b in BOTTLENECK_DEPTHS.items()}


def model_recipe(spec, example_shape) -> Recipe | None:
    """The recipe of the built-in model ``spec`` when it applies to examples of ``example_shape``, else None."""
    entry = MODELS.get(spec) if isinstance(spec, str) else None
    recipe = entry.recipe if entry else None
    return recipe if recipe is not None and recipe.applies(example_shape) else None


def model_defaults(spec, optimizer: str | None) -> tuple[str, dict]:
    """(optimizer, settings) a model trains with when the user sets neither."""
    entry = MODELS.get(spec) if isinstance(spec, str) else None
    opt = optimizer or (entry.optimizer if entry else "sgd")
    table = entry.defaults if entry else GENERIC
    return opt, {**GENERIC[opt], **table.get(opt, {})}


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


def build_model(spec, input_shape: tuple, num_classes: int, hidden: int = 500,
                zero_init_residual: bool = False) -> Sequential:
    """``mlp``, ``lenet5``, ``package.module:function``, or a model object.

    ``zero_init_residual``: the bottleneck ResNets start each block's last batch-norm gamma at 0
    (``bottleneck_resnet``); other models do not take it.
    A user's function is called as ``function(input_shape, num_classes)`` and
    returns a ``Sequential`` (or a list of layers).  A model object (a
    ``Sequential`` or a list of layers) is built as it is.
    """
    if zero_init_residual and not (isinstance(spec, str) and spec in ZERO_INIT_MODELS):
        raise UserError(f"`zero_init_residual` applies to {', '.join(ZERO_INIT_MODELS)}, not "
                        f"{spec if isinstance(spec, str) else 'a model object'}: drop it")
    if not isinstance(spec, str):
        model, where = as_sequential(spec, "the model object"), "the model object"
    elif spec in MODELS:
        fn, where = MODELS[spec].build, f"`model` {spec}"
        fn = ZERO_INIT_MODELS[spec] if zero_init_residual else fn
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
        try:
            made = fn(tuple(input_shape), num_classes)
        except UserError:  # a layer's own one-line refusal (a bad argument): already says what to fix
            raise
        except Exception as e:  # not a model factory (json:loads), or one that fails: one line, not a traceback
            raise UserError(f"{where}: calling {fn_name}(input_shape={tuple(input_shape)}, num_classes={num_classes}) "
                            f"raised {type(e).__name__}: {e}; give a function (input_shape, num_classes) that "
                            "returns a towers.Sequential or a list of layers") from None
        model = as_sequential(made, f"{where}: the function")
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
