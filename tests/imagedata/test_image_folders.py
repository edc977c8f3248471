"""Image-folder datasets: any image becomes RGB at the input size, labels follow sorted class
names, and bad input (a missing split, an empty class, damaged images) is named or skipped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from imagedata.data import open_dataset
from imagedata.dataset import DatasetError, to_model_input
from tests.conftest import run_trainer


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


@pytest.mark.processes
def test_optional_val_split_reported_per_epoch(small_folders: Path, tmp_path: Path) -> None:
    (small_folders / "test").rename(small_folders / "val")
    import shutil

    shutil.copytree(small_folders / "val", small_folders / "test")
    result = run_trainer(1, small_folders, tmp_path / "out", "--epochs", "2", "--batch-size", "8")
    assert result.returncode == 0, result.output
    assert all("val_accuracy" in e for e in result.metrics["epochs"])
    assert result.metrics["dataset"]["num_val"] == result.metrics["dataset"]["num_test"]


@pytest.mark.processes
def test_missing_split_named(small_folders: Path, tmp_path: Path) -> None:
    shutil.rmtree(small_folders / "test")
    result = run_trainer(1, small_folders, tmp_path / "out", "--epochs", "1")
    assert result.returncode == 2
    assert f"missing split: {small_folders / 'test'} does not exist" in result.output
    assert not (tmp_path / "out" / "model.pt").exists()


def test_missing_split_under_horovodrun(
    small_folders: Path, tmp_path: Path, horovodrun: Path
) -> None:
    shutil.rmtree(small_folders / "train")
    result = run_trainer(2, small_folders, tmp_path / "out", "--epochs", "1")
    assert result.returncode != 0
    assert f"missing split: {small_folders / 'train'} does not exist" in result.output


def test_empty_class_folder_named(small_folders: Path) -> None:
    empty = small_folders / "train" / "class_9"
    empty.mkdir()
    (empty / "notes.txt").write_text("not an image")
    with pytest.raises(DatasetError, match=f"empty class folder: {empty}"):
        open_dataset(str(small_folders), 32)


def test_class_sets_differ_named(small_folders: Path) -> None:
    shutil.rmtree(small_folders / "test" / "class_2")
    with pytest.raises(DatasetError, match=r"missing from test: \['class_2'\]"):
        open_dataset(str(small_folders), 32)


@pytest.mark.processes
def test_damaged_images_skipped_and_reported(small_folders: Path, tmp_path: Path) -> None:
    cls = small_folders / "train" / "class_1"
    (cls / "empty.png").write_bytes(b"")
    (cls / "garbage.jpg").write_bytes(b"this is not a jpeg at all")
    good = next(cls.glob("0*.png")).read_bytes()
    (cls / "truncated.png").write_bytes(good[: len(good) // 2])  # valid header, broken data
    result = run_trainer(1, small_folders, tmp_path / "out", "--epochs", "1", "--batch-size", "8")
    assert result.returncode == 0, result.output
    skipped = result.metrics["skipped_images"]
    assert skipped["count"] == 3
    reasons = "\n".join(skipped["files"])
    assert f"{cls / 'empty.png'}: zero-byte file" in reasons
    assert f"{cls / 'garbage.jpg'}: unreadable image" in reasons
    assert f"{cls / 'truncated.png'}: unreadable image" in reasons
    assert "skipped" in result.output and "3 damaged images skipped" in result.output
    n_files = sum(1 for _ in (small_folders / "train").rglob("*.*"))
    assert result.metrics["dataset"]["num_train"] == n_files - 3


def test_class_with_only_damaged_images_is_an_error(small_folders: Path) -> None:
    cls = small_folders / "test" / "class_0"
    for image in cls.iterdir():
        image.write_bytes(b"")
    with pytest.raises(DatasetError, match="class 'class_0' in split test has no readable images"):
        open_dataset(str(small_folders), 32)


@pytest.mark.processes
def test_grayscale_only_dataset_trains(tmp_path: Path) -> None:
    root = tmp_path / "gray"
    for split, n in (("train", 12), ("test", 4)):
        for c, shade in (("dark", 30), ("light", 220)):
            folder = root / split / c
            folder.mkdir(parents=True)
            for i in range(n):
                Image.new("L", (20 + i, 24), shade + i).save(folder / f"{i}.png")
    result = run_trainer(1, root, tmp_path / "out", "--epochs", "2", "--batch-size", "4")
    assert result.returncode == 0, result.output
    assert result.metrics["class_names"] == ["dark", "light"]
