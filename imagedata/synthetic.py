"""``synthetic:N``: generated images whose classes are learnable, for smoke runs and benchmarks,
and the PNG encoding that writes generated datasets to disk."""

from __future__ import annotations

import io

import torch
from PIL import Image
from torch.utils.data import Dataset

from imagedata.dataset import DatasetError, DatasetInfo, SplitData


class SyntheticSplit(Dataset[tuple[torch.Tensor, int]]):
    """Images drawn on demand from class templates plus noise, reproducible per index.

    Each class has a fixed low-frequency colour pattern; a sample is its template, randomly
    shifted and noised, so a small CNN learns the classes in an epoch or two but cannot
    memorise pixel values.
    """

    def __init__(self, count: int, offset: int, templates: torch.Tensor, seed: int) -> None:
        self.count, self.offset, self.templates, self.seed = count, offset, templates, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + index)
        label = int(torch.randint(len(self.templates), (1,), generator=gen))
        size = self.templates.shape[-1]
        shift = torch.randint(-size // 8, size // 8 + 1, (2,), generator=gen)
        image = torch.roll(
            self.templates[label], shifts=(int(shift[0]), int(shift[1])), dims=(1, 2)
        )
        image = image + 40.0 * torch.randn(image.shape, generator=gen)
        return image.clamp(0, 255).to(torch.uint8), label


def synthetic_templates(classes: int, size: int, seed: int) -> torch.Tensor:
    """One smooth random pattern per class: coarse noise upsampled to the image size."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.rand((classes, 3, 4, 4), generator=gen) * 255.0
    return torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear")


def load_synthetic(spec: str, size: int, seed: int, classes: int = 10) -> DatasetInfo:
    try:
        total = int(spec.split(":", 1)[1])
    except ValueError as exc:
        raise DatasetError(f"--data-dir {spec!r}: expected synthetic:<number of images>") from exc
    if total < 2 * classes:
        raise DatasetError(f"--data-dir {spec!r}: need at least {2 * classes} images")
    templates = synthetic_templates(classes, size, seed)
    n_test = max(classes, total // 5)
    splits = {
        "train": SplitData(SyntheticSplit(total - n_test, 0, templates, seed)),
        "test": SplitData(SyntheticSplit(n_test, total, templates, seed)),
    }
    return DatasetInfo("synthetic", [f"class_{i}" for i in range(classes)], splits)


def encode_png(image: torch.Tensor) -> bytes:
    """PNG bytes of a uint8 CHW tensor (1 channel: grayscale); for writing generated datasets."""
    buffer = io.BytesIO()
    array = image.permute(1, 2, 0).numpy()
    Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array).save(buffer, format="PNG")
    return buffer.getvalue()
