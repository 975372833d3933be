"""The command line: ``python -m towers.train`` (``towers-train`` when installed).

A thin layer over the library: flags become a ``towers.Config`` (one flag per
field), ``towers.Trainer(cfg).fit()`` trains, and errors become one line on
stderr with exit status 2 (a user mistake) or 1 (a run that cannot go on).
Library messages name settings; inside ``flags_in_messages`` they show as flags.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from towers.cli import Parser, run_main, show_notices, warn_about
from towers.config import Config
from towers.errors import flag, flags_in_messages
from towers.output.files import sigterm_raises
from towers.trainer import Trainer

# --help text, one flag a line: the Config field, then its help.
HELP = dict(line.split(None, 1) for line in """
n_gpu             number of towers (default 1, or one per --devices entry)
devices           'cpu', or GPU ids such as 0,2
soft_placement    fail instead of bending an impossible placement (by default: no GPU runs on the CPU, too few GPUs are shared)
log_placement     print which device runs each tower, the EMA, input parsing and the reducer
data              training data: .npz with x, y and optionally x_test, y_test; TFRecord files ('train-*-of-*'); or an image folder DIR/<class>/*.jpg|jpeg|png
test_data         separate test data (.npz, TFRecord or image folder); default: x_test/y_test of --data
x_key             npz key or TFRecord feature of the examples
y_key             npz key or TFRecord feature of the labels
decode            TFRecord: NAME:DTYPE[:SHAPE] reads the examples' bytes (or float) feature, e.g. image_raw:uint8:28,28; NAME:image:H,W,C decodes encoded images (JPEG, PNG), e.g. image/encoded:image:224,224,3
on_error          TFRecord: stop at a damaged record, or 'skip' records whose payload CRC fails (counted)
input_workers     TFRecord and images: processes that read, parse, decode and augment ahead of the towers (0: the input thread; default: one per spare core, at most 4)
image_size        images: H,W,C of the examples (resized and center-cropped to it); default: --decode's, or the folder's images' own when all alike
augment           images: none, cifar (pad 4, random crop, flip), tf-cifar10 (TF tutorial: 24x24 crop, flip, brightness, contrast, standardization), imagenet (random resized crop, flip); evaluation takes the center
normalize         images: MEAN,STD per channel on the 0..1 scale, e.g. 0.5,0.25 or 0.485,0.456,0.406,0.229,0.224,0.225 (examples become float32)
model             mlp, lenet5, cifar10 (TF's CIFAR-10 tutorial model), resnet20, resnet32, resnet56 (He et al.), or package.module:function returning a towers.Sequential (or a list of layers)
hidden            hidden units of the mlp
batch_size        examples per tower per step
steps             training steps
optimizer         sgd or adam (default: the model's; mlp, cifar10, resnets: sgd, lenet5: adam)
lr                initial learning rate (default: the model's for its optimizer; mlp sgd 0.8, cifar10 and resnets 0.1, adam 0.001)
lr_decay          learning-rate decay per epoch (TF exponential_decay; default: the model's, 0.99 for sgd, 1 for adam)
staircase         decay the learning rate once per whole epoch
momentum          SGD momentum (default: the model's; 0: plain SGD; resnets 0.9)
beta1             Adam's first-moment decay (TF default 0.9)
beta2             Adam's second-moment decay (TF default 0.999)
epsilon           Adam's epsilon (TF default 1e-8)
l2                L2 regularization scale on weights, not biases or batch-norm parameters (default: the model's, 1e-4; cifar10 0.004)
ema_decay         EMA decay (TF ExponentialMovingAverage)
seed              seed of weights, shuffling and dropout masks
nesterov          Nesterov momentum (TF use_nesterov; needs sgd with --momentum > 0)
lr_schedule       exponential (decay per epoch, the default), piecewise (constant between --lr-boundaries) or cosine (to 0 at --steps); default: the model's (resnets: piecewise)
lr_boundaries     piecewise: steps where the learning rate changes, e.g. 32000,48000 (resnets' default)
lr_values         piecewise: the learning rates, one more than boundaries, e.g. 0.1,0.01,0.001 (default: --lr divided by 10 at each boundary)
warmup_steps      linear warm-up: the learning rate grows from lr/N to lr over the first N steps (0: none)
label_smoothing   train on targets (1 - S) * onehot + S / classes (0: none)
sync_bn           batch norm normalizes with the whole step's batch across towers (two small all-reduces per batch-norm layer), not each tower's own
sync              grads: average gradients every step; weights: each tower steps alone, weights averaged every K; with --hosts > 1 also ps (synchronous parameter server) or async (asynchronous parameter server)
average_every     K: steps between weight averages with --sync weights
hosts             hosts (Ray actors), each running --n-gpu towers; > 1 starts or joins Ray (see --ray-address)
ray_address       join this Ray cluster ('auto' or HOST:PORT of `ray start --head`); default: a local Ray instance
ray_logs          show Ray's own log lines (hidden by default)
check_replicas    compare every replica with the first every K steps (0: only at the end)
log_every         steps between log lines
logdir            output directory (default runs/<timestamp>)
quiet             no progress bar and no per-step log lines
checkpoint_every  steps between checkpoints (ckpt-<step>.npz in --logdir; default 1000, rounded up to a multiple of --average-every); one is always written at the end; 0: only then
keep_checkpoints  how many of the newest checkpoints to keep
resume            continue from the latest valid checkpoint in --logdir (--steps is the total, not more steps)
summary_every     steps between TensorBoard summaries (scalars, weight and gradient histograms; a host sync); 0: none
cpu_towers        CPU towers run 'threads' (concurrently, the default: fastest measured) or 'serial'
blas_threads      BLAS threads for the process (0: auto, 1 per concurrent CPU tower, else all cores)
profile           print a per-phase, per-tower time breakdown at the end (syncs GPU streams per phase)
measure_scaling   after the run, time 1 tower alone and print the scaling efficiency
tf32              GPU float32 matmuls (dense and convolution GEMMs) on TF32 tensor cores: faster, about 3e-4 relative error (off: plain float32)
""".strip().splitlines())


def _number(kind):
    def parse(text):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


def build_parser(prog: str = "python -m towers.train") -> argparse.ArgumentParser:
    ap = Parser(prog=prog, description="Multi-tower training with CuPy + NCCL, or NumPy on the CPU.")
    for f in fields(Config):
        if f.type == "bool" and f.default:  # on by default: the flag turns it off
            ap.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false", help=HELP[f.name])
        elif f.type == "bool":
            ap.add_argument(flag(f.name), action="store_true", help=HELP[f.name])
        else:
            kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
            ap.add_argument(flag(f.name), type=_number(kind) if kind is not str else str, default=f.default,
                            metavar=f.name.upper(), help=HELP[f.name])
    return ap


def parse_config(argv=None) -> Config:
    return Config(**vars(build_parser().parse_args(argv)))


def run(cfg: Config) -> dict:
    """Train as ``cfg`` says; return the final metrics (the command line's whole job)."""
    show_notices()
    with Trainer(cfg) as trainer:  # Ray is imported only for `hosts` > 1: one host never pays for it
        warn_about(trainer.dataset, "towers.train")
        if trainer.cfg.log_placement:
            print(trainer.executor.placement_text(), flush=True)
        return trainer.fit()


def main(argv=None) -> int:
    with flags_in_messages():
        return _main(argv)


def _main(argv) -> int:
    cfg = parse_config(argv)
    def body():
        with sigterm_raises():  # SIGTERM ends the run like Ctrl-C: writers clean up, one line, status 143
            run(cfg)

    return run_main("towers.train", body, terminated="terminated (SIGTERM); the last checkpoint is kept")


if __name__ == "__main__":
    sys.exit(main())
