"""The scorer refuses a model file it cannot use and data whose classes differ, with exit 2."""

from __future__ import annotations

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
