"""Image classifiers, written here because this platform has no torchvision build.

Every model takes uint8-range float input and owns its normalisation, so a saved ``model.pt``
scores images without any preprocessing contract beyond "resize to ``input_size``".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class Normalize(nn.Module):
    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1) * 255.0)
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1) * 255.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def _conv_bn(cin: int, cout: int, stride: int = 1, kernel: int = 3) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
    ]


class SmallCNN(nn.Module):
    """Three conv blocks: fast enough on two CPU cores, good enough for CIFAR-sized images."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for cin, cout in ((3, 32), (32, 64), (64, 128)):
            layers += [*_conv_bn(cin, cout), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            *_conv_bn(cin, width, stride), nn.ReLU(inplace=True), *_conv_bn(width, cout)
        )
        self.shortcut = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            *_conv_bn(cin, width, kernel=1),
            nn.ReLU(inplace=True),
            *_conv_bn(width, width, stride),
            nn.ReLU(inplace=True),
            *_conv_bn(width, cout, kernel=1),
        )
        # Zero-init the last BN so each block starts as identity: stabler large-batch training.
        last_bn = self.body[-1]
        assert isinstance(last_bn, nn.BatchNorm2d)
        nn.init.zeros_(last_bn.weight)
        self.shortcut = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(*_conv_bn(cin, cout, stride, kernel=1))


class ResNet(nn.Module):
    """The ImageNet ResNet layout (He et al. 2015)."""

    def __init__(
        self, block: type[BasicBlock] | type[Bottleneck], depths: tuple[int, ...], num_classes: int
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            *_conv_bn(3, 64, stride=2, kernel=7),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        cin = 64
        for i, (width, depth) in enumerate(zip((64, 128, 256, 512), depths, strict=True)):
            for j in range(depth):
                stages.append(block(cin, width, stride=2 if i > 0 and j == 0 else 1))
                cin = width * block.expansion
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


# Keyed by the names the trainer's arguments offer (training.args.ModelName), whose input sizes
# are defined there too: the orchestrator reads them without importing torch.
MODELS: dict[str, Callable[[int], nn.Module]] = {
    "cnn": SmallCNN,
    "resnet18": lambda n: ResNet(BasicBlock, (2, 2, 2, 2), n),
    "resnet50": lambda n: ResNet(Bottleneck, (3, 4, 6, 3), n),
}


def build_model(name: str, num_classes: int) -> nn.Module:
    """The named network behind a normalisation layer."""
    if name not in MODELS:
        raise ValueError(f"--model {name!r} is unknown; choose one of {sorted(MODELS)}")
    return nn.Sequential(Normalize(), MODELS[name](num_classes))
