"""Every setting of a run (``Config``), its validation, and the model's defaults.

``Config`` is plain data: the command line builds one from flags, a Python user
writes one.  ``Config.resolved()`` checks every setting that needs no data and
fills the ones left unset (``None``) from the model's defaults
(``towers.nn.models``); the ``Trainer`` calls it before anything is allocated,
so a bad setting is a ``UserError`` naming it, whatever the caller.

Defaults, in order: what the user set; else the model's settings for the chosen
optimizer (``--model lenet5`` trains with Adam; ``--optimizer adam`` with no
``--lr`` gets Adam's own learning rate); else the generic ones.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

from towers.data.image.augment import AUGMENTS, parse_image_size, parse_normalize
from towers.errors import UserError
from towers.nn.models import model_defaults
from towers.optim.optimizers import OPTIMIZERS
from towers.optim.schedule import SCHEDULES, parse_list, piecewise_values
from towers.parallel.sync import MODES



def _default_data() -> str:
    """The embedded digits data: ``data/`` of a checkout, installed as ``towers/_data``."""
    here = Path(__file__).resolve().parent
    installed = here / "_data" / "digits.npz"
    return str(installed if installed.exists() else here.parent / "data" / "digits.npz")


DEFAULT_DATA = _default_data()
# `model` of a run whose model was an object handed to the Trainer (checkpoints, the settings line).
MODEL_OBJECT = "<model object>"
# Settings filled from the model's defaults when left as None.
MODEL_DEFAULTED = ("lr", "lr_decay", "momentum", "l2")


@dataclass
class Config:
    """Every setting of a run, with its default (the command-line flags mirror these)."""

    # placement
    n_gpu: int | None = None  # towers per host (GPU or CPU); None: 1, or one per `devices` entry
    devices: str | None = None  # "cpu" or "0,2"
    soft_placement: bool = True
    log_placement: bool = False
    # data
    data: str = DEFAULT_DATA
    test_data: str | None = None
    x_key: str = "x"
    y_key: str = "y"
    decode: str | None = None  # TFRecord: NAME:DTYPE[:SHAPE] of the examples' bytes feature
    on_error: str = "stop"  # TFRecord: "skip" leaves out records whose payload CRC fails
    input_workers: int | None = None  # TFRecord: parse worker processes (0: the input thread; None: spare cores)
    # images (towers.data.image): image folders, encoded images (`decode` NAME:image:H,W,C), augmentation
    image_size: str | None = None  # H,W,C of the examples; None: `decode`'s, or the images' own when all alike
    augment: str = "none"  # none, cifar, tf-cifar10 or imagenet (training only; evaluation takes the center)
    normalize: str | None = None  # MEAN,STD (or per channel) on the 0..1 scale: examples become float32
    # model
    model: str = "mlp"
    hidden: int = 500
    # optimization; None: the model's default (towers.nn.models)
    optimizer: str | None = None  # sgd or adam
    batch_size: int = 100  # per tower
    steps: int = 2000
    lr: float | None = None
    lr_decay: float | None = None  # per epoch
    staircase: bool = False
    momentum: float | None = None
    beta1: float = 0.9  # Adam, TensorFlow's defaults
    beta2: float = 0.999
    epsilon: float = 1e-8
    l2: float | None = None  # None: the model's (1e-4; cifar10 0.004)
    ema_decay: float = 0.99
    seed: int = 0
    # models' recipes (towers.nn, towers.optim.schedule)
    nesterov: bool = False  # Nesterov momentum (sgd with momentum)
    lr_schedule: str | None = None  # exponential, piecewise or cosine; None: piecewise if lr_boundaries, else the model's
    lr_boundaries: str | None = None  # piecewise: steps where the rate changes, "32000,48000"; None: the model's
    lr_values: str | None = None  # piecewise: one rate more than boundaries; None: lr divided by 10 at each
    warmup_steps: int = 0  # linear warm-up of the learning rate over the first steps
    label_smoothing: float = 0.0  # training targets (1 - s) * onehot + s / classes
    sync_bn: bool = False  # batch norm with the global batch's statistics (averaged across towers in the step)
    # keeping replicas together
    sync: str = "grads"  # or "weights"; with hosts > 1 also "ps" or "async"
    average_every: int = 1  # K, with sync="weights"
    check_replicas: int = 0  # every K steps; 0: only at the end
    # several hosts (towers.cluster, Ray)
    hosts: int = 1  # host actors, each with `n_gpu` towers
    ray_address: str | None = None  # None: a local Ray instance; "auto" or HOST:PORT: join a cluster
    ray_logs: bool = False  # show Ray's own log lines
    # output
    log_every: int = 100
    logdir: str | None = None  # default runs/<timestamp>
    quiet: bool = False
    # checkpoints and summaries
    checkpoint_every: int | None = None  # None: 1000, rounded up to a multiple of average_every
    keep_checkpoints: int = 5
    resume: bool = False
    summary_every: int = 100
    # performance
    cpu_towers: str = "threads"  # CPU towers concurrently ("threads") or one after another ("serial")
    blas_threads: int = 0  # 0: auto (one per concurrent CPU tower, else every core)
    profile: bool = False
    measure_scaling: bool = False  # time 1 tower after the run, for the scaling efficiency
    tf32: bool = False  # GPU float32 matmuls on TF32 tensor cores (faster convolutions, ~3e-4 relative error)

    def resolved(self, model=None) -> "Config":
        """A copy with every unset setting filled in, after checking every setting.

        ``model`` is the model object handed to the ``Trainer`` (it then gets
        the generic defaults, not those of ``self.model``).
        """
        if not isinstance(self, Config):
            raise UserError(f"settings must be a towers.Config, got {type(self).__name__}")
        cfg = dataclasses.replace(self)  # the checks turn NumPy scalars into Python numbers in the copy
        _check(cfg)
        spec = cfg.model if model is None else None
        optimizer, defaults = model_defaults(spec, cfg.optimizer)
        filled = _schedule_defaults(cfg, defaults)
        filled.update({k: defaults[k] for k in MODEL_DEFAULTED if getattr(cfg, k) is None and k not in filled})
        if cfg.checkpoint_every is None:  # a checkpoint holds weights right after an average
            k = cfg.average_every if cfg.sync == "weights" else 1
            filled["checkpoint_every"] = -(-1000 // k) * k
        if model is not None:  # record what was trained, not the `model` setting it replaced
            filled["model"] = MODEL_OBJECT
        cfg = dataclasses.replace(cfg, optimizer=optimizer, **filled)
        _check_optimization(cfg)
        return cfg



def _schedule_defaults(cfg: Config, defaults: dict) -> dict:
    """The schedule settings to fill: explicit ones win, the model's apply only to its own schedule.

    Giving ``lr_boundaries`` or ``lr_values`` implies ``piecewise``; a piecewise
    schedule without boundaries takes the model's; ``lr_values`` sets ``lr`` (its
    first value); ``lr_decay`` and ``staircase`` belong to ``exponential``.
    """
    filled = {}
    kind = cfg.lr_schedule or ("piecewise" if cfg.lr_boundaries or cfg.lr_values
                               else defaults.get("lr_schedule", "exponential"))
    filled["lr_schedule"] = kind
    if kind != "piecewise" and (cfg.lr_boundaries or cfg.lr_values):
        raise UserError(f"`lr_boundaries` and `lr_values` belong to `lr_schedule` piecewise, not {kind}")
    if kind == "piecewise" and cfg.lr_boundaries is None and defaults.get("lr_boundaries"):
        filled["lr_boundaries"] = defaults["lr_boundaries"]
    if cfg.lr_values:
        first = parse_list(cfg.lr_values, "lr_values")[0]
        if cfg.lr is None:
            filled["lr"] = first
        elif first != cfg.lr:
            raise UserError(f"`lr` {cfg.lr:g} and `lr_values` {cfg.lr_values} disagree: `lr_values` gives every "
                            "rate, its first is the initial one; give one of them")
    if kind != "exponential":
        if cfg.lr_decay not in (None, 1, 1.0) or cfg.staircase:
            raise UserError(f"`lr_decay` and `staircase` are exponential decay's; `lr_schedule` {kind} replaces it")
        filled["lr_decay"] = 1.0
    return filled


def _check(cfg: Config) -> None:
    """Settings that need no data: fail before anything is allocated."""
    for name in ("batch_size", "steps", "log_every", "hidden", "keep_checkpoints"):
        _integer(cfg, name, minimum=1)
    for name in ("check_replicas", "summary_every", "blas_threads", "seed", "warmup_steps"):
        _integer(cfg, name, minimum=0)
    if cfg.n_gpu is not None:
        _integer(cfg, "n_gpu", minimum=1)
    if cfg.checkpoint_every is not None:
        _integer(cfg, "checkpoint_every", minimum=0)
    _choice(cfg, "sync", MODES)
    _integer(cfg, "average_every", minimum=1)
    if cfg.sync != "weights" and cfg.average_every != 1:
        raise UserError("`average_every` applies to `sync` weights; set `sync` weights or drop it")
    _integer(cfg, "hosts", minimum=1)
    if cfg.hosts == 1 and cfg.sync in ("ps", "async"):
        raise UserError(f"`sync` {cfg.sync} is a parameter server for several hosts: set `hosts` 2 or more")
    if cfg.hosts == 1 and cfg.ray_address is not None:
        raise UserError("`ray_address` joins a Ray cluster for several hosts: set `hosts` 2 or more, or drop it")
    if cfg.optimizer is not None:
        _choice(cfg, "optimizer", OPTIMIZERS)
    _choice(cfg, "cpu_towers", ("threads", "serial"))
    _choice(cfg, "on_error", ("stop", "skip"))
    if cfg.input_workers is not None:
        _integer(cfg, "input_workers", minimum=0)
    if cfg.decode is not None:
        from towers.data.tfrecord.schema import parse_decode, parse_image_decode

        if isinstance(cfg.decode, str) and parse_image_decode(cfg.decode) is None:
            parse_decode(cfg.decode)
    _choice(cfg, "augment", AUGMENTS)
    if cfg.image_size is not None:
        parse_image_size(cfg.image_size)
    if cfg.normalize is not None:
        parse_normalize(cfg.normalize, 3)  # the format; the channel count is checked with the data
    if cfg.lr_schedule is not None:
        _choice(cfg, "lr_schedule", SCHEDULES)
    if cfg.hosts > 1 and (cfg.augment != "none" or cfg.normalize is not None or cfg.image_size is not None):
        raise UserError("`augment`, `normalize` and `image_size` are for one host so far (the hosts' loader does "
                        "not take them): drop them, or set `hosts` 1")
    for name in ("soft_placement", "log_placement", "staircase", "quiet", "resume", "profile", "measure_scaling",
                 "ray_logs", "tf32", "nesterov", "sync_bn"):
        if not isinstance(getattr(cfg, name), bool):
            raise UserError(f"`{name}` must be True or False, got {getattr(cfg, name)!r}")
    for name in ("devices", "logdir", "test_data", "decode", "ray_address", "image_size", "normalize", "lr_boundaries",
                 "lr_values"):
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, str) or not v):
            raise UserError(f"`{name}` must be a non-empty string or None, got {v!r}")
    if not isinstance(cfg.data, str) or not cfg.data:
        raise UserError(f"`data` must name a file, got {cfg.data!r}")
    if cfg.resume and not cfg.logdir:
        raise UserError("`resume` needs `logdir`: the directory of the run to continue")
    if not isinstance(cfg.model, str):
        raise UserError(f"`model` is a name such as mlp, lenet5 or package.module:function, "
                        f"got {type(cfg.model).__name__}: hand a model object to Trainer(model=...)")


def _check_optimization(cfg: Config) -> None:
    """Numeric settings, once the model's defaults are filled in."""
    _number(cfg, "lr", low=0, low_open=True)
    _number(cfg, "lr_decay", low=0, high=1, low_open=True)
    _number(cfg, "momentum", low=0, high=1, high_open=True)
    _number(cfg, "beta1", low=0, high=1, high_open=True)
    _number(cfg, "beta2", low=0, high=1, high_open=True)
    _number(cfg, "epsilon", low=0, low_open=True)
    _number(cfg, "l2", low=0)
    _number(cfg, "ema_decay", low=0, high=1, high_open=True)
    _number(cfg, "label_smoothing", low=0, high=1, high_open=True)
    if cfg.momentum and cfg.optimizer != "sgd":
        raise UserError(f"`momentum` is for `optimizer` sgd, not {cfg.optimizer}; drop it")
    if cfg.nesterov and not (cfg.optimizer == "sgd" and cfg.momentum):
        raise UserError("`nesterov` is a kind of momentum: it needs `optimizer` sgd and `momentum` > 0")
    if cfg.lr_schedule == "piecewise":
        piecewise_values(cfg)
    if cfg.sync == "weights" and cfg.checkpoint_every % cfg.average_every:
        raise UserError(
            f"with `sync` weights, `checkpoint_every` ({cfg.checkpoint_every}) must be a multiple of "
            f"`average_every` ({cfg.average_every}): a checkpoint holds the weights right after an average"
        )


def _integer(cfg, name: str, minimum: int) -> None:
    v = getattr(cfg, name)
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        v = int(v)  # a NumPy integer is an integer too
        setattr(cfg, name, v)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise UserError(f"`{name}` must be an integer >= {minimum}, got {v!r}")


def _choice(cfg, name: str, choices) -> None:
    v = getattr(cfg, name)
    if v not in choices:
        raise UserError(f"`{name}` {v!r} is unknown: use one of {', '.join(choices)}")


def _number(cfg, name: str, low=None, high=None, low_open=False, high_open=False) -> None:
    v = getattr(cfg, name)
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        v = float(v)  # a NumPy float is a number too
        setattr(cfg, name, v)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and low is not None:
        ok = v > low if low_open else v >= low
    if ok and high is not None:
        ok = v < high if high_open else v <= high
    if not ok:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
        want = f"in {lo}, {hi}" if low is not None and high is not None else (
            f"{'>' if low_open else '>='} {low:g}")
        raise UserError(f"`{name}` must be a finite number {want}, got {v!r}")
