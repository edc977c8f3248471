"""Image classifiers, written here because this platform has no torchvision build.

Every model takes uint8-range float input and owns its normalisation, so a saved ``model.pt``
scores images without any preprocessing contract beyond "resize to ``input_size``".

The ResNets are torchvision's architecture under torchvision's parameter names (``conv1``,
``bn1``, ``layer1`` .. ``layer4``, each block's ``conv1``/``bn1``/``conv2``/``bn2``[/``conv3``/
``bn3``]/``downsample``, ``fc``), so the state dicts torchvision publishes (ImageNet weights)
load into them strictly; tests/training/test_models.py checks this against torchvision's own
code. Model files written before that used other names; :func:`upgrade_state_dict` renames
their keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from training.architectures import architecture

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# A model.pt's layout: 1 (no version written) named the ResNets' layers this project's own way;
# 2 names them as torchvision does.
MODEL_FORMAT_VERSION = 2
# build_model's Sequential: the normalisation, then the network (its state dict keys start "1.").
NETWORK = "1"


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


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = _conv(cin, width, 3, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv(width, width * self.expansion, 3)
        self.bn2 = nn.BatchNorm2d(width * self.expansion)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """ResNet v1.5: the stride is on the 3x3 convolution, as in torchvision's weights."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = _conv(cin, width, 1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv(width, width, 3, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv(width, cout, 1)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        # Zero-init the last BN so each block starts as identity: stabler large-batch training.
        nn.init.zeros_(self.bn3.weight)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """The ImageNet ResNet layout (He et al. 2015), with torchvision's module names."""

    def __init__(
        self, block: type[BasicBlock] | type[Bottleneck], depths: tuple[int, ...], num_classes: int
    ) -> None:
        super().__init__()
        self.conv1 = _conv(3, 64, 7, stride=2)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = 64
        stages: list[nn.Sequential] = []
        for i, (width, depth) in enumerate(zip((64, 128, 256, 512), depths, strict=True)):
            blocks: list[nn.Module] = []
            for j in range(depth):
                stride = 2 if i > 0 and j == 0 else 1
                cout = width * block.expansion
                downsample = None
                if stride != 1 or cin != cout:
                    downsample = nn.Sequential(*_conv_bn(cin, cout, stride, kernel=1))
                blocks.append(block(cin, width, stride, downsample))
                cin = cout
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


RESNET_DEPTHS = {"resnet18": (2, 2, 2, 2), "resnet50": (3, 4, 6, 3)}


# The builders training/architectures.py names, one per row of its table.
def small_cnn(num_classes: int) -> nn.Module:
    return SmallCNN(num_classes)


def resnet18(num_classes: int) -> nn.Module:
    return ResNet(BasicBlock, RESNET_DEPTHS["resnet18"], num_classes)


def resnet50(num_classes: int) -> nn.Module:
    return ResNet(Bottleneck, RESNET_DEPTHS["resnet50"], num_classes)


def build_model(name: str, num_classes: int) -> nn.Module:
    """The named network behind a normalisation layer."""
    builder: Callable[[int], nn.Module] = globals()[architecture(name).builder]
    return nn.Sequential(Normalize(), builder(num_classes))


def classifier_prefix(name: str) -> str:
    """Where the classifier's ``weight`` and ``bias`` are in ``build_model(name, n)``'s state
    dict (``1.fc`` for a ResNet)."""
    return f"{NETWORK}.{architecture(name).classifier}"


# The ResNets' names in model files written before they took torchvision's: a stem Sequential,
# one flat Sequential of blocks, each a ``body`` Sequential and a ``shortcut``, and a head.
_OLD_BLOCK = re.compile(r"^stages\.(\d+)\.(body|shortcut)\.(\d+)\.(.+)$")
_BODY = {"0": "conv1", "1": "bn1", "3": "conv2", "4": "bn2", "6": "conv3", "7": "bn3"}


def _renamed(key: str, depths: tuple[int, ...]) -> str:
    """One ResNet key of the old names under torchvision's (below the network)."""
    for old, new in (("stem.0.", "conv1."), ("stem.1.", "bn1."), ("head.2.", "fc.")):
        if key.startswith(old):
            return new + key[len(old) :]
    found = _OLD_BLOCK.match(key)
    if found is None:
        return key
    index, part, layer, rest = int(found[1]), found[2], found[3], found[4]
    stage = 0
    while stage < len(depths) - 1 and index >= depths[stage]:
        index -= depths[stage]
        stage += 1
    name = f"downsample.{layer}" if part == "shortcut" else _BODY.get(layer, f"body.{layer}")
    return f"layer{stage + 1}.{index}.{name}.{rest}"


def upgrade_state_dict(name: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a ``build_model(name, n)`` state dict) with the keys of model files and
    checkpoints written before the ResNets took torchvision's names renamed; a state dict
    already in today's names comes back as it is. The parameters keep their order, so an
    optimizer state saved beside the old names still matches them."""
    depths = RESNET_DEPTHS.get(name)
    prefix = f"{NETWORK}."
    if depths is None or not any(k.startswith(f"{prefix}stem.") for k in state):
        return state
    return {
        (prefix + _renamed(k[len(prefix) :], depths) if k.startswith(prefix) else k): v
        for k, v in state.items()
    }
