"""Each data layout the trainer detects, read through the same entry point it uses."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import run_trainer
from training.data import (
    CIFAR10_CLASSES,
    DatasetError,
    SyntheticSplit,
    open_dataset,
    synthetic_templates,
    to_model_input,
)


def _cifar_like(n: int, seed: int) -> tuple[np.ndarray, list[int]]:
    """Learnable 32x32 images in CIFAR's (N, 3072) R,G,B-plane layout."""
    split = SyntheticSplit(n, seed * 10_000, synthetic_templates(10, 32, 0), 0)
    images, labels = zip(*(split[i] for i in range(n)), strict=True)
    return torch.stack(images).reshape(n, -1).numpy(), list(labels)


def write_cifar_pickle(root: Path) -> None:
    root.mkdir(parents=True)
    for name, n, seed in (
        ("data_batch_1", 300, 1),
        ("data_batch_2", 300, 2),
        ("test_batch", 200, 3),
    ):
        data, labels = _cifar_like(n, seed)
        with open(root / name, "wb") as fh:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, fh)
    with open(root / "batches.meta", "wb") as fh:
        pickle.dump({b"label_names": [c.encode() for c in CIFAR10_CLASSES]}, fh)


def write_cifar_bin(root: Path) -> None:
    root.mkdir(parents=True)
    for name, n, seed in (("data_batch_1.bin", 400, 1), ("test_batch.bin", 200, 3)):
        data, labels = _cifar_like(n, seed)
        records = np.concatenate([np.array(labels, dtype=np.uint8)[:, None], data], axis=1)
        records.tofile(root / name)
    (root / "batches.meta.txt").write_text("\n".join(CIFAR10_CLASSES) + "\n\n")


def test_cifar_pickle_batches(tmp_path: Path) -> None:
    write_cifar_pickle(tmp_path / "cifar-10-batches-py")
    info = open_dataset(str(tmp_path), 32)  # the parent of the extracted folder also works
    assert info.kind == "cifar10-pickle"
    assert info.class_names == list(CIFAR10_CLASSES)
    assert len(info.splits["train"]) == 600
    image, label = info.splits["test"].dataset[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8 and 0 <= label < 10


def test_cifar_binary_batches_train(tmp_path: Path) -> None:
    write_cifar_bin(tmp_path / "cifar")
    result = run_trainer(1, tmp_path / "cifar", tmp_path / "out", "--epochs", "2")
    assert result.returncode == 0, result.output
    m = result.metrics
    assert m["dataset"] == {"kind": "cifar10-bin", "num_train": 400, "num_test": 200}
    assert m["class_names"] == list(CIFAR10_CLASSES)
    assert m["test_accuracy"] > 0.3  # chance 0.1


def test_cifar_pickle_refuses_code(tmp_path: Path) -> None:
    """A pickle that would run a command on load is rejected before it can."""
    root = tmp_path / "cifar"
    write_cifar_pickle(root)

    class Exploit:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (Path.touch, (tmp_path / "pwned",))

    with open(root / "data_batch_1", "wb") as fh:
        pickle.dump({b"data": Exploit(), b"labels": []}, fh)
    with pytest.raises(DatasetError, match=r"data_batch_1.*not allowed"):
        open_dataset(str(root), 32)
    assert not (tmp_path / "pwned").exists()


def test_cifar_truncated_binary_named(tmp_path: Path) -> None:
    root = tmp_path / "cifar"
    write_cifar_bin(root)
    with open(root / "test_batch.bin", "ab") as fh:
        fh.write(b"\x00" * 100)
    with pytest.raises(DatasetError, match=r"test_batch\.bin is .* not a multiple of 3073"):
        open_dataset(str(root), 32)


def test_synthetic_is_learnable() -> None:
    info = open_dataset("synthetic:500", 32, seed=0)
    assert info.kind == "synthetic" and len(info.class_names) == 10
    assert len(info.splits["train"]) + len(info.splits["test"]) == 500
    a, _ = info.splits["train"].dataset[7]
    b, _ = info.splits["train"].dataset[7]
    assert torch.equal(a, b)  # reproducible per index, so every rank sees the same sample


def test_synthetic_trains_far_above_chance(tmp_path: Path) -> None:
    result = run_trainer(1, "synthetic:600", tmp_path / "out", "--epochs", "2")
    assert result.returncode == 0, result.output
    assert result.metrics["test_accuracy"] > 0.5


@pytest.mark.parametrize("spec", ["synthetic:", "synthetic:abc", "synthetic:5"])
def test_synthetic_bad_spec(spec: str) -> None:
    with pytest.raises(DatasetError, match="synthetic"):
        open_dataset(spec, 32)


def test_any_size_and_mode_becomes_rgb_at_input_size(small_folders: Path) -> None:
    cls = small_folders / "train" / "class_0"
    Image.new("L", (50, 20), 128).save(cls / "gray_wide.png")
    Image.new("RGBA", (7, 90), (10, 20, 30, 40)).save(cls / "rgba_tall.png")
    Image.new("RGB", (640, 480), (200, 0, 0)).save(cls / "big.JPG")
    Image.new("P", (33, 33)).save(cls / "palette.png")
    info = open_dataset(str(small_folders), 32)
    paths = [p.name for p, _ in info.splits["train"].dataset.samples]  # type: ignore[attr-defined]
    assert {"gray_wide.png", "rgba_tall.png", "big.JPG", "palette.png"} <= set(paths)
    for i in range(len(paths)):
        image, _ = info.splits["train"].dataset[i]
        assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
    gray = to_model_input(Image.new("L", (50, 20), 128), 32)
    assert torch.all(gray == 128)  # grayscale copied into all three channels


def test_labels_follow_sorted_class_names(small_folders: Path) -> None:
    (small_folders / "train" / "class_1").rename(small_folders / "train" / "aaa")
    (small_folders / "test" / "class_1").rename(small_folders / "test" / "aaa")
    info = open_dataset(str(small_folders), 32)
    assert info.class_names == ["aaa", "class_0", "class_2"]
    by_label = {
        label
        for path, label in info.splits["train"].dataset.samples  # type: ignore[attr-defined]
        if path.parent.name == "aaa"
    }
    assert by_label == {0}


def test_optional_val_split_reported_per_epoch(small_folders: Path, tmp_path: Path) -> None:
    (small_folders / "test").rename(small_folders / "val")
    import shutil

    shutil.copytree(small_folders / "val", small_folders / "test")
    result = run_trainer(1, small_folders, tmp_path / "out", "--epochs", "2", "--batch-size", "8")
    assert result.returncode == 0, result.output
    assert all("val_accuracy" in e for e in result.metrics["epochs"])
    assert result.metrics["dataset"]["num_val"] == result.metrics["dataset"]["num_test"]
