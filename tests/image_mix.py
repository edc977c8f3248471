"""Real handwritten digits stored the ways a photo dump stores pictures, each with the picture
it shows (the pixels any viewer displays), for checking the decoder against.

The digits are scikit-learn's (written by ``imagedata.make_images``); each is saved in one of the
kinds below, cycling: 8- and 16-bit grayscale, RGB, palette, bilevel and CMYK, transparency as
an alpha channel (with leftovers under transparent pixels, as editors leave them) and as PNG's
tRNS key, JPEGs and PNGs whose EXIF orientation says how to turn the stored pixels, at several
sizes, square and not. The expected picture is computed here with numpy from the EXIF and PNG
specifications' meanings (orientation 6: turn 90 degrees clockwise to display; 8: 90 degrees
counter-clockwise; 3: 180), not with the decoder under test: transparent pixels show the stated
background, white.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from imagedata.make_images import write_digits

WHITE = 255
ORIENTATION = 0x0112  # the EXIF tag


@dataclass(frozen=True)
class MixedImage:
    rel: str  # <split>/<class>/<name>.<png|jpg>
    kind: str
    data: bytes
    expected: np.ndarray  # (height, width, 3) uint8: the picture it shows
    channels: int  # bands the file stores
    lossy: bool  # JPEG: compare within a tolerance


def _gray(v: np.ndarray) -> np.ndarray:
    return np.repeat(v[:, :, None], 3, axis=2)


def _resized(v: np.ndarray, width: int, height: int) -> np.ndarray:
    """The 8x8 digit at another size, pixel blocks kept (nearest): sizes vary in a dump."""
    rows = np.arange(height) * v.shape[0] // height
    cols = np.arange(width) * v.shape[1] // width
    return v[rows][:, cols]


def _encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    return exif.tobytes()


Kind = Callable[[np.ndarray, np.random.Generator], tuple[bytes, np.ndarray, int, str]]


def _png_gray8(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    up = _resized(v, 24, 24)
    return _encode(Image.fromarray(up), "PNG"), _gray(up), 1, "png"


def _png_gray16(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    up = _resized(v, 16, 16)
    sixteen = up.astype(np.uint16) * 257  # the same picture in 16 bits: 255 -> 65535
    assert Image.fromarray(sixteen).mode.startswith("I;16")
    return _encode(Image.fromarray(sixteen), "PNG"), _gray(up), 1, "png"


def _png_rgb(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    up = _gray(_resized(v, 32, 20))
    return _encode(Image.fromarray(up), "PNG"), up, 3, "png"


def _png_palette(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    up = _resized(v, 20, 20)
    image = Image.new("P", (20, 20))
    image.putpalette([c for i in range(256) for c in (255 - i, 255 - i, 255 - i)])  # inverted
    image.putdata((255 - up).flatten().tolist())  # index 255 - v shows grey v
    return _encode(image, "PNG"), _gray(up), 1, "png"


def _png_bilevel(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    up = np.where(_resized(v, 24, 24) > 127, 255, 0).astype(np.uint8)
    return _encode(Image.fromarray(up).convert("1"), "PNG"), _gray(up), 1, "png"


def _png_rgba_ink(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    """Black ink whose opacity is the digit's intensity, on a transparent sheet that stores
    black under it: seen on white, 255 - v."""
    up = _resized(v, 24, 24)
    rgba = np.zeros((24, 24, 4), dtype=np.uint8)
    rgba[:, :, 3] = up
    return _encode(Image.fromarray(rgba), "PNG"), _gray(255 - up), 4, "png"


def _png_la_leftovers(
    v: np.ndarray, rng: np.random.Generator
) -> tuple[bytes, np.ndarray, int, str]:
    """Dark ink (255 - v) where the digit is, fully transparent elsewhere, with random
    leftovers under the transparent pixels."""
    up = _resized(v, 16, 16)
    ink = up > 0
    gray = np.where(ink, 255 - up, rng.integers(0, 256, up.shape)).astype(np.uint8)
    alpha = np.where(ink, 255, 0).astype(np.uint8)
    data = _encode(Image.fromarray(np.dstack([gray, alpha])), "PNG")
    return data, _gray(np.where(ink, 255 - up, WHITE).astype(np.uint8)), 2, "png"


def _png_trns(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    """Grayscale whose value 0 is declared transparent (PNG's tRNS chunk)."""
    up = _resized(v, 24, 24)
    data = _encode(Image.fromarray(up), "PNG", transparency=0)
    return data, _gray(np.where(up == 0, WHITE, up).astype(np.uint8)), 1, "png"


def _png_exif_8(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    """Shown 16 wide, 24 high; stored turned so that orientation 8 (turn 90 degrees
    counter-clockwise to display) shows it upright."""
    upright = _resized(v, 16, 24)
    stored = np.rot90(upright, k=-1)  # clockwise; the viewer turns it back
    data = _encode(Image.fromarray(np.ascontiguousarray(stored)), "PNG", exif=_exif(8))
    return data, _gray(upright), 1, "png"


def _jpeg_gray(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    up = _resized(v, 32, 32)
    return _encode(Image.fromarray(up), "JPEG", quality=95), _gray(up), 1, "jpg"


def _jpeg_exif_6(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    """A phone's portrait photo: shown 24 wide, 40 high; stored as the sensor saw it, with
    orientation 6 (turn 90 degrees clockwise to display)."""
    upright = _gray(_resized(v, 24, 40))
    stored = np.ascontiguousarray(np.rot90(upright, k=1))  # counter-clockwise
    data = _encode(Image.fromarray(stored), "JPEG", quality=95, subsampling=0, exif=_exif(6))
    return data, upright, 3, "jpg"


def _jpeg_exif_3(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    upright = _gray(_resized(v, 40, 32))
    stored = np.ascontiguousarray(np.rot90(upright, k=2))
    data = _encode(Image.fromarray(stored), "JPEG", quality=95, subsampling=0, exif=_exif(3))
    return data, upright, 3, "jpg"


def _jpeg_cmyk(v: np.ndarray, rng: np.random.Generator) -> tuple[bytes, np.ndarray, int, str]:
    """A print workflow's CMYK JPEG: grey v is black ink 255 - v on no colour ink."""
    up = _resized(v, 32, 32)
    cmyk = np.zeros((32, 32, 4), dtype=np.uint8)
    cmyk[:, :, 3] = 255 - up
    data = _encode(Image.fromarray(cmyk, "CMYK"), "JPEG", quality=95)
    return data, _gray(up), 4, "jpg"


KINDS: dict[str, Kind] = {
    "png 8-bit grey": _png_gray8,
    "png 16-bit grey": _png_gray16,
    "png rgb": _png_rgb,
    "png palette": _png_palette,
    "png bilevel": _png_bilevel,
    "png rgba (ink opacity)": _png_rgba_ink,
    "png grey+alpha (leftovers under transparent)": _png_la_leftovers,
    "png grey with tRNS": _png_trns,
    "png exif orientation 8": _png_exif_8,
    "jpeg grey": _jpeg_gray,
    "jpeg exif orientation 6": _jpeg_exif_6,
    "jpeg exif orientation 3": _jpeg_exif_3,
    "jpeg cmyk": _jpeg_cmyk,
}


def photo_mix(work: Path, per_class: int, seed: int = 0) -> list[MixedImage]:
    """The digits (``per_class`` of each, train and test) in every kind, cycling."""
    digits = work / "digits-source"
    write_digits(digits, test_fraction=0.3, seed=seed, per_class=per_class)
    rng = np.random.default_rng(seed)
    kinds = list(KINDS.items())
    mix = []
    for i, path in enumerate(sorted(digits.rglob("*.png"))):
        with Image.open(path) as source:
            v = np.asarray(source.convert("L"))
        kind, make = kinds[i % len(kinds)]
        data, expected, channels, suffix = make(v, rng)
        rel = path.relative_to(digits).with_suffix(f".{suffix}").as_posix()
        mix.append(MixedImage(rel, kind, data, expected, channels, suffix == "jpg"))
    return mix


def write_mix(mix: list[MixedImage], root: Path) -> Path:
    for image in mix:
        target = root / image.rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(image.data)
    return root
