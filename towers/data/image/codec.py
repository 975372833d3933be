"""Encoded images <-> uint8 arrays: the format from the bytes, decoding, resizing, encoding.

``decode(data, channels)`` returns a uint8 (H, W, channels) array whatever the
file says it is: the format is read from the first bytes (JPEG ``FF D8 FF``,
PNG's 8-byte signature; anything else goes to Pillow, which knows GIF, BMP,
WebP, TIFF, ...), never from a name or an ``image/format`` feature.

- JPEG goes to libjpeg-turbo through simplejpeg with the integer-fast IDCT and
  fancy upsampling, TensorFlow's ``decode_jpeg`` defaults: on the TensorFlow
  2.21 samples in ``../shared/image-samples`` the pixels are identical (Pillow
  decodes with the accurate IDCT: mean difference 0.46, up to 9).  simplejpeg
  also decodes 8x faster than Pillow on 32x32 images (23 us against 184 us: no
  plugin sniffing or Image object) and 1.4x on 500x375 ones.  A JPEG simplejpeg
  refuses (CMYK/YCCK, 12-bit, arithmetic coding) goes to Pillow.
- Everything else goes to Pillow.  PNG is lossless, so its pixels equal
  TensorFlow's ``decode_png``; every chunk's CRC is checked first
  (:func:`check_png`), as libpng does for TensorFlow, so a damaged PNG is
  refused rather than decoded as if whole.

Channels: 1 is the luma (libjpeg's own grayscale output for JPEG, Pillow's
``L`` otherwise), 3 is RGB (grey replicated; CMYK converted by Pillow; alpha
dropped, as ``decode_png(channels=3)`` does).  16-bit PNGs keep their high
byte.  EXIF orientation is ignored, as TensorFlow ignores it.

``min_size`` lets a JPEG be decoded at a DCT scale (1/2, 1/4, 1/8) that still
covers it: the inverse DCT of a smaller image is most of the saving when a
large photo is cropped and shrunk to 224 pixels anyway.

Limits: an image larger than Pillow's decompression-bomb limit
(``PIL.Image.MAX_IMAGE_PIXELS``, about 89 megapixels) is refused before its
pixels are decoded (a JPEG by its header's size), as are images that decode
to nothing.  Every failure is an :class:`ImageError` whose message says what
is wrong; the callers add where the bytes came from.  Whatever a decoding
library raises on damaged bytes becomes one (:func:`_refused`): Pillow raises
its own kinds (``SyntaxError``, ``OSError``, ``ValueError``, ``EOFError``) for
the damage it expects and others (an ``IndexError`` from ``verify`` of a PNG
without IDAT) for damage it does not; only ``MemoryError`` passes through, as
the machine's failure rather than the image's.  PngSuite's 14 corrupt files
(``x*.png``) are all refused, as TensorFlow refuses them.
"""
from __future__ import annotations

import contextlib
import io
import re
import warnings

import numpy as np

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FORMATS = ("jpeg", "png")  # what ``encode`` writes


class ImageError(Exception):
    """Bytes that are no image this module can decode; the message says why."""


# Pillow's own kinds of error for damaged bytes: their text is the reason.  Any other kind is named with it.
_PILLOW_ERRORS = (SyntaxError, OSError, ValueError, EOFError)


def _reason(e: Exception) -> str:
    """Why a library refused the bytes, for a message: the exception's text, its kind named unless it is one
    of Pillow's own (``IndexError: list index out of range`` says where it failed; the text alone does not)."""
    return str(e) if isinstance(e, _PILLOW_ERRORS) and str(e) else f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def _refused(message: str):
    """Within it, an exception a library raises on damaged bytes becomes ``ImageError(message.format(reason))``.

    Every kind counts, not only Pillow's documented ones: a decoder fed damaged bytes fails wherever its
    parser does, and the run must see one "not a decodable image" line (or count a skip), not a traceback.
    An :class:`ImageError` already made, and ``MemoryError`` (the machine's failure, not the image's), pass.
    """
    try:
        yield
    except (ImageError, MemoryError):
        raise
    except Exception as e:
        raise ImageError(message.format(_reason(e))) from None


def sniff(data) -> str:
    """``jpeg``, ``png`` or ``other``, from the first bytes."""
    head = bytes(data[:8])
    if head.startswith(JPEG_MAGIC):
        return "jpeg"
    if head == PNG_MAGIC:
        return "png"
    return "other"


def _simplejpeg():
    import simplejpeg  # lazily: a data set of raw pixels never needs it

    return simplejpeg


def size(data) -> tuple[int, int, int]:
    """(height, width, channels) from the image's header, without decoding its pixels."""
    if sniff(data) == "jpeg":
        try:
            h, w, space, _ = _simplejpeg().decode_jpeg_header(data)
            return h, w, 1 if space == "Gray" else 3
        except MemoryError:
            raise
        except Exception:  # any kind: simplejpeg cannot read it; Pillow may, or names the damage
            pass
    image = _open(data)
    return image.height, image.width, 1 if image.mode in ("L", "I;16", "I", "1", "LA") else 3


def _open(data):
    from PIL import Image, UnidentifiedImageError

    with _refused("not a readable image ({})"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                return Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            if sniff(data) == "png":
                check_png(data)  # Pillow's open hides why a PNG it recognised failed: a damaged header chunk
            raise ImageError(f"not an image ({len(data)} bytes starting {bytes(data[:8]).hex()})") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            if sniff(data) == "png" and bytes(data[12:16]) == b"IHDR":  # its size, said as a JPEG's is
                width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
                _check_pixels(height, width)
            raise ImageError(f"too large to decode ({e})") from None


def _check_pixels(h: int, w: int) -> None:
    """An ImageError when an h x w image is over Pillow's decompression-bomb limit (``MAX_IMAGE_PIXELS``), the
    limit Pillow applies to everything it opens here."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and h * w > limit:
        raise ImageError(f"too large to decode ({h} x {w} = {h * w:,} pixels, over the decompression-bomb limit "
                         f"of {limit:,} pixels)")


def check_png(data) -> None:
    """An ImageError (``damaged PNG: ...``) unless the PNG ``data`` has a valid header and pixel data, and every
    chunk up to IEND matches its CRC.

    Pillow's ``verify`` walks the chunks (zlib's crc32 over each); decoding alone checks the header chunks
    only, so an IDAT whose CRC fails but whose deflate stream still inflates would pass as whole.  A header
    Pillow does not identify (a bit depth or colour type PNG does not define, a zero size) is named by its
    fields; a PNG without IDAT, which ``verify`` cannot walk (it starts at the first IDAT), is refused first.
    Cost: 13 us on a 32 x 32 PNG whose decode takes 54 us.
    """
    from PIL import PngImagePlugin

    with _refused("damaged PNG: {}"):
        try:
            image = PngImagePlugin.PngImageFile(io.BytesIO(data))  # reads the chunks up to the first IDAT
            if not image.tile:
                raise ImageError("damaged PNG: no IDAT chunk (no pixel data)")
            image.verify()
        except _PILLOW_ERRORS as e:
            reason, header = str(e), _ihdr(data)
            bad = re.fullmatch(r"broken PNG file \(bad header checksum in b'(\w+)'\)", reason)
            if bad:
                reason = f"CRC of chunk {bad.group(1)} fails"
            elif reason == "not identified by this driver" and header:  # Pillow's words for a bad IHDR
                reason = f"its header is no PNG image ({header})"
            raise ImageError(f"damaged PNG: {reason}") from None


def _ihdr(data) -> str:
    """The fields of the PNG's IHDR chunk, for a message (``32 x 32, bit depth 0, colour type 2``); "" if the
    first chunk is no whole IHDR."""
    head = bytes(data[8:33])
    if len(head) < 25 or head[4:8] != b"IHDR":
        return ""
    width, height = int.from_bytes(head[8:12], "big"), int.from_bytes(head[12:16], "big")
    return f"{width} x {height}, bit depth {head[16]}, colour type {head[17]}"


def decode(data, channels: int, min_size: tuple[int, int] | None = None) -> np.ndarray:
    """uint8 (H, W, ``channels``) pixels of the encoded image ``data`` (1 or 3 channels).

    ``min_size`` (h, w): a JPEG may come out smaller than stored, by a DCT
    scale that keeps it at least that large.
    """
    if not len(data):
        raise ImageError("empty (0 bytes)")
    if sniff(data) == "jpeg":
        h, w = min_size or (0, 0)
        try:
            _check_pixels(*_simplejpeg().decode_jpeg_header(data)[:2])
            return _simplejpeg().decode_jpeg(data, colorspace="GRAY" if channels == 1 else "RGB", fastdct=True,
                                             min_height=h, min_width=w)
        except (ImageError, MemoryError):
            raise
        except Exception:  # CMYK, 12-bit, damaged (any kind): Pillow converts what can be converted and
            pass  # names the damage
    elif sniff(data) == "png":
        check_png(data)
    image = _open(data)
    with _refused("cannot be decoded ({})"):
        if min_size and image.format == "JPEG":
            image.draft("L" if channels == 1 else "RGB", (min_size[1], min_size[0]))
        image.load()
        if image.mode.startswith("I;16"):  # 16-bit grey: keep the high byte
            image = image.point(lambda v: v / 256).convert("L")
        pixels = np.asarray(image.convert("L" if channels == 1 else "RGB"))
    if pixels.size == 0:
        raise ImageError("decodes to no pixels")
    return pixels.reshape(pixels.shape[0], pixels.shape[1], channels)


def resize(image: np.ndarray, height: int, width: int, box=None, flip: bool = False) -> np.ndarray:
    """``image`` (or its ``box`` = (top, left, bottom, right), floats allowed) resized to (height, width),
    bilinear with Pillow's antialiasing when shrinking; ``flip``: also mirrored left-right (by Pillow, which
    is 10x faster than NumPy's copy of a reversed view of interleaved channels)."""
    from PIL import Image

    c = image.shape[2]
    top, left, bottom, right = box if box is not None else (0, 0, image.shape[0], image.shape[1])
    if box is None and image.shape[:2] == (height, width) and not flip:
        return image
    out = Image.fromarray(image[:, :, 0] if c == 1 else image).resize(
        (width, height), Image.BILINEAR, box=(left, top, right, bottom))
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out).reshape(height, width, c)


_CV2 = []  # the cv2 module once imported and set to one thread


def _cv2():
    if not _CV2:
        import cv2  # lazily: only the imagenet augmentation uses it

        # One thread: each input worker is already one of several processes sharing the cores, and
        # OpenCV's pool would oversubscribe them (and start threads in every worker).
        cv2.setNumThreads(1)
        _CV2.append(cv2)
    return _CV2[0]


def crop_resize(image: np.ndarray, height: int, width: int, box, flip: bool = False) -> np.ndarray:
    """The ``box`` = (top, left, bottom, right) of ``image`` resized to (height, width), bilinear, antialiased
    when shrinking, and mirrored left-right when ``flip``: the random-resized-crop step.

    A box of whole pixels that shrinks neither side (the target is at least the box's height and width) is
    cut out and enlarged by OpenCV's ``cv2.resize`` with ``INTER_LINEAR_EXACT``: the bilinear filter of
    Pillow and torchvision (pixel centers at half-integers, two taps; antialiasing only matters when
    shrinking) in fixed point, bit-exact on every CPU, and SIMD: 0.15 ms for a 224 x 224 example where
    Pillow takes 0.7 ms with its conversions.  The box is cut out first, so the pixels past its edges
    repeat its border, as torchvision's crop-then-resize does (Pillow's ``box=`` reads past the box: up to
    10 levels apart on the outer ring of pixels, 0.25 on average).  Every other box (one that shrinks a
    side, fractional coordinates from a DCT-scaled decode) goes to :func:`resize`, whose Pillow filter
    widens with the shrink factor (antialiasing); OpenCV has no such bilinear.
    """
    top, left, bottom, right = box
    if not all(float(v).is_integer() for v in box) or bottom - top > height or right - left > width:
        return resize(image, height, width, box, flip)
    cv2 = _cv2()
    c = image.shape[2]
    crop = image[int(top):int(bottom), int(left):int(right)]
    out = cv2.resize(crop, (width, height), interpolation=cv2.INTER_LINEAR_EXACT)
    if flip:
        out = cv2.flip(out, 1)  # 0.015 ms (NumPy's copy of a reversed view of interleaved channels: 0.5 ms)
    return out.reshape(height, width, c)  # cv2 drops a single channel's axis


def center_box(h: int, w: int, height: int, width: int, ratio: float = 1.0):
    """The (top, left, bottom, right) box of an (h, w) image that, resized by the factor making its shorter
    side ``round(min side / ratio)`` of the target, gives the center (height, width) crop.

    ``ratio`` < 1 crops tighter (ImageNet's evaluation: resize to 256, center 224, ratio 0.875).
    """
    scale = max(height / h, width / w) / ratio  # output pixels per input pixel
    ch, cw = min(h, height / scale), min(w, width / scale)
    top, left = (h - ch) / 2, (w - cw) / 2
    return top, left, top + ch, left + cw


def fit(image: np.ndarray, height: int, width: int, ratio: float = 1.0) -> np.ndarray:
    """Resize so the shorter side covers (height, width) (divided by ``ratio``), then crop the center."""
    h, w = image.shape[:2]
    if (h, w) == (height, width) and ratio == 1.0:
        return image
    return resize(image, height, width, center_box(h, w, height, width, ratio))


def encode(image: np.ndarray, fmt: str, quality: int = 90) -> bytes:
    """``image`` uint8 (H, W, C) with C 1 or 3 as JPEG (baseline, 4:2:0 for colour, TensorFlow's
    ``encode_jpeg`` defaults) or PNG bytes."""
    image = np.ascontiguousarray(image, np.uint8)
    if fmt == "jpeg":
        gray = image.shape[2] == 1
        return _simplejpeg().encode_jpeg(image, quality=quality, colorspace="GRAY" if gray else "RGB",
                                         colorsubsampling="Gray" if gray else "420")
    if fmt != "png":
        raise ValueError(f"encode writes {' or '.join(FORMATS)}, not {fmt!r}")
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image).save(out, "PNG")
    return out.getvalue()
