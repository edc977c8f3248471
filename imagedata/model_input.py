"""An image as a model reads it, without torch: uint8 RGB, channels first, at the input size.

The trainer, the scorer and ``training.predict`` all come through here (``imagedata.dataset``
wraps the array as a tensor), so ``model.onnx`` labels images exactly as ``model.pt`` scores
them, and the ONNX path of ``training.predict`` never imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import numpy as np
from PIL import Image, UnidentifiedImageError

from imagedata.images import open_image, to_rgb
from imagedata.webdataset import TarMember

# An image the readers decode: a loose file, or an image inside a WebDataset tar shard.
ImageSource = Path | TarMember


def to_model_array(image: Image.Image, size: int) -> np.ndarray:
    """Resize the shorter side to ``size``, centre-crop, as RGB; uint8 (3, size, size).

    Every image becomes the 8-bit RGB picture it shows (``imagedata.images.to_rgb``: the EXIF
    orientation applied, 16-bit scaled, transparency composited), so one model fits all inputs.
    """
    image = to_rgb(image)
    w, h = image.size
    scale = size / min(w, h)
    if (w, h) != (size, size):
        nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
        image = image.resize((nw, nh), Image.Resampling.BILINEAR)
        left, top = (nw - size) // 2, (nh - size) // 2
        image = image.crop((left, top, left + size, top + size))
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))


def opened(source: ImageSource) -> Path | IO[bytes]:
    """What Pillow opens: the file, or the bytes of a tar member read at its offset."""
    return source.open() if isinstance(source, TarMember) else source


def decode_array(source: ImageSource, size: int | None) -> np.ndarray | str | None:
    """Fully decode ``source`` (a valid header is not enough): the model input at ``size``, or
    None when no size is asked for; a string saying why when the file is unusable."""
    try:
        if (source.size if isinstance(source, TarMember) else source.stat().st_size) == 0:
            return "zero-byte file"
        with open_image(opened(source)) as image:
            image.load()
            return None if size is None else to_model_array(image, size)
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as exc:
        return f"unreadable image ({type(exc).__name__}: {exc})"
