"""What every dataset layout yields: its splits as torch datasets, the class names, and the
error that names what is wrong with an input.

Every layout (image folders, packed shards, CIFAR-10 batches, synthetic images) gives uint8 CHW
tensors at the model's input size, so the model (which owns its normalisation) sees the same
thing whatever the source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from training.images import to_rgb

# Collects one picklable value from every rank (Horovod's allgather_object in the trainer), so
# work such as verifying images can be split across ranks.
Gather = Callable[[dict[str, str]], list[dict[str, str]]]


class DatasetError(ValueError):
    """The dataset cannot be used as given; the message names the offending path or class."""


@dataclass
class SplitData:
    """One split as a torch dataset plus what was dropped while indexing it."""

    dataset: Dataset[tuple[torch.Tensor, int]]
    skipped: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # every dataset here is sized


@dataclass
class DatasetInfo:
    """What was found at ``--data-dir``: the format, class names and the splits present."""

    kind: str
    class_names: list[str]
    splits: dict[str, SplitData]
    notes: list[str] = field(default_factory=list)


def to_model_input(image: Image.Image, size: int) -> torch.Tensor:
    """Resize the shorter side to ``size``, centre-crop, as RGB; return uint8 CHW.

    Every image becomes the 8-bit RGB picture it shows (``training.images.to_rgb``: the EXIF
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
    array = np.asarray(image, dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()
