"""Datasets the trainer and the scorer read, detected from ``--data-dir``.

Three layouts are understood:

* image folders (``imagedata.image_folders``), read from their packed shards
  (``imagedata.shards``) when staging packed them at the input size asked for;
* a CIFAR-10 batches directory, python pickles or binary ``.bin`` records (``imagedata.cifar``);
* ``synthetic:N``: generated images whose classes are learnable (``imagedata.synthetic``).

Every layout yields uint8 CHW tensors at the model's input size (``imagedata.dataset``). Bad input
raises :class:`DatasetError` naming the file, class or split; damaged images are skipped and
reported, never silently used.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from imagedata.cifar import find_cifar, load_cifar
from imagedata.dataset import DatasetError, DatasetInfo, Gather
from imagedata.image_folders import load_image_folders
from imagedata.images import REQUIRED_SPLITS, SPLITS
from imagedata.shards import open_shards
from imagedata.synthetic import load_synthetic


def _single_process_gather(value: dict[str, str]) -> list[dict[str, str]]:
    return [value]


def open_dataset(
    data_dir: str,
    image_size: int,
    *,
    seed: int = 0,
    verify_images: bool = True,
    rank: int = 0,
    world: int = 1,
    gather: Gather = _single_process_gather,
    use_shards: bool = True,
    required_splits: Sequence[str] = REQUIRED_SPLITS,
) -> DatasetInfo:
    """Detect the layout at ``data_dir`` and index it; raise DatasetError on anything unusable.
    ``required_splits``: the image-folder splits that must be there (train and test for
    training; the scorer asks only for the split it scores).

    Image folders packed by staging (``imagedata.shards``) are read from their shards when the
    shards match the folder's data and ``image_size``; ``notes`` says why when they do not.
    """
    if data_dir.startswith("synthetic:"):
        return load_synthetic(data_dir, image_size, seed)
    root = Path(data_dir)
    if not root.is_dir():
        raise DatasetError(f"--data-dir {root} does not exist or is not a directory")
    found = find_cifar(root)
    if found is not None:
        return load_cifar(found[0], found[1], image_size)
    if not any((root / s).is_dir() for s in SPLITS):
        raise DatasetError(
            f"--data-dir {root}: no train/ or test/ folders and no CIFAR-10 batches "
            "(data_batch_1 + test_batch, or their .bin versions)"
        )
    note = "packed shards not looked for"
    if use_shards:
        packed = open_shards(root, image_size)
        if isinstance(packed, DatasetInfo):
            return packed
        note = f"reading loose files: {packed}"
    info = load_image_folders(root, image_size, verify_images, rank, world, gather, required_splits)
    info.notes.append(note)
    return info
