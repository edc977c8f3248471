"""CIFAR-10 batches, pickled and binary, read through the trainer's entry point; hostile
pickles refused."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from imagedata.cifar import CIFAR10_CLASSES
from imagedata.data import open_dataset
from imagedata.dataset import DatasetError
from imagedata.synthetic import SyntheticSplit, synthetic_templates
from tests.conftest import run_trainer


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


@pytest.mark.processes
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
