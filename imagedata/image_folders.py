"""Image-folder datasets: ``D/train/<class>/*.png|jpg|jpeg``, ``D/test/<class>/...``, optional
``D/val``; sorted class names give the label ids.

The listing and the damaged-file checks are shared by the trainer's loose-file reader and by
the shard packer (``imagedata.shards``), so both drop exactly the same files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import UnidentifiedImageError
from torch.utils.data import Dataset

from imagedata.class_names import folders_problem, normal
from imagedata.dataset import DatasetError, DatasetInfo, Gather, SplitData, to_model_input
from imagedata.images import REQUIRED_SPLITS, SPLITS, is_image_name, open_image
from imagedata.model_input import ImageSource, decode_array, opened
from imagedata.webdataset import ShardError, is_tar_name, shard_members


class ImageFolderSplit(Dataset[tuple[torch.Tensor, int]]):
    """Decodes lazily, so memory stays flat however large the split is."""

    def __init__(self, samples: Sequence[tuple[ImageSource, int]], size: int) -> None:
        self.samples = list(samples)
        self.size = size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        try:
            with open_image(opened(path)) as image:
                return to_model_input(image, self.size), label
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            raise DatasetError(f"cannot decode image {path}: {exc}") from exc


def decode_checked(path: ImageSource, size: int | None) -> torch.Tensor | str | None:
    """Fully decode ``path`` (a valid header is not enough): the model input at ``size``, or
    None when no size is asked for; a string saying why when the file is unusable
    (``imagedata.model_input.decode_array``, as a tensor)."""
    verdict = decode_array(path, size)
    return torch.from_numpy(verdict) if isinstance(verdict, np.ndarray) else verdict


def _check_image(path: ImageSource) -> str | None:
    verdict = decode_checked(path, None)
    return verdict if isinstance(verdict, str) else None


def _split_files(root: Path, split: str) -> tuple[list[Path], dict[str, list[Path]]]:
    """A split's tar shards, or (none) its images per class folder: its files, no file read."""
    split_dir = root / split
    if not split_dir.is_dir():
        raise DatasetError(f"missing split: {split_dir} does not exist (expected {split}/<class>/)")
    entries = sorted(split_dir.iterdir())
    shards = [p for p in entries if p.is_file() and is_tar_name(p)]
    folders = [p for p in entries if p.is_dir()]
    if shards and folders:
        # A second copy of the split, or half of one: refused rather than guessed at.
        raise DatasetError(
            f"{split_dir} holds both tar shards and class folders "
            f"({', '.join(p.name for p in folders[:3])}): a split is one or the other"
        )
    if shards:
        return shards, {}
    problem = folders_problem(p.name for p in folders)
    if problem:  # the gate refuses it too (imagedata.class_names): no silent merge or lookalike
        raise DatasetError(f"{split_dir}: {problem}")
    classes: dict[str, list[Path]] = {}
    for class_dir in folders:
        files = sorted(p for p in class_dir.iterdir() if p.is_file() and is_image_name(p))
        if not files:
            raise DatasetError(f"empty class folder: {class_dir} has no .png/.jpg/.jpeg images")
        classes[normal(class_dir.name)] = files
    if not classes:
        raise DatasetError(f"split {split_dir} has no class folders")
    return [], classes


def _splits(root: Path, required: Sequence[str]) -> list[str]:
    return [s for s in SPLITS if s in required or (root / s).is_dir()]


def list_files(root: Path, required: Sequence[str] = REQUIRED_SPLITS) -> list[Path]:
    """Every file the dataset's images come from (loose images, and tar shards as wholes),
    without opening a shard: what its data version is computed from. Reading every shard's
    member headers instead is one read per image, on NFS, at every start of every rank."""
    files: list[Path] = []
    for split in _splits(root, required):
        shards, classes = _split_files(root, split)
        files += shards or [f for images in classes.values() for f in images]
    return files


def _list_split(root: Path, split: str) -> dict[str, list[ImageSource]]:
    shards, classes = _split_files(root, split)
    if shards:
        return _list_shards(root / split, shards)
    return {name: [*images] for name, images in classes.items()}


def _list_shards(split_dir: Path, shards: list[Path]) -> dict[str, list[ImageSource]]:
    """A split packed as WebDataset shards (``imagedata.webdataset``): its images per class,
    read from the tars' headers."""
    classes: dict[str, list[ImageSource]] = {}
    for shard in shards:
        try:
            found = shard_members(shard)
        except ShardError as exc:
            raise DatasetError(str(exc)) from exc
        for label, members in found.items():
            classes.setdefault(label, []).extend(members)
    if not classes:
        raise DatasetError(f"split {split_dir}: its tar shards hold no samples")
    return dict(sorted(classes.items()))


def list_image_folders(
    root: Path, required: Sequence[str] = REQUIRED_SPLITS
) -> tuple[list[str], dict[str, dict[str, list[ImageSource]]]]:
    """The class names and, per split present, each class's image files; checks that every
    split has the same classes (a model cannot score a class it never saw). ``required``: the
    splits that must be there (the scorer needs only the one it scores)."""
    listed = {s: _list_split(root, s) for s in _splits(root, required)}
    if not listed:
        raise DatasetError(f"{root} has none of the splits {', '.join(SPLITS)}")
    first = "train" if "train" in listed else next(iter(listed))
    class_names = sorted(listed[first])
    for split, classes in listed.items():
        if sorted(classes) != class_names:
            only_here = sorted(set(classes) - set(class_names))
            missing = sorted(set(class_names) - set(classes))
            raise DatasetError(
                f"class sets differ between {first} and {split}: "
                f"only in {split}: {only_here or 'none'}; missing from {split}: {missing or 'none'}"
            )
    return class_names, listed


def labelled_samples(
    class_names: list[str], listed: dict[str, dict[str, list[ImageSource]]], bad: dict[str, str]
) -> dict[str, tuple[list[tuple[ImageSource, int]], list[str]]]:
    """Per split, the usable (file, label) pairs and the damaged files left out with why.

    A class whose every file is damaged in some split is an error, not a silent gap.
    """
    labels = {name: i for i, name in enumerate(class_names)}
    result: dict[str, tuple[list[tuple[ImageSource, int]], list[str]]] = {}
    for split, classes in listed.items():
        samples: list[tuple[ImageSource, int]] = []
        skipped: list[str] = []
        for name, files in classes.items():
            for path in files:
                if str(path) in bad:
                    skipped.append(f"{path}: {bad[str(path)]}")
                else:
                    samples.append((path, labels[name]))
            if all(str(p) in bad for p in files):
                raise DatasetError(
                    f"class {name!r} in split {split} has no readable images "
                    f"({len(files)} files, all damaged, e.g. {files[0]})"
                )
        result[split] = (samples, skipped)
    return result


def load_image_folders(
    root: Path,
    size: int,
    verify: bool,
    rank: int,
    world: int,
    gather: Gather,
    required: Sequence[str] = REQUIRED_SPLITS,
) -> DatasetInfo:
    """The image folders under ``root`` as loose files, decoded lazily; with ``verify``, every
    file is decoded once first and the damaged ones are left out (and reported)."""
    class_names, listed = list_image_folders(root, required)
    bad: dict[str, str] = {}
    if verify:
        # Each rank decodes its own share of the files; the verdicts are then shared, so every
        # rank drops exactly the same files and the samplers stay aligned.
        everything = [p for classes in listed.values() for fs in classes.values() for p in fs]
        mine = {str(p): why for p in everything[rank::world] if (why := _check_image(p))}
        for part in gather(mine):
            bad.update(part)
    splits = {
        split: SplitData(ImageFolderSplit(samples, size), skipped)
        for split, (samples, skipped) in labelled_samples(class_names, listed, bad).items()
    }
    return DatasetInfo("image-folders", class_names, splits)
