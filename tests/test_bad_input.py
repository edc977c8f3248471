"""Bad input gives a clear error naming the file, class or split, or a reported skip."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import ROOT, child_env, run_trainer
from training.data import DatasetError, open_dataset


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


def test_not_a_dataset_named(tmp_path: Path) -> None:
    (tmp_path / "random").mkdir()
    with pytest.raises(DatasetError, match="no train/ or test/ folders and no CIFAR-10 batches"):
        open_dataset(str(tmp_path / "random"), 32)
    with pytest.raises(DatasetError, match="does not exist"):
        open_dataset(str(tmp_path / "nowhere"), 32)


def test_nan_loss_stops_with_clear_error(tmp_path: Path) -> None:
    result = run_trainer(
        1, "synthetic:400", tmp_path / "out", "--epochs", "3", "--lr", "1e12", "--log-every", "2"
    )
    assert result.returncode == 2, result.output
    assert "training loss became nan" in result.output.lower()
    assert "lower --lr" in result.output
    assert not (tmp_path / "out" / "model.pt").exists()


@pytest.mark.parametrize(
    "bad", [["--epochs", "0"], ["--lr", "-1"], ["--lr", "nan"], ["--model", "vgg"]]
)
def test_bad_arguments_refused(bad: list[str], tmp_path: Path) -> None:
    result = run_trainer(1, "synthetic:100", tmp_path / "out", *bad)
    assert result.returncode == 2
    assert bad[0] in result.output


def test_scorer_refuses_bad_model_and_mismatched_classes(
    small_folders: Path, tmp_path: Path
) -> None:
    def score(model: Path, data: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "training.score",
                "--model",
                str(model),
                "--data-dir",
                str(data),
                "--output",
                str(tmp_path / "s.json"),
            ],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
        )

    broken = tmp_path / "model.pt"
    broken.write_bytes(b"PK\x03\x04 truncated")
    proc = score(broken, small_folders)
    assert proc.returncode == 2 and f"model file {broken} cannot be read" in proc.stderr

    trained = run_trainer(1, small_folders, tmp_path / "out", "--epochs", "1", "--batch-size", "8")
    assert trained.returncode == 0, trained.output
    for split in ("train", "test"):
        shutil.copytree(small_folders / split / "class_0", small_folders / split / "class_x")
    proc = score(tmp_path / "out" / "model.pt", small_folders)
    assert proc.returncode == 2 and "differ from the model's" in proc.stderr
    assert not (tmp_path / "s.json").exists()


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


def test_adasum_without_mpi_or_nccl_is_refused(tmp_path: Path, horovodrun: Path) -> None:
    import horovod.torch as hvd

    if hvd.mpi_built():
        pytest.skip("this Horovod has MPI, so Adasum is available and there is nothing to refuse")
    result = run_trainer(2, "synthetic:200", tmp_path / "out", "--adasum", "--epochs", "1")
    assert result.returncode != 0
    assert "--adasum needs Horovod with MPI (CPU) or NCCL (GPU)" in result.output
