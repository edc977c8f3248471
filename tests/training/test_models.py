"""The project's own networks: shapes, parameter counts, and a real training step for ResNet."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import run_trainer
from training.args import default_input_size
from training.models import build_model


@pytest.mark.parametrize(
    ("name", "params_millions"), [("cnn", 0.09), ("resnet18", 11.2), ("resnet50", 23.5)]
)
def test_forward_shape_and_size(name: str, params_millions: float) -> None:
    model = build_model(name, 7).eval()
    size = 64 if name != "cnn" else default_input_size(name)
    with torch.no_grad():
        out = model(torch.randint(0, 256, (2, 3, size, size)).float())
    assert out.shape == (2, 7)
    count = sum(p.numel() for p in model.parameters()) / 1e6
    # The published ResNet sizes (11.7M / 25.6M with a 1000-class head) less that head.
    assert count == pytest.approx(params_millions, rel=0.05)


def test_unknown_model_named() -> None:
    with pytest.raises(ValueError, match="'vgg' is unknown"):
        build_model("vgg", 10)


@pytest.mark.processes
def test_resnet18_trains_through_the_cli(tmp_path: Path) -> None:
    result = run_trainer(
        1,
        "synthetic:96",
        tmp_path / "out",
        "--model",
        "resnet18",
        "--image-size",
        "32",
        "--epochs",
        "1",
        "--batch-size",
        "16",
    )
    assert result.returncode == 0, result.output
    saved = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert saved["model_name"] == "resnet18" and saved["input_size"] == 32
