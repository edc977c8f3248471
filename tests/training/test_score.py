"""The scorer refuses a model file it cannot use and data whose classes differ, with exit 2, and
scores a model on the classes it knows when asked to (a champion against a new version)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, child_env, run_trainer

pytestmark = pytest.mark.processes  # each test starts the command it checks


def test_scorer_refuses_bad_model_and_mismatched_classes(
    small_folders: Path, tmp_path: Path
) -> None:
    def score(model: Path, data: Path, *extra: str) -> subprocess.CompletedProcess[str]:
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
                *extra,
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

    # A new version that added class_x and removed class_2: the model is scored on the images
    # of class_0 and class_1, in its own class order, and the report names what was left out.
    for split in ("train", "test"):
        shutil.rmtree(small_folders / split / "class_2")
    proc = score(tmp_path / "out" / "model.pt", small_folders, "--known-classes-only")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["class_names"] == ["class_0", "class_1", "class_2"]
    assert report["classes_not_scored"] == ["class_x"]
    assert report["classes_not_in_data"] == ["class_2"]
    scored = [len(list((small_folders / "test" / c).iterdir())) for c in ("class_0", "class_1")]
    assert report["num_images"] == sum(scored)
    assert [sum(row) for row in report["confusion_matrix"]] == [*scored, 0]
    for split in ("train", "test"):
        for name in ("class_0", "class_1"):
            shutil.rmtree(small_folders / split / name)
        shutil.copytree(small_folders / split / "class_x", small_folders / split / "class_y")
    proc = score(tmp_path / "out" / "model.pt", small_folders, "--known-classes-only")
    assert proc.returncode == 2 and "is of a class the model knows" in proc.stderr
