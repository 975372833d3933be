"""Every setting of a run (``Config``), its validation, and the model's defaults.

``Config`` is plain data: the command line builds one from flags, a Python user
writes one.  ``Config.resolved()`` checks every setting that needs no data and
fills the ones left unset (``None``) from the model's defaults
(``towers.nn.models``); the ``Trainer`` calls it before anything is allocated,
so a bad setting is a ``UserError`` naming it, whatever the caller.

Each setting is declared once, as a field whose metadata carries its help, its
group, its check and what a change does on ``--resume`` (``towers.settings``);
the optimizers' hyperparameters are declared in their own files and added here.
The command line, the flag table of docs/cli.md, the per-field checks and the resume
policy are derived from the declarations; the rules between settings are below.

Defaults, in order: what the user set; else the model's settings for the chosen
optimizer (``--model lenet5`` trains with Adam; ``--optimizer adam`` with no
``--lr`` gets Adam's own learning rate); else the optimizer's own (its file).
"""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from pathlib import Path

from towers.data.dataset import INPUT_SCALES
from towers.data.image.augment import AUGMENTS, parse_image_size, parse_normalize
from towers.errors import UserError
from towers.nn.models import ZERO_INIT_MODELS, model_defaults
from towers.ops.forms import GPU_CONVS
from towers.ops.precision import ALLREDUCE_DTYPES, PRECISIONS
from towers.optim.optimizers import OPTIMIZERS, check_given, check_settings as check_optimizer_settings
from towers.optim.optimizers import settings as optimizer_settings
from towers.optim.schedule import SCHEDULES, parse_list, piecewise_values
from towers.parallel.sync import MODES
from towers.settings import (BATCH, NOTE, REFUSE, SILENT, Bool, Choice, Free, Integer, Number, StepsOrEpoch,
                             Text, check_fields, inherited, setting, switch, tracks_given, with_settings)


def _default_data() -> str:
    """The embedded digits data: ``data/`` of a checkout, installed as ``towers/_data``."""
    here = Path(__file__).resolve().parent
    installed = here / "_data" / "digits.npz"
    return str(installed if installed.exists() else here.parent / "data" / "digits.npz")


DEFAULT_DATA = _default_data()
DEFAULT_STEPS = 2000  # `steps` when neither it nor `epochs` is given
# `model` of a run whose model was an object handed to the Trainer (checkpoints, the settings line).
MODEL_OBJECT = "<model object>"


def _decode_format(text: str) -> None:
    from towers.data.tfrecord.schema import parse_decode, parse_image_decode

    if parse_image_decode(text) is None:
        parse_decode(text)


def _normalize_format(text: str) -> None:
    parse_normalize(text, 3)  # the format; the channel count is checked with the data


def _other_held_out(cfg) -> str | None:
    """Why a change of the seed spoils the validation: it holds out other examples, some of them trained on."""
    return ("`validation_split` holds out other examples with another `seed`: some of them were trained on"
            if cfg.validation_split else None)


def _cosine_ends(cfg) -> str | None:
    """Why a change of the run's length changes its trajectory: a cosine schedule ends at it."""
    return "`lr_schedule` cosine ends at `steps`" if cfg.lr_schedule == "cosine" else None


@tracks_given
@dataclass
@with_settings(optimizer_settings(), after="l2")
class Config:
    """Every setting of a run, declared once (``towers.settings``): the command-line flags mirror these.

    The optimizers' hyperparameters (``momentum``, ``beta1`` ...) are declared in
    their own files (``towers.optim.optimizers``) and added after ``l2``.

    ``given``: the settings its caller passed (a flag typed, a field named in
    ``Config(...)`` or assigned after; None for a setting whose default is None counts as not
    given); a resumed run takes the others from its checkpoint (``resume_settings``).
    A copy made with ``dataclasses.replace`` counts every setting as given.
    """

    # placement
    n_gpu: int | None = setting(
        None, "number of towers (default 1, or one per --devices entry)", group="placement",
        check=Integer(1, optional=True), resume=BATCH, type="int | None", metavar="N", shown="1")
    devices: str | None = setting(
        None, "`cpu`, or GPU ids such as `0,2`", group="placement", check=Text(), resume=BATCH,
        type="str | None", metavar="LIST", shown="GPUs 0..N-1")
    soft_placement: bool = switch(
        "fail instead of bending an impossible placement (by default: no GPU runs on the CPU, too few GPUs "
        "are shared)", group="placement", resume=SILENT, on=True)
    log_placement: bool = switch(
        "print which device runs each tower, the EMA, input parsing and the reducer",
        group="placement", resume=SILENT)
    # data (a resume checks the data's shape and classes against the checkpoint's)
    data: str = setting(
        DEFAULT_DATA, "training data: an .npz with x, y and optionally x_test, y_test; TFRecord files or a glob of "
        "shards (`'train-*-of-*'`); or an image folder `DIR/<class>/*.jpg|jpeg|png` (see npz files, Training "
        "from TFRecord and Image data in docs/data.md)", group="data", check=Free(), resume=SILENT, type="str", metavar="PATH",
        shown="`data/digits.npz`")
    test_data: str | None = setting(
        None, "separate test data (.npz, TFRecord or image folder); default: x_test/y_test of --data",
        group="data", check=Text(), resume=SILENT, type="str | None", metavar="PATH", shown="`x_test`/`y_test`")
    x_key: str = setting("x", "npz key or TFRecord feature of the examples", group="data",
                         check=Text(optional=False), resume=SILENT, type="str", metavar="KEY")
    y_key: str = setting("y", "npz key or TFRecord feature of the labels", group="data",
                         check=Text(optional=False), resume=SILENT, type="str", metavar="KEY")
    decode: str | None = setting(
        None, "TFRecord: NAME:DTYPE[:SHAPE] reads the examples' bytes (or float) feature, e.g. "
        "`image_raw:uint8:28,28`; NAME:image:H,W,C decodes encoded images (JPEG, PNG), e.g. "
        "`image/encoded:image:224,224,3`", group="data", check=Text(parse=_decode_format), resume=NOTE,
        type="str | None", metavar="NAME:DTYPE[:SHAPE]")
    on_error: str = setting(
        "stop", "TFRecord: `stop` at a damaged record, or `skip` records whose payload CRC fails (counted); "
        "images: `skip` replaces one that does not decode (counted)", group="data",
        check=Choice(("stop", "skip")), resume=SILENT, type="str", metavar="stop|skip")
    validation_split: float = setting(
        0.0, "hold out this fraction of the training examples as the test data when there is none (no "
        "x_test/y_test in --data, no --test-data), never trained on: the same examples in every run of one "
        "--seed; for examples held in memory or an npz (see Validation and metrics in docs/training.md)",
        group="data", check=Number(0, 1, high_open=True), resume=NOTE, type="float", metavar="F")
    input_scale: str = setting(
        "1/255", "what uint8 examples (pixels) are multiplied by as they become float32, on the device and in "
        "--normalize: `1/255` (0..1) or `1` (0..255 as floats, as TensorFlow's multi-GPU example feeds them); float "
        "examples are used as they are (see npz files in docs/data.md)", group="data", check=Choice(tuple(INPUT_SCALES)),
        resume=NOTE, type="str", metavar="S")
    input_workers: int | None = setting(
        None, "TFRecord and images: processes that read, parse, decode and augment ahead of the towers (0: the "
        "input thread; default: one per core not running a CPU tower or the main thread, at most 4)",
        group="data", check=Integer(0, optional=True), resume=SILENT, type="int | None", metavar="N",
        shown="spare cores")
    # images (towers.data.image): image folders, encoded images (`decode` NAME:image:H,W,C), augmentation
    image_size: str | None = setting(
        None, "images: H,W,C of the examples (others are resized, shorter side, and center-cropped to it); "
        "default: --decode's, or the images' own when all alike", group="images",
        check=Text(parse=parse_image_size), resume=NOTE, type="str | None", metavar="H,W,C",
        shown="`--decode`'s, or the images' own")
    augment: str | None = setting(
        None, "images, training only: `none`, `cifar` (pad 4, random crop, flip), `tf-cifar10` (TF tutorial: "
        "24x24 crop, flip, brightness, contrast, per-image standardization), `imagenet` (random resized crop, "
        "flip); evaluation takes the center (see Image data in docs/data.md); default `none`, or the model's recipe's",
        group="images", check=Choice(AUGMENTS, optional=True), resume=NOTE, type="str | None", metavar="NAME",
        shown="`none`, or the recipe's", model_default="recipe", fallback="none")
    normalize: str | None = setting(
        None, "images: `(x/255 - mean) / std` per channel (`(x - mean) / std` with --input-scale 1), MEAN,STD or one "
        "of each per channel, e.g. 0.5,0.25 or 0.485,0.456,0.406,0.229,0.224,0.225 (examples become float32; not "
        "with --augment tf-cifar10)",
        group="images", check=Text(parse=_normalize_format), resume=NOTE, type="str | None",
        metavar="MEAN,STD")
    cache_images: bool = switch(
        "images: decode an encoded-image training set (TFRecord, image folder) once and train from memory when "
        "it fits under --cache-images-mib (not with --augment imagenet); results are the same either way",
        group="images", resume=SILENT, on=True)
    cache_images_mib: int = setting(
        2048, "images: memory budget of the decoded-image cache in MiB (a larger set is decoded every epoch, "
        "with a notice of the size it needs; so is one the process has no memory for, see Image data in docs/data.md)",
        group="images", check=Integer(1), resume=SILENT, type="int", metavar="MIB")
    # model
    model: str = setting(
        "mlp", "`mlp`, `lenet5`, `cifar10` (TF's CIFAR-10 tutorial model), `resnet20`, `resnet32`, `resnet56` "
        "(He et al.'s CIFAR ResNets), `resnet50`, `resnet101`, `resnet152` (ImageNet's, v1.5), `vgg16`, or "
        "`package.module:function` returning a towers.Sequential or a list of layers (see Your own model and layers in docs/models.md)",
        group="model", check=Free(), resume=REFUSE, type="str", metavar="NAME")
    hidden: int = setting(500, "hidden units of the mlp", group="model", check=Integer(1), resume=REFUSE,
                          type="int", metavar="N", used_when=lambda cfg: cfg.model == "mlp")
    zero_init_residual: bool = setting(
        False, "resnet50, resnet101, resnet152: start the last batch norm's gamma of each residual block at 0, so "
        "each block starts as the identity (Goyal et al.)", group="model", check=Bool(), resume=NOTE, type="bool",
        used_when=lambda cfg: cfg.model in ZERO_INIT_MODELS)
    # optimization; None: the model's default (towers.nn.models)
    optimizer: str | None = setting(
        None, f"the optimizer: {', '.join(f'`{o}`' for o in OPTIMIZERS)} (default: the model's; mlp, cifar10, "
        "resnets: sgd, lenet5: adam; see Optimizers in docs/models.md); a hyperparameter's flag names in [] the optimizers that "
        "read it", group="optimization",
        check=Choice(lambda: tuple(OPTIMIZERS), optional=True), resume=NOTE, type="str | None", metavar="NAME",
        shown="the model's")
    batch_size: int | None = setting(
        None, "examples per tower per step (default: 100, or the model's recipe's)", group="optimization",
        check=Integer(1, optional=True), resume=BATCH, type="int | None", metavar="B",
        shown="100, or the recipe's", model_default="recipe", fallback=100)
    accumulate: int = setting(
        1, "micro-batches of --batch-size each tower sums before one all-reduce and one update: a step takes "
        "towers x B x K examples (batch norm: statistics per micro-batch; see Gradient accumulation in docs/training.md)",
        group="optimization", check=Integer(1), resume=BATCH, type="int", metavar="K")
    steps: int | None = setting(
        None, f"training steps (with --resume: the total, not more steps; default the run's own); default "
        f"{DEFAULT_STEPS}, or what --epochs gives", group="optimization", check=Integer(1, optional=True), resume=SILENT, type="int | None",
        metavar="N", shown=str(DEFAULT_STEPS), note_when=_cosine_ends)
    epochs: int | None = setting(
        None, "train for N epochs instead of --steps (give one of them): the steps are N x the training examples / "
        "the examples of a step (towers x B x K), rounded up, so every example is seen N times and the last step "
        "takes the rest of its batch from the next epoch's shuffle (with --resume: the total, not more epochs)",
        group="optimization", check=Integer(1, optional=True), resume=SILENT, type="int | None", metavar="N",
        note_when=_cosine_ends)
    lr: float | None = setting(
        None, "initial learning rate (default: the model's for its optimizer; mlp with sgd 0.8, cifar10 and "
        "resnets 0.1; see Optimizers in docs/models.md for the others)", group="optimization", check=Number(0, low_open=True),
        resume=NOTE, type="float | None", metavar="LR", shown="the model's", model_default=True,
        follows=("lr_values",))
    lr_decay: float | None = setting(
        None, "decay per epoch, TF exponential_decay: `lr = LR * R ** (examples_seen / examples_per_epoch)` "
        "(default: the model's; sgd 0.99, the others 1)", group="optimization",
        check=Number(0, 1, low_open=True), resume=NOTE, type="float | None", metavar="R", shown="the model's",
        model_default=True, follows=("lr_schedule",))
    decay_steps: int | None = setting(
        None, "exponential decay counted in steps, TF exponential_decay's `decay_steps`: `lr = LR * R ** (step / N)` "
        "(default: per epoch, as --lr-decay says)", group="optimization", check=Integer(1, optional=True),
        resume=NOTE, type="int | None", metavar="N", shown="one epoch", follows=("lr_schedule",))
    staircase: bool = switch(
        "floor the exponent: decay the learning rate once per whole epoch (or per --decay-steps)",
        group="optimization", resume=NOTE, follows=("lr_schedule",))
    l2: float | None = setting(
        None, "L2 on weights (not biases, not batch-norm parameters): `S * sum(w**2) / 2` (default: the model's: "
        "1e-4; cifar10 0.004, on local3 and local4 only; see Optimizers in docs/models.md)", group="optimization", check=Number(0),
        resume=NOTE, type="float | None", metavar="S", shown="the model's", model_default=True)
    ema_decay: float = setting(
        0.99, "EMA decay (TF ExponentialMovingAverage, num_updates the global step after the update): `d = "
        "min(D, (1 + n) / (10 + n))`, n = 1 at the first update (see The EMA in docs/training.md)",
        group="optimization", check=Number(0, 1, high_open=True), resume=NOTE, type="float", metavar="D")
    seed: int = setting(0, "seed of the initial weights, the shuffle and dropout masks", group="optimization",
                        check=Integer(0), resume=NOTE, type="int", metavar="S", note_when=_other_held_out)
    # models' recipes (towers.nn, towers.optim.schedule)
    lr_schedule: str | None = setting(
        None, "`exponential` (decay per epoch, the default), `piecewise` (constant between --lr-boundaries) or "
        "`cosine` (to 0 at --steps, or the steps --epochs gives); default: the model's (resnets: piecewise; see "
        "Recipes in docs/models.md)", group="recipes", check=Choice(SCHEDULES, optional=True), resume=NOTE, type="str | None",
        metavar="S", shown="the model's", follows=("lr_boundaries", "lr_values"))
    lr_boundaries: str | None = setting(
        None, "piecewise: the steps where the learning rate changes, e.g. 32000,48000 (resnets' default)",
        group="recipes", check=Text(), resume=NOTE, type="str | None", metavar="B1,B2", shown="the model's",
        follows=("lr_schedule",))
    lr_values: str | None = setting(
        None, "piecewise: the learning rates, one more than boundaries, e.g. 0.1,0.01,0.001 (default: --lr "
        "divided by 10 at each boundary)", group="recipes", check=Text(), resume=NOTE, type="str | None",
        metavar="V0,V1,V2", shown="`--lr` / 10 per boundary", follows=("lr_schedule", "lr"))
    lr_epochs: str | None = setting(
        None, "piecewise: the epochs where the learning rate changes, instead of --lr-boundaries, e.g. 30,60,80 "
        "(each becomes the step that epoch ends on, for any data size and tower count)", group="recipes",
        check=Text(), resume=NOTE, type="str | None", metavar="E1,E2", shown="the recipe's",
        follows=("lr_schedule",))
    warmup_steps: int = setting(
        0, "linear warm-up: the rate times `(step + 1) / N` for the first N steps (0: none)", group="recipes",
        check=Integer(0), resume=NOTE, type="int", metavar="N")
    warmup_epochs: float | None = setting(
        None, "linear warm-up over E epochs instead of --warmup-steps (the ImageNet ResNets' recipe: 5; 0: none)",
        group="recipes", check=Number(0, optional=True), resume=NOTE, type="float | None",
        metavar="E", shown="the recipe's")
    recipe: str = setting(
        "auto", "`auto`: a built-in model trains with its paper's whole recipe (batch, schedule in epochs, "
        "augmentation) when the data read from --data is what it was made for (resnet20/32/56 and cifar10: "
        "32x32x3; resnet50/101/152: 3-channel images); flags given override it; `none`: the model's plain "
        "defaults (see Recipes in docs/models.md)", group="recipes", check=Choice(("auto", "none")), resume=NOTE, type="str",
        metavar="auto|none")
    label_smoothing: float = setting(
        0.0, "train on targets `(1 - S) * onehot + S / classes` (0: none)", group="recipes",
        check=Number(0, 1, high_open=True), resume=NOTE, type="float", metavar="S")
    sync_bn: bool = switch(
        "batch norm normalizes with the statistics of the whole step's batch across towers (two small "
        "all-reduces per batch-norm layer), not each tower's own (see Batch norm in docs/models.md)", group="recipes", resume=NOTE)
    # keeping replicas together
    sync: str = setting(
        "grads", "`grads`: average gradients every step; `weights`: each tower steps alone, weights averaged every "
        "K; with --hosts > 1 also `ps` (synchronous parameter server) or `async` (see Keeping replicas together in docs/training.md)",
        group="sync", check=Choice(lambda: tuple(MODES)), resume=NOTE, type="str", metavar="MODE")
    average_every: int = setting(1, "K: steps between weight averages with --sync weights", group="sync",
                                 check=Integer(1), resume=NOTE, type="int", metavar="K")
    check_replicas: int = setting(0, "compare every replica with the first every K steps (0: only at the end)",
                                  group="sync", check=Integer(0), resume=SILENT, type="int", metavar="K")
    # several hosts (towers.cluster, Ray)
    hosts: int = setting(
        1, "host actors on Ray, each running --n-gpu towers; > 1 starts or joins Ray (see docs/hosts.md)",
        group="hosts", check=Integer(1), resume=BATCH, type="int", metavar="H")
    ray_address: str | None = setting(
        None, "join this Ray cluster: `auto` or HOST:PORT of `ray start --head`; default: a local Ray instance",
        group="hosts", check=Text(), resume=SILENT, type="str | None", metavar="ADDR", shown="a local Ray")
    ray_logs: bool = switch("show Ray's own log lines (hidden by default)", group="hosts", resume=SILENT)
    # output
    log_every: int | None = setting(
        None, "steps between log lines (the loss, the training accuracy of that step; default: the steps / 20, at "
        "least 1 and at most 100, so a short run has a curve too)", group="output", check=Integer(1, optional=True),
        resume=SILENT, type="int | None", metavar="N", shown="steps / 20, at most 100")
    logdir: str | None = setting(None, "output directory", group="output", check=Text(), resume=SILENT,
                                 type="str | None", metavar="DIR", shown="`runs/<timestamp>`")
    quiet: bool = switch("no progress bar and no per-step log lines", group="output", resume=SILENT)
    # checkpoints and summaries
    checkpoint_every: int | None = setting(
        None, "steps between checkpoints (ckpt-<step>.npz in --logdir; default 1000, with --sync weights rounded "
        "up to a multiple of --average-every); one is always written at the end; 0: only then", group="output",
        check=Integer(0, optional=True), resume=SILENT, type="int | None", metavar="K", shown="1000",
        follows=("sync", "average_every"))
    keep_checkpoints: int = setting(5, "how many of the newest checkpoints to keep", group="output",
                                    check=Integer(1), resume=SILENT, type="int", metavar="N")
    resume: bool = switch(
        "continue the run in --logdir from its latest valid checkpoint, with the checkpoint's settings (its model, "
        "data, towers, batch, schedule, steps ...) but those given as flags (--steps is the total, not more steps; "
        "see Resuming in docs/training.md for what a changed setting does)", group="output", resume=SILENT)
    summary_every: int | None = setting(
        None, "steps between TensorBoard summaries (scalars, weight and gradient histograms; a host sync); 0: none "
        "(default: --log-every's)", group="output", check=Integer(0, optional=True), resume=SILENT,
        type="int | None", metavar="K", shown="`--log-every`'s")
    eval_every: int | str | None = setting(
        None, "steps between evaluations of the test data (or the held-out --validation-split): loss and accuracy "
        "of the raw and the EMA weights, and top-5 accuracy with more than 10 classes, in the log, metrics.jsonl "
        "and TensorBoard; `epoch`: at each epoch's end; 0: only at the end (default: at each checkpoint)",
        group="output", check=StepsOrEpoch(), resume=SILENT, type="int | str | None", metavar="N|epoch",
        shown="`--checkpoint-every`'s")
    # performance
    cpu_towers: str = setting(
        "threads", "CPU towers run `threads` (concurrently, one thread each: fastest measured) or `serial` (one "
        "after another)", group="performance", check=Choice(("threads", "serial")), resume=SILENT, type="str",
        metavar="MODE")
    blas_threads: int = setting(
        0, "BLAS threads of the process (0: auto: the cores this process may use less one, split among its CPU "
        "towers, at least one each, so a busy process beside it does not stall every product; --cpu-towers serial: "
        "every core; a host of --hosts shares its machine's cores with the other CPU hosts there; see CPU towers in "
        "docs/performance.md)",
        group="performance", check=Integer(0), resume=SILENT, type="int", metavar="N")
    profile: bool = switch("print a per-phase, per-tower time breakdown at the end (syncs GPU streams per phase; see "
        "`--profile` in docs/performance.md)", group="performance", resume=SILENT)
    measure_scaling: bool = switch(
        "after the run, time 1 tower alone and print the scaling efficiency", group="performance", resume=SILENT)
    cpu_kernels: str = setting(
        "auto", "CPU towers' batch norm, max-pooling, ReLU, col2im, L2 gradient, all-reduce mean and optimizer "
        "update through fused kernels compiled by numba (`numba`; `auto`: when numba imports, for models with batch "
        "norm, a convolution with more filters than input channels, or 100k parameters or more) or NumPy's array "
        "operations (`numpy`); batch norm's and those convolutions' results agree to float32 rounding, the rest bit "
        "for bit (a resume notes a change of what ran them)",
        group="performance", check=Choice(("auto", "numba", "numpy")), resume=SILENT, type="str", metavar="MODE")
    nccl_timeout: float = setting(
        0.0, "seconds each host sync point of GPU towers on several GPUs waits for NCCL's all-reduces, polling "
        "NCCL's asynchronous errors: a failed all-reduce (a peer gone) stops the run with one line instead of "
        "hanging it; 0: off, the streams are waited for as CUDA does (not yet run on a GPU)", group="performance",
        check=Number(0), resume=SILENT, type="float", metavar="S", gpu_only=True)
    tf32: bool = switch("GPU float32 matmuls (dense and convolution GEMMs) on TF32 tensor cores: faster, about 3e-4 "
        "relative error (off: plain float32)", group="performance", resume=NOTE, gpu_only=True)
    gpu_conv: str = setting(
        "im2col", "how GPU towers run convolutions: `im2col` (an im2col kernel and cuBLAS GEMMs), `cudnn` (NVIDIA's "
        "cuDNN through its frontend, pip install nvidia-cudnn-frontend; float32 as --tf32 says, deterministic engines; "
        "not yet checked on a GPU, see On a GPU in docs/performance.md) or `auto` (cuDNN where it starts, else im2col)",
        group="performance", check=Choice(GPU_CONVS), resume=NOTE, type="str", metavar="FORM", gpu_only=True)
    cuda_graphs: bool = switch(
        "GPU towers record their forward and backward as a CUDA graph once and replay it as one launch a step "
        "(host time per step falls from hundreds of launches to a few); GEMMs through nvmath-python (pip install "
        "nvmath-python); one micro-batch, no dropout, sync-BN or gradient buckets; not yet checked on a GPU, see "
        "On a GPU in docs/performance.md", group="performance", resume=NOTE, gpu_only=True)
    precision: str = setting(
        "fp32", "the format forward and backward compute in: `fp32`, or `bf16` / `fp16` on low-precision copies of "
        "the float32 master weights with float32 accumulation (on the CPU emulated by rounding; the optimizer's slots "
        "and the EMA stay float32); fp16 scales the loss dynamically (--loss-scale-growth; --sync grads on one host; "
        "see Low precision in docs/training.md)", group="performance", check=Choice(PRECISIONS), resume=NOTE, type="str", metavar="P")
    allreduce_dtype: str = setting(
        "fp32", "the gradients' format in the all-reduce: `bf16` rounds each tower's gradient to bfloat16 before it "
        "(half of NCCL's bytes on GPUs), the mean stays float32 (--sync grads; see Low precision in docs/training.md)", group="performance",
        check=Choice(ALLREDUCE_DTYPES), resume=NOTE, type="str", metavar="D")
    allreduce_bucket_mib: float = setting(
        0.0, "--sync grads: average the gradients in buckets of about this many MiB, cut at layer boundaries from the "
        "last layer, each as soon as every tower's backward has finished its layers, so the all-reduce overlaps "
        "backward (on GPUs on a second stream); the same mean as one all-reduce (bit for bit on the CPU); 0: one "
        "all-reduce after backward (see Gradient buckets in docs/training.md)", group="performance", check=Number(0), resume=SILENT,
        type="float", metavar="MIB", shown="0")
    loss_scale_growth: int = setting(
        2000, "--precision fp16: clean steps in a row after which the loss scale doubles (it starts at 2**16 and halves "
        "at each step skipped for an inf or NaN gradient)", group="performance", check=Integer(1), resume=NOTE,
        type="int", metavar="N", used_when=lambda cfg: cfg.precision == "fp16")

    def resolved(self, model=None, recipe=None, towers: int = 1) -> "Config":
        """A copy with every unset setting filled in, after checking every setting.

        ``model`` is the model object handed to the ``Trainer`` (it then gets
        the generic defaults, not those of ``self.model``).  ``recipe``: a
        ``towers.nn.models.Recipe`` that applies to the run's data, on
        ``towers`` towers (``recipe_settings``): it fills what the user left
        unset before the model's defaults do.
        """
        if not isinstance(self, Config):
            raise UserError(f"settings must be a towers.Config, got {type(self).__name__}")
        cfg = dataclasses.replace(self)  # the checks turn NumPy scalars into Python numbers in the copy
        _check(cfg)
        if recipe is not None:
            cfg = dataclasses.replace(cfg, **recipe_settings(cfg, recipe, towers, self.given))
        spec = cfg.model if model is None else None
        cfg.optimizer, defaults = model_defaults(spec, cfg.optimizer)
        check_given(cfg)  # before the defaults fill the optimizer's own hyperparameters
        filled = _schedule_defaults(cfg, defaults)
        # A hyperparameter of another optimizer stays unset: the run does not use it.
        filled.update({k: defaults.get(k, FALLBACK[k]) for k in MODEL_DEFAULTED
                       if getattr(cfg, k) is None and k not in filled and in_use(cfg, k)})
        if cfg.steps is None and cfg.epochs is None:
            filled["steps"] = DEFAULT_STEPS  # with `epochs`, the executor sets it (``steps_of_epochs``)
        if cfg.checkpoint_every is None:  # a checkpoint holds weights right after an average
            k = MODES[cfg.sync].period(cfg)
            filled["checkpoint_every"] = -(-1000 // k) * k
        if model is not None:  # record what was trained, not the `model` setting it replaced
            filled["model"] = MODEL_OBJECT
        cfg = dataclasses.replace(cfg, **filled)
        _check_optimization(cfg)
        return cfg



# The settings that choose a learning-rate schedule: one given keeps a recipe's schedule out.
_SCHEDULE = ("lr_schedule", "lr_boundaries", "lr_values", "lr_epochs", "lr_decay")


def recipe_settings(cfg: Config, recipe, towers: int, explicit=frozenset()) -> dict:
    """The settings ``recipe`` (``towers.nn.models.Recipe``) gives a run of ``cfg`` (not resolved) on ``towers``
    towers: those the user left unset, whole groups at a time.

    The schedule comes whole or not at all (a schedule setting given, or ``staircase``, keeps the
    recipe's out); so does the step count (``steps`` or ``epochs`` given) and the warm-up (``warmup_steps``
    other than 0, or given in ``explicit``, the settings the caller named: ``--warmup-steps 0`` is no warm-up).  ``batch_size`` is the recipe's own or its global batch's share per tower; ``lr`` the
    recipe's, or ``lr_per_256`` x the examples of a step / 256 (with the batch the run will use).  Another
    optimizer than the recipe's takes none of the recipe's learning rate and hyperparameters.
    """
    given = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) is not None}
    out = dict(recipe.settings)
    if recipe.global_batch:
        out["batch_size"] = max(1, round(recipe.global_batch / towers))
    if given & set(_SCHEDULE) or cfg.staircase:
        for k in _SCHEDULE:
            out.pop(k, None)
    if {"steps", "epochs"} & given:
        out.pop("epochs", None)
    if cfg.warmup_steps or "warmup_steps" in explicit:
        out.pop("warmup_epochs", None)
    if cfg.optimizer not in (None, out.get("optimizer")):
        for k in ("lr", *optimizer_settings()):
            out.pop(k, None)
    out = {k: v for k, v in out.items() if k not in given}
    if recipe.lr_per_256 and cfg.lr is None and cfg.optimizer in (None, recipe.settings.get("optimizer")):
        batch = cfg.batch_size or out.get("batch_size") or FALLBACK["batch_size"]
        out["lr"] = recipe.lr_per_256 * batch * cfg.accumulate * towers / 256
    return out


def _schedule_defaults(cfg: Config, defaults: dict) -> dict:
    """The schedule settings to fill: explicit ones win, the model's apply only to its own schedule.

    Giving ``lr_boundaries`` or ``lr_values`` implies ``piecewise``; a piecewise
    schedule without boundaries takes the model's; ``lr_values`` sets ``lr`` (its
    first value); ``lr_decay``, ``decay_steps`` and ``staircase`` belong to ``exponential``.
    """
    filled = {}
    kind = cfg.lr_schedule or ("piecewise" if cfg.lr_boundaries or cfg.lr_values or cfg.lr_epochs
                               else defaults.get("lr_schedule", "exponential"))
    filled["lr_schedule"] = kind
    if kind != "piecewise" and (cfg.lr_boundaries or cfg.lr_values or cfg.lr_epochs):
        raise UserError(f"`lr_boundaries`, `lr_epochs` and `lr_values` belong to `lr_schedule` piecewise, not {kind}")
    if cfg.lr_boundaries and cfg.lr_epochs:
        raise UserError(f"`lr_boundaries` {cfg.lr_boundaries} (steps) and `lr_epochs` {cfg.lr_epochs} are both "
                        "given: give one of them")
    if kind == "piecewise" and cfg.lr_boundaries is None and not cfg.lr_epochs and defaults.get("lr_boundaries"):
        filled["lr_boundaries"] = defaults["lr_boundaries"]
    if cfg.lr_values:
        first = parse_list(cfg.lr_values, "lr_values")[0]
        if cfg.lr is None:
            filled["lr"] = first
        elif first != cfg.lr:
            raise UserError(f"`lr` {cfg.lr:g} and `lr_values` {cfg.lr_values} disagree: `lr_values` gives every "
                            "rate, its first is the initial one; give one of them")
    if kind != "exponential":
        if cfg.lr_decay not in (None, 1, 1.0) or cfg.staircase or cfg.decay_steps is not None:
            raise UserError(f"`lr_decay`, `decay_steps` and `staircase` are exponential decay's; `lr_schedule` "
                            f"{kind} replaces it")
        filled["lr_decay"] = 1.0
    return filled


def _check(cfg: Config) -> None:
    """Settings that need no data: fail before anything is allocated.

    Each field's own check is declared with it (``towers.settings``); here are
    the rules between settings, and the fields whose messages are their own.
    """
    check_fields(cfg, late=False)
    if cfg.steps is not None and cfg.epochs is not None:
        raise UserError(f"`steps` {cfg.steps} and `epochs` {cfg.epochs} are both given: give one of them (`epochs` "
                        "sets the step count from the training set's size and the examples of a step)")
    MODES[cfg.sync].check(cfg.sync, cfg)
    _check_precision(cfg)
    _check_graphs(cfg)
    if cfg.hosts == 1 and cfg.ray_address is not None:
        raise UserError("`ray_address` joins a Ray cluster for several hosts: set `hosts` 2 or more, or drop it")
    if cfg.warmup_steps and cfg.warmup_epochs is not None:
        raise UserError(f"`warmup_steps` {cfg.warmup_steps} and `warmup_epochs` {cfg.warmup_epochs:g} are both "
                        "given: give one of them")
    if cfg.hosts > 1 and (cfg.augment not in (None, "none") or cfg.normalize is not None or cfg.image_size is not None):
        raise UserError("`augment`, `normalize` and `image_size` are for one host so far (the hosts' loader does "
                        "not take them): drop them, or set `hosts` 1")
    if cfg.augment == "tf-cifar10" and cfg.normalize is not None:
        raise UserError("`augment` tf-cifar10 standardizes each image itself (mean 0, std 1); `normalize` would "
                        "scale it again (mean -2, std 0.016): drop `normalize`")
    if not isinstance(cfg.data, str) or not cfg.data:
        raise UserError(f"`data` must name a file, got {cfg.data!r}")
    if cfg.resume and not cfg.logdir:
        raise UserError("`resume` needs `logdir`: the directory of the run to continue")
    if not isinstance(cfg.model, str):
        raise UserError(f"`model` is a name such as mlp, lenet5 or package.module:function, "
                        f"got {type(cfg.model).__name__}: hand a model object to Trainer(model=...)")


def _check_precision(cfg: Config) -> None:
    """What ``precision`` and ``allreduce_dtype`` are made for so far: refused elsewhere, not run wrong."""
    if cfg.precision != "fp16" and cfg.loss_scale_growth != 2000:
        raise UserError(f"`loss_scale_growth` applies to `precision` fp16 (its loss scaling), not {cfg.precision}: "
                        "set `precision` fp16, or drop `loss_scale_growth`")
    if cfg.precision == "fp16" and cfg.sync != "grads":
        raise UserError(f"`precision` fp16 scales the loss and skips a step all replicas agree on after the "
                        f"gradients' all-reduce: `sync` grads only, not {cfg.sync} (or use `precision` bf16, "
                        "which needs no loss scaling)")
    if cfg.precision == "fp16" and cfg.hosts > 1:
        raise UserError("`precision` fp16 (loss scaling) is for one host so far: set `hosts` 1, or use "
                        "`precision` bf16")
    if cfg.allreduce_dtype != "fp32" and cfg.sync != "grads":
        raise UserError(f"`allreduce_dtype` {cfg.allreduce_dtype} rounds the gradients before their all-reduce: "
                        f"`sync` grads only (`sync` {cfg.sync} averages weights or pushes gradients to a server)")


def _check_graphs(cfg: Config) -> None:
    """What ``cuda_graphs`` cannot capture, refused before anything is built (dropout: by the model, when built)."""
    if not cfg.cuda_graphs:
        return
    for given, why in ((cfg.accumulate > 1, f"`accumulate` {cfg.accumulate} stages each micro-batch from the host "
                                            "inside the step"),
                       (cfg.sync_bn, "`sync_bn` meets the other towers at host barriers inside forward and backward"),
                       (cfg.allreduce_bucket_mib > 0, "`allreduce_bucket_mib` averages gradients on a second stream "
                                                      "during backward")):
        if given:
            raise UserError(f"`cuda_graphs` replays each GPU tower's forward and backward as one captured graph, "
                            f"but {why}: drop one of them")


def _check_optimization(cfg: Config) -> None:
    """Numeric settings, once the model's defaults are filled in, and the optimizer's rules."""
    check_fields(cfg, late=True)
    check_optimizer_settings(cfg)
    if cfg.lr_schedule == "piecewise":
        piecewise_values(cfg)
    k = MODES[cfg.sync].period(cfg)
    if cfg.checkpoint_every % k:
        raise UserError(
            f"with `sync` {cfg.sync}, `checkpoint_every` ({cfg.checkpoint_every}) must be a multiple of "
            f"`average_every` ({k}): a checkpoint holds the weights right after an average"
        )


def steps_of_epochs(cfg: Config, n_examples: int, examples_per_step: int) -> Config:
    """``cfg`` (resolved) with ``steps`` derived from ``epochs`` when that is given; else ``cfg`` itself.

    ``steps = ceil(epochs * n_examples / examples_per_step)``: the training
    stream runs through one shuffle per epoch without a break (a batch that
    crosses an epoch's end continues into the next one's,
    ``towers.data.batches``), so after these steps every example was seen
    ``epochs`` times, and the last step took fewer than ``examples_per_step``
    examples of epoch ``epochs + 1``; no step is short.  ``examples_per_step``
    is the examples behind one update (towers x ``batch_size`` x
    ``accumulate``, every host's; one host's with async), the count the
    learning-rate schedule's epochs are made of.  The executor calls it before
    it builds the schedule (``cosine`` ends at these steps); a resumed run
    takes the total of its own global batch.  The result holds both settings,
    as the settings line and a checkpoint's ``config`` show them; a copy to
    be resolved again (a one-tower scaling run) sets ``epochs`` back to None.
    """
    if cfg.epochs is None:
        return cfg
    return dataclasses.replace(cfg, steps=-(-cfg.epochs * n_examples // examples_per_step))


# Settings filled from the model's (its optimizer's) defaults when left as None; else their fallback.
MODEL_DEFAULTED = tuple(f.name for f in dataclasses.fields(Config) if f.metadata["model_default"])
FALLBACK = {f.name: f.metadata["fallback"] for f in dataclasses.fields(Config)}
_USED_WHEN = {f.name: f.metadata["used_when"] for f in dataclasses.fields(Config)}
FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}


def in_use(cfg, name: str) -> bool:
    """Whether the run ``cfg`` (its model and optimizer known) uses the setting ``name`` (``used_when``)."""
    used = _USED_WHEN[name]
    return used is None or bool(used(cfg))


def checkpoint_settings(saved: dict) -> dict:
    """A checkpoint's settings with every field present, for comparing with a run's (``towers.settings``).

    A checkpoint written before a setting existed ran with its default: the
    checkpoint's settings, resolved as this version resolves them, fill it in.
    Data paths are compared as the checkpoint stores them (absolute).
    """
    names = {f.name for f in dataclasses.fields(Config)}
    known = {k: v for k, v in saved.items() if k in names}
    full = dict(known)
    if names - set(known):
        # Checkpoints written before unused hyperparameters stayed unset hold their defaults (beta1 0.9 with
        # sgd): resolved again, they would count as given.
        probe = types.SimpleNamespace(**{f.name: known.get(f.name, f.default) for f in dataclasses.fields(Config)})
        given = {k: v for k, v in known.items() if in_use(probe, k)}
        if given.get("steps") is not None:  # the total the run's `epochs` gave (``steps_of_epochs``)
            given.pop("epochs", None)
        try:
            filled = dataclasses.asdict(Config(**{**given, "resume": False}).resolved())
        except (UserError, TypeError, ValueError):
            filled = {f.name: f.default for f in dataclasses.fields(Config)}
        full.update({k: v for k, v in filled.items() if k not in known})
    return full


# What a resumed run never takes from its checkpoint: where the run is, that it resumes, and what belongs to
# this launch rather than to the run (what it prints, where its Ray cluster is: an old address may be gone).
OWN = ("logdir", "resume", "quiet", "profile", "measure_scaling", "log_placement", "ray_address")


def resume_settings(cfg: Config, saved: dict) -> Config:
    """The settings of ``cfg`` (not resolved) resuming from a checkpoint whose settings are ``saved``.

    What ``cfg`` gave explicitly (``Config.given``) stays; every other setting
    is the checkpoint's (``towers.settings.inherited``: except those derived
    from a setting given another value), so a resume that gives nothing
    continues the run as it was: its model, data, augmentation, towers,
    batch, optimizer and schedule, and its own length.  The length is
    ``steps`` or ``epochs``, whichever the run had (its ``steps`` with
    ``epochs`` are the ones its epochs gave); either one given replaces it.
    A setting the resumed run does not use (``used_when``; a hyperparameter
    of another optimizer) keeps its default.
    """
    old = checkpoint_settings(saved)
    given = set(cfg.given) | set(OWN)
    if given & {"steps", "epochs"}:
        given |= {"steps", "epochs"}
    taken = inherited(Config, old, cfg, given)
    if old.get("epochs") is not None:
        taken.pop("steps", None)  # what its epochs give, counted with this run's batch
    merged = dataclasses.replace(cfg, **taken)
    unused = {k: FIELD_DEFAULTS[k] for k in taken if not in_use(merged, k)}
    merged = dataclasses.replace(merged, **unused) if unused else merged
    merged.__dict__["_given"] = frozenset(given)
    return merged
