"""What every dataset layout yields: its splits as torch datasets, the class names, and the
error that names what is wrong with an input.

Every layout (image folders, packed shards, CIFAR-10 batches, synthetic images) gives uint8 CHW
tensors at the model's input size, so the model (which owns its normalisation) sees the same
thing whatever the source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from PIL import Image
from torch.utils.data import Dataset

from imagedata.model_input import to_model_array

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
    """Resize the shorter side to ``size``, centre-crop, as RGB; return uint8 CHW
    (``imagedata.model_input.to_model_array``, the one way every reader does it)."""
    return torch.from_numpy(to_model_array(image, size))
