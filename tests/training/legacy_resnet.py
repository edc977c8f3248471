"""The ResNets as this project defined them before they took torchvision's parameter names
(``stem``, ``stages.N.body``/``shortcut``, ``head``), kept whole so that tests can write model
files and checkpoints exactly as the trainer of that time did, and check that they still load."""

from __future__ import annotations

import torch
from torch import nn

from training.models import Normalize


def _conv_bn(cin: int, cout: int, stride: int = 1, kernel: int = 3) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
    ]


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


def build_legacy_model(name: str, num_classes: int) -> nn.Module:
    """``training.models.build_model`` of that time."""
    block: type[BasicBlock] | type[Bottleneck]
    block, depths = {
        "resnet18": (BasicBlock, (2, 2, 2, 2)),
        "resnet50": (Bottleneck, (3, 4, 6, 3)),
    }[name]
    return nn.Sequential(Normalize(), ResNet(block, depths, num_classes))


def randomise_statistics(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every batch norm layer non-trivial weights and running statistics, so that a
    layer loaded into the wrong place changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.weight.copy_(0.5 + torch.rand(n, generator=gen))
                m.bias.copy_(0.1 * torch.randn(n, generator=gen))
                assert m.running_mean is not None and m.running_var is not None
                m.running_mean.copy_(0.1 * torch.randn(n, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(n, generator=gen))
    return model.eval()
