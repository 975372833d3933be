"""Per-example transforms: decode, the named augmentations, normalization; random draws per example.

A :class:`Transform` turns one example (encoded bytes, or a uint8 (H, W, C)
array) into the array the towers get.  It runs in the input workers
(``towers.data.workers``), one example at a time, so it is plain NumPy,
Pillow and OpenCV on small arrays.

**Random draws.**  Every random number of an example comes from
:func:`uniforms`, a counter-based hash (splitmix64) of (seed, epoch, example
index, draw number): no generator state travels between examples, so the
result does not depend on which worker, in which order, or how many workers
handle the example, and a resumed run (the checkpoint keeps seed and
position) redraws exactly what the first run drew.

**Augmentations** (``--augment``), for training; evaluation and conversion
always take the deterministic path (``train=False``):

============  ===================================================  ==============================
name          training                                             evaluation
============  ===================================================  ==============================
none          resize the shorter side, center crop to H x W        the same
cifar         (He et al. 2016) zero-pad 4, random H x W crop,       H x W as ``none``
              horizontal flip with p = 1/2
tf-cifar10    (TensorFlow's multi-GPU CIFAR-10 tutorial) random     center 24 x 24 crop,
              24 x 24 crop, flip, brightness +-63, contrast          per-image standardization
              0.2-1.8, per-image standardization (float32)
imagenet      random resized crop (area 0.08-1, aspect 3/4-4/3,    resize the shorter side to
              10 tries, else the center crop), resized to H x W,    H / 0.875, center H x W crop
              flip
============  ===================================================  ==============================

All of them work on uint8 and hand uint8 on, so batches cross to the devices
4x smaller and are scaled there, except ``tf-cifar10`` (its brightness,
contrast and standardization are float by definition) and ``normalize``
(``(x / 255 - mean) / std`` per channel; ``(x - mean) / std`` with `input_scale` 1), which give float32.

Limits: ``imagenet`` resizes from the encoded image (DCT-scaled for JPEG), so
an array source is cropped from its stored pixels; ``tf-cifar10`` needs H and
W of at least 24.
"""
from __future__ import annotations

import math

import numpy as np

from towers.data.dataset import input_scale
from towers.data.image import codec
from towers.errors import UserError

AUGMENTS = ("none", "cifar", "tf-cifar10", "imagenet")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
IMAGENET_EVAL_RATIO = 0.875  # resize to 256, crop 224
TF_CIFAR_CROP = 24


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniforms(seed: int, epochs, indices, k: int) -> np.ndarray:
    """(n, k) float64 uniforms in [0, 1), a pure function of (seed, epoch, index, draw number)."""
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(seed) * _GOLDEN + _GOLDEN)
        key = _mix(key ^ (np.asarray(epochs, np.uint64) * _GOLDEN))
        key = _mix(key ^ (np.asarray(indices, np.uint64) + _GOLDEN))
        draws = _mix(key[:, None] + (np.arange(1, k + 1, dtype=np.uint64) * _GOLDEN)[None, :])
    return (draws >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def parse_image_size(text, setting="image_size") -> tuple[int, int, int]:
    """``H,W,C`` (C 1 or 3) -> (H, W, C); a UserError naming ``setting`` otherwise."""
    try:
        h, w, c = (int(v) for v in str(text).split(","))
    except ValueError:
        raise UserError(f"`{setting}` {text!r}: expected H,W,C such as 224,224,3") from None
    if h < 1 or w < 1 or c not in (1, 3):
        raise UserError(f"`{setting}` {text!r}: H and W must be >= 1 and C 1 (grey) or 3 (RGB)")
    return h, w, c


def parse_normalize(text, channels: int):
    """``MEAN,STD`` or ``M1,M2,M3,S1,S2,S3`` (on the pixels' scale: `input_scale`'s, 0..1 by default) -> (mean,
    std) float32 per channel."""
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if len(values) not in (2, 2 * channels) or not all(map(math.isfinite, values)) or \
            min(values[len(values) // 2:]) <= 0:
        raise UserError(f"`normalize` {text!r}: give MEAN,STD (or {channels} means then {channels} stds) on the "
                        "pixels' scale (0..1; 0..255 with `input_scale` 1), std > 0, e.g. 0.5,0.25 or "
                        "0.485,0.456,0.406,0.229,0.224,0.225")
    half = len(values) // 2
    mean, std = np.float32(values[:half]), np.float32(values[half:])
    return np.broadcast_to(mean, (channels,)).copy(), np.broadcast_to(std, (channels,)).copy()


def transformed_dtype(augment: str, normalized: bool) -> np.dtype:
    """What a transform hands the towers: uint8 pixels, or float32 once ``normalize`` or ``tf-cifar10``'s
    standardization has scaled them (``Transform.dtype``; ``towers.inference`` reads a run's from its settings)."""
    return np.dtype(np.float32 if normalized or augment == "tf-cifar10" else np.uint8)


class Transform:
    """One example -> the towers' array: ``decode`` (H, W, C of the decoded image), ``augment``, ``normalize``.

    ``encoded``: examples are image bytes (else uint8 (H, W, C) arrays);
    ``scale``: the `input_scale` setting, what ``normalize`` multiplies the
    pixels by first.  ``shape``/``dtype``: what ``__call__`` returns.
    Picklable: it travels to the workers once.
    """

    def __init__(self, size, augment="none", normalize=None, seed=0, encoded=True, scale="1/255"):
        if augment not in AUGMENTS:
            raise UserError(f"`augment` {augment!r} is unknown: use one of {', '.join(AUGMENTS)}")
        self.size, self.augment, self.seed, self.encoded = tuple(size), augment, int(seed), encoded
        h, w, c = self.size
        if augment == "tf-cifar10" and min(h, w) < TF_CIFAR_CROP:
            raise UserError(f"`augment` tf-cifar10 crops 24 x 24 but the images are {h} x {w}")
        self.norm = parse_normalize(normalize, c) if normalize else None
        self.scale = input_scale(np.uint8, scale)
        self.shape = (TF_CIFAR_CROP, TF_CIFAR_CROP, c) if augment == "tf-cifar10" else (h, w, c)
        self.dtype = transformed_dtype(augment, self.norm is not None)
        self.draws = {"none": 0, "cifar": 3, "tf-cifar10": 5, "imagenet": 41}[augment]

    def __call__(self, example, u=None) -> np.ndarray:
        """The transformed example; ``u``: its uniforms (``uniforms``, ``self.draws`` of them) when training."""
        h, w, c = self.size
        train = u is not None and self.draws
        if self.augment == "imagenet":
            image = self._imagenet(example, u) if train else self._fitted(example, IMAGENET_EVAL_RATIO)
        else:
            image = self._fitted(example)
            if train and self.augment == "cifar":
                image = _crop_flip(image, h, w, u, pad=4)
            elif self.augment == "tf-cifar10":
                image = _tf_cifar10(image, u if train else None)
        if self.norm is not None:
            image = (image.astype(np.float32) * self.scale - self.norm[0]) / self.norm[1]
        return image

    def _fitted(self, example, ratio=1.0) -> np.ndarray:
        """The whole image resized (shorter side) and center-cropped to H x W (``ratio``: tighter)."""
        h, w, c = self.size
        if not self.encoded:
            return codec.fit(example, h, w, ratio)
        # A JPEG may decode at a DCT scale: any that keeps both sides >= the target's covers the resize.
        return codec.fit(codec.decode(example, c, (math.ceil(h / ratio), math.ceil(w / ratio))), h, w, ratio)

    def _imagenet(self, example, u) -> np.ndarray:
        h, w, c = self.size
        if self.encoded:
            ih, iw, _ = codec.size(example)
        else:
            ih, iw = example.shape[:2]
        top, left, ch, cw = random_resized_crop(ih, iw, u)
        if not self.encoded:
            image, k = example, 1.0
        else:  # decode at the smallest DCT scale that keeps the crop at least H x W
            image = codec.decode(example, c, (math.ceil(ih * h / ch), math.ceil(iw * w / cw)))
            k = image.shape[0] / ih
        # Clipped to the decoded image: a DCT-scaled decode rounds each side up on its own (17 x 23 at 1/2 is
        # 9 x 12, so k = 9/17 overshoots the width), and (top + ch) * k may land an ulp past the edge.
        box = (top * k, left * k, min((top + ch) * k, image.shape[0]), min((left + cw) * k, image.shape[1]))
        return codec.crop_resize(image, h, w, box, flip=u[40] < 0.5)


def random_resized_crop(h: int, w: int, u) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a crop of area 0.08-1 of the image's and aspect ratio 3/4-4/3 (log-
    uniform), placed uniformly; 10 tries with 4 draws each (``u[0:40]``), then the center crop with the
    aspect clamped to that range (the torchvision / Inception recipe)."""
    area = h * w
    log_lo, log_hi = math.log(3 / 4), math.log(4 / 3)
    for t in range(10):
        target = area * (0.08 + 0.92 * u[4 * t])
        ratio = math.exp(log_lo + (log_hi - log_lo) * u[4 * t + 1])
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            return int(u[4 * t + 2] * (h - ch + 1)), int(u[4 * t + 3] * (w - cw + 1)), ch, cw
    ratio = w / h
    if ratio < 3 / 4:
        cw, ch = w, round(w / (3 / 4))
    elif ratio > 4 / 3:
        ch, cw = h, round(h * (4 / 3))
    else:
        cw, ch = w, h
    ch, cw = min(ch, h), min(cw, w)
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def _crop_flip(image: np.ndarray, h: int, w: int, u, pad: int = 0) -> np.ndarray:
    """A random h x w crop (offsets from ``u[0]``, ``u[1]``) of ``image`` with ``pad`` zero pixels around it,
    flipped when ``u[2]`` < 1/2.  (The padding is never built: the crop's part inside the image is copied
    into zeros, about 10x cheaper than ``numpy.pad`` on a 32 x 32 image.)"""
    ih, iw = image.shape[:2]
    top = int(u[0] * (ih + 2 * pad - h + 1)) - pad  # in the image's coordinates
    left = int(u[1] * (iw + 2 * pad - w + 1)) - pad
    if pad:
        out = np.zeros((h, w, image.shape[2]), image.dtype)
        y0, y1, x0, x1 = max(top, 0), min(top + h, ih), max(left, 0), min(left + w, iw)
        out[y0 - top:y1 - top, x0 - left:x1 - left] = image[y0:y1, x0:x1]
    else:
        out = image[top:top + h, left:left + w]
    return out[:, ::-1] if u[2] < 0.5 else out


def _tf_cifar10(image: np.ndarray, u) -> np.ndarray:
    """The tutorial's ``distorted_inputs`` (``u`` given) or ``inputs`` (center crop), then
    ``per_image_standardization``: (x - mean) / max(std, 1 / sqrt(pixels)), in float32."""
    n = TF_CIFAR_CROP
    if u is None:
        top, left = (image.shape[0] - n) // 2, (image.shape[1] - n) // 2
        x = image[top:top + n, left:left + n].astype(np.float32)
    else:
        x = _crop_flip(image, n, n, u).astype(np.float32)
        x += np.float32((2 * u[3] - 1) * 63)  # random_brightness(max_delta=63), on 0..255 floats
        mean = x.mean(axis=(0, 1), keepdims=True, dtype=np.float32)
        x = (x - mean) * np.float32(0.2 + 1.6 * u[4]) + mean  # random_contrast(0.2, 1.8), per channel
    mean, std = x.mean(dtype=np.float32), x.std(dtype=np.float32)
    return (x - mean) / max(std, np.float32(1 / math.sqrt(x.size)))
