"""The image files the project reads, the splits they are filed under, and the one way they
are opened.

Only PNG and JPEG, by name and by content. Pillow's ``Image.open`` otherwise identifies a file
by sniffing its bytes against every format plugin it has, whatever the file is called: an EPS
document named ``cat.png`` would be handed to Ghostscript, a program the data never needed.
Data staged from a storage account is input, not trusted code, so every reader (the data gate,
the trainer, the shard packer, the scorer) opens images through :func:`open_image`.

Torch-free: the data gate imports it in the orchestrator.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import IO

from PIL import Image

# An image-folder dataset: <split>/<class>/<image>, train and test required, val optional.
SPLITS = ("train", "val", "test")
REQUIRED_SPLITS = ("train", "test")
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg"})
IMAGE_FORMATS = ("PNG", "JPEG")  # Pillow's names for the formats the suffixes stand for


def is_image_name(name: str | PurePath) -> bool:
    """Whether a file of this name is read as an image (by its suffix, case-insensitive)."""
    return PurePath(name).suffix.lower() in IMAGE_SUFFIXES


def open_image(source: str | PurePath | IO[bytes]) -> Image.Image:
    """Open ``source`` as PNG or JPEG only; anything else raises UnidentifiedImageError."""
    return Image.open(source, formats=IMAGE_FORMATS)
