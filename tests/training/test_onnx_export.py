"""The export's two refusals: a layer the ONNX exporter cannot take is named, and an export
that computes something else than PyTorch is not written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from training.models import build_model
from training.onnx_export import ExportError, check_export, export_onnx, write_onnx


class MedianShift(nn.Module):
    """A layer with an operator the exporter has no ONNX function for (aten.median.dim)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.flatten(2).median(2).values[..., None, None]


def test_a_layer_that_cannot_be_exported_is_named() -> None:
    # Small, as every layer tried costs an export: the block fails, and in it the layer.
    block = nn.Sequential(MedianShift())
    model = nn.Sequential(block, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3)).eval()
    with pytest.raises(ExportError) as caught:
        export_onnx(model, 16, ["a", "b", "c"], "cnn")
    message = str(caught.value)
    assert "layer 0.0 (MedianShift) of the cnn cannot be exported to ONNX" in message
    assert "aten.median" in message


def test_an_export_that_differs_from_pytorch_is_refused_and_not_written(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("cnn", 3).eval()
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    other = build_model("cnn", 3).eval()  # other weights: the file computes something else
    with pytest.raises(ExportError, match=r"model.onnx differs from the PyTorch model on 8 "):
        check_export(model, export_onnx(other, 16, ["a", "b", "c"], "cnn"), images)
    saved = {
        "state_dict": model.state_dict(),
        "class_names": ["a", "b", "c"],
        "model_name": "cnn",
        "input_size": 16,
    }
    path = tmp_path / "model.onnx"
    with pytest.raises(ExportError):
        write_onnx(saved, images, path, tolerance=-1.0)  # no export can pass
    assert not path.exists() and list(tmp_path.iterdir()) == []
    check = write_onnx(saved, images, path)  # the same model: within the tolerance, written
    assert check.images == 8 and check.top1_agreement == 1.0 and path.is_file()
    assert check.max_prob_diff <= check.tolerance
