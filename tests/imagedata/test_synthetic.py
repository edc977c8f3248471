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


def test_synthetic_classes_are_told_apart_by_their_templates() -> None:
    """The data is learnable by construction: the nearest class template names every test
    sample's class (deterministic for a seed), so a trainer that fails on it is at fault."""
    from imagedata.synthetic import synthetic_templates

    info = open_dataset("synthetic:500", 32, seed=0)
    templates = synthetic_templates(10, 32, 0).flatten(1)
    test = info.splits["test"].dataset
    right = 0
    for i in range(len(test)):
        image, label = test[i]
        distances = torch.cdist(image.float().flatten()[None], templates)[0]
        right += int(distances.argmin()) == label
    assert right / len(test) > 0.9


@pytest.mark.processes
def test_the_trainer_runs_on_synthetic_data_and_scores_its_test_split(tmp_path: Path) -> None:
    result = run_trainer(1, "synthetic:600", tmp_path / "out", "--epochs", "2")
    assert result.returncode == 0, result.output
    metrics = result.metrics
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
    assert metrics["dataset"]["num_test"] == 120  # a fifth of the images, every one scored
    assert 1 <= len(metrics["epochs"]) <= 2
    assert (tmp_path / "out" / "model.pt").is_file()


@pytest.mark.parametrize("spec", ["synthetic:", "synthetic:abc", "synthetic:5"])
def test_synthetic_bad_spec(spec: str) -> None:
    with pytest.raises(DatasetError, match="synthetic"):
        open_dataset(spec, 32)
