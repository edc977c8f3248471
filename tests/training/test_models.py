"""The project's own networks: shapes, parameter counts, a real training step for ResNet, the
ResNets checked against torchvision's own code, and model files of the old names still loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import run_trainer
from tests.training.legacy_resnet import build_legacy_model, randomise_statistics
from tests.training.torchvision_resnet import RELEASE, load_resnet_module
from training.args import default_input_size
from training.models import MEAN, NETWORK, STD, build_model
from training.score import load_model


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


@pytest.fixture(scope="module")
def torchvision_resnet() -> object:
    """torchvision's resnet.py at a recorded release, from its published wheel, executed in
    isolation with its weight-download and telemetry imports stubbed
    (tests/training/torchvision_resnet.py says how); never skipped."""
    return load_resnet_module()


@pytest.mark.processes  # pip download, on the first run of a machine
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_resnets_are_torchvisions_architecture(name: str, torchvision_resnet: object) -> None:
    """torchvision's published state dicts load strictly, and compute the same function: the
    names, the shapes, the order of the layers and the strides all agree with torchvision's own
    ``resnet18()``/``resnet50()`` (``torchvision/models/resnet.py`` of the recorded release)."""
    torch.manual_seed(0)
    theirs = randomise_statistics(getattr(torchvision_resnet, name)(), seed=1)
    network = build_model(name, 1000)[int(NETWORK)]
    state = theirs.state_dict()
    # (a) the same parameter and buffer names, with the same shapes
    assert {k: tuple(v.shape) for k, v in network.state_dict().items()} == {
        k: tuple(v.shape) for k, v in state.items()
    }, f"differs from torchvision {RELEASE}"
    # (b) torchvision's state dict loads strictly
    network.load_state_dict(state, strict=True)
    # (c) the same input gives the same output: the architecture, not just the names
    ours = build_model(name, 1000).eval()
    ours[int(NETWORK)].load_state_dict(state, strict=True)
    images = torch.randint(0, 256, (2, 3, 64, 64)).float()
    normalised = (images / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(
        1, 3, 1, 1
    )
    with torch.no_grad():
        want = theirs(normalised)
        got = ours(images)
    assert got.shape == (2, 1000)
    # float32 rounding of sums in another order: far below any difference of architecture
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_model_files_of_the_old_names_still_load(name: str, tmp_path: Path) -> None:
    """A model.pt written by the trainer before the ResNets took torchvision's names (the old
    module definitions are kept in tests/training/legacy_resnet.py) loads and scores exactly
    as the model that wrote it."""
    torch.manual_seed(0)
    old = randomise_statistics(build_legacy_model(name, 3))
    assert any(k.startswith("1.stages.") for k in old.state_dict())
    path = tmp_path / "model.pt"
    torch.save(
        {
            "state_dict": old.state_dict(),
            "class_names": ["a", "b", "c"],
            "model_name": name,
            "input_size": 64,
        },
        path,
    )
    model, saved = load_model(path)
    images = torch.randint(0, 256, (2, 3, 64, 64)).float()
    with torch.no_grad():
        assert torch.allclose(model(images), old(images), atol=1e-5)
    assert saved["class_names"] == ["a", "b", "c"]
