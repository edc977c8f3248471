"""The export's two refusals: a layer the ONNX exporter cannot take is named, and an export
that computes something else than PyTorch is not written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from training.models import Normalize, SmallCNN, build_model
from training.onnx_export import ExportError, check_export, export_onnx, write_onnx


class MedianShift(nn.Module):
    """A layer with an operator the exporter has no ONNX function for (aten.median.dim)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.flatten(2).median(2).values[..., None, None]


def test_a_layer_that_cannot_be_exported_is_named() -> None:
    net = SmallCNN(3)
    net.features.insert(4, MedianShift())  # after the first block's ReLU
    model = nn.Sequential(Normalize(), net).eval()
    with pytest.raises(ExportError) as caught:
        export_onnx(model, 32, ["a", "b", "c"], "cnn")
    message = str(caught.value)
    assert "layer 1.features.4 (MedianShift) of the cnn cannot be exported to ONNX" in message
    assert "aten.median" in message


def test_an_export_that_differs_from_pytorch_is_refused_and_not_written(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("cnn", 3).eval()
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    other = build_model("cnn", 3).eval()  # other weights: the file computes something else
    data = export_onnx(other, 32, ["a", "b", "c"], "cnn")
    with pytest.raises(ExportError, match=r"model.onnx differs from the PyTorch model on 16 "):
        check_export(model, data, images)
    # The same model: within the tolerance, and then written.
    check = check_export(model, export_onnx(model, 32, ["a", "b", "c"], "cnn"), images)
    assert check.top1_agreement == 1.0 and check.max_prob_diff <= check.tolerance
    saved = {
        "state_dict": model.state_dict(),
        "class_names": ["a", "b", "c"],
        "model_name": "cnn",
        "input_size": 32,
    }
    path = tmp_path / "model.onnx"
    with pytest.raises(ExportError):
        write_onnx(saved, images, path, tolerance=-1.0)  # no export can pass
    assert not path.exists() and list(tmp_path.iterdir()) == []
    assert write_onnx(saved, images, path).images == 16 and path.is_file()
