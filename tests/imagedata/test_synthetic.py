"""``synthetic:N``: reproducible, learnable generated images, and bad specs named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imagedata.data import open_dataset
from imagedata.dataset import DatasetError
from tests.conftest import run_trainer


def test_synthetic_is_learnable() -> None:
    info = open_dataset("synthetic:500", 32, seed=0)
    assert info.kind == "synthetic" and len(info.class_names) == 10
    assert len(info.splits["train"]) + len(info.splits["test"]) == 500
    a, _ = info.splits["train"].dataset[7]
    b, _ = info.splits["train"].dataset[7]
    assert torch.equal(a, b)  # reproducible per index, so every rank sees the same sample


@pytest.mark.processes
def test_synthetic_trains_far_above_chance(tmp_path: Path) -> None:
    result = run_trainer(1, "synthetic:600", tmp_path / "out", "--epochs", "2")
    assert result.returncode == 0, result.output
    assert result.metrics["test_accuracy"] > 0.5


@pytest.mark.parametrize("spec", ["synthetic:", "synthetic:abc", "synthetic:5"])
def test_synthetic_bad_spec(spec: str) -> None:
    with pytest.raises(DatasetError, match="synthetic"):
        open_dataset(spec, 32)
