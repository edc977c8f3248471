"""The image files the project reads, the splits they are filed under, and the one way they
are opened.

Only PNG and JPEG, by name and by content. Pillow's ``Image.open`` otherwise identifies a file
by sniffing its bytes against every format plugin it has, whatever the file is called: an EPS
document named ``cat.png`` would be handed to Ghostscript, a program the data never needed.
Data staged from a storage account is input, not trusted code, so every reader (the data gate,
the trainer, the shard packer, the scorer) opens images through :func:`open_image`.

And one way they become pixels: :func:`to_rgb` (used by every reader, through
``imagedata.dataset.to_model_input`` for the model's input) decodes an image by what its pixels
mean, where Pillow's plain ``convert("RGB")`` goes wrong silently on what photo dumps hold:

- 16-bit grayscale (PNG mode ``I;16``) is scaled to 8 bits (``convert`` clips it: a gradient
  with mean 127 arrived nearly white, mean 251);
- the EXIF orientation is applied, as every viewer does (camera and phone JPEGs store the
  sensor's pixels plus a tag saying how to turn them: ignored, they trained sideways, and the
  gate recorded their width and height swapped);
- transparent pixels are composited on :data:`BACKGROUND` (``convert`` drops the alpha and
  keeps whatever colour the file stores under a transparent pixel, often black).

Torch-free: the data gate imports it in the orchestrator.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import IO

import numpy as np
from PIL import Image, ImageOps

# An image-folder dataset: <split>/<class>/<image>, train and test required, val optional.
SPLITS = ("train", "val", "test")
REQUIRED_SPLITS = ("train", "test")
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg"})
IMAGE_FORMATS = ("PNG", "JPEG")  # Pillow's names for the formats the suffixes stand for
# What transparent pixels are composited on: white, the page viewers and browsers show a
# transparent picture on by default. What a file stores under a fully transparent pixel is not
# part of the picture (editors leave black, white or leftovers there).
BACKGROUND = (255, 255, 255)
# Pillow's modes for PNG's 16-bit grayscale (``I`` in older Pillow versions): values 0..65535.
SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})


def suffix(name: str | PurePath) -> str:
    """``PurePath(name).suffix``, lower case, from the string alone: the gate asks it of every
    blob name of a listing, and building a path object for each was most of a nightly gate's
    CPU on an ImageNet-sized one."""
    text = name if isinstance(name, str) else str(name)
    if text.endswith(("/", "/.")) or text == ".":  # what PurePath normalises away first
        return PurePath(text).suffix.lower()
    last = text[text.rfind("/") + 1 :]
    dot = last.rfind(".")
    return last[dot:].lower() if 0 < dot < len(last) - 1 else ""


def is_image_name(name: str | PurePath) -> bool:
    """Whether a file of this name is read as an image (by its suffix, case-insensitive)."""
    return suffix(name) in IMAGE_SUFFIXES


# The most pixels an image may have before it is decoded: larger than a 45-megapixel camera's
# photos, and about 150 MB as 8-bit RGB. Pillow's own guard (DecompressionBombError) starts at
# twice its MAX_IMAGE_PIXELS, some 179 M: a 13,000 x 13,000 PNG of 189 KB passes it and takes
# half a gigabyte to decode, and a reader decodes several at once.
MAX_PIXELS = 50_000_000
# The most bytes an image file may have to be read at all: a 50-megapixel JPEG is a few tens
# of MB; a larger "image" is not training data, and readers hold a file whole while decoding.
MAX_IMAGE_BYTES = 64 << 20


class ImageTooLarge(ValueError):
    """An image whose header declares more pixels than :data:`MAX_PIXELS`; nothing of it was
    decoded."""

    def __init__(self, width: int, height: int) -> None:
        super().__init__(
            f"{width} x {height} pixels is over the {MAX_PIXELS:,}-pixel limit (its header "
            "was read, nothing decoded)"
        )
        self.width, self.height = width, height


def open_image(source: str | PurePath | IO[bytes]) -> Image.Image:
    """Open ``source`` as PNG or JPEG only (anything else raises UnidentifiedImageError), and
    only when its header declares at most :data:`MAX_PIXELS` (else :class:`ImageTooLarge`).
    Opening reads the header alone: pixels are decoded later, by whoever asks for them."""
    image = Image.open(source, formats=IMAGE_FORMATS)
    width, height = image.size
    if width * height > MAX_PIXELS:
        image.close()
        raise ImageTooLarge(width, height)
    return image


def _to_eight_bits(image: Image.Image) -> Image.Image:
    """16-bit grayscale scaled to 8 bits (rounded), keeping a tRNS transparent value as alpha."""
    values = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
    gray = ((values * 255 + 32767) // 65535).astype(np.uint8)
    key = image.info.get("transparency")
    if isinstance(key, int):
        alpha = np.where(values == key, 0, 255).astype(np.uint8)
        return Image.fromarray(np.dstack([gray, alpha]))  # LA
    return Image.fromarray(gray)  # L


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as the 8-bit RGB picture it shows: turned by its EXIF orientation, 16-bit
    grayscale scaled to 8 bits, transparency composited on :data:`BACKGROUND`. Decodes the
    whole image (a damaged one raises here, not at its header)."""
    image.load()
    # A copy, turned when the tag says so (an EXIF block that does not parse turns nothing).
    image = ImageOps.exif_transpose(image) or image
    if image.mode in SIXTEEN_BIT_MODES:
        image = _to_eight_bits(image)
    if image.has_transparency_data:
        back = Image.new("RGBA", image.size, (*BACKGROUND, 255))
        return Image.alpha_composite(back, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")
