"""The networks the trainer offers, one row each: the one table of model names.

A row says what everything but the network's own code needs to know: the side in pixels the
network was designed for (staging packs shards at it, the trainer and the scorer read them at
it), its last layer (the one with a row per class, which warm starts replace and fine-tuning
trains apart), and the function of ``training/models.py`` that builds it. The trainer's
arguments, the config's validation, the flow's run form and the benchmarks all read their
choices from here, so adding a network is a row below and its builder.

Torch-free, like ``training/args.py``: the orchestrator reads it without paying for torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal


@dataclass(frozen=True)
class Architecture:
    input_size: int  # pixels a side: CIFAR's 32 for the small CNN, ImageNet's 224 for ResNets
    classifier: str  # the last layer's module path below the network (its weight and bias)
    builder: str  # the function of training.models that builds the network for n classes


ARCHITECTURES: dict[str, Architecture] = {
    "cnn": Architecture(input_size=32, classifier="head.3", builder="small_cnn"),
    "resnet18": Architecture(input_size=224, classifier="fc", builder="resnet18"),
    "resnet50": Architecture(input_size=224, classifier="fc", builder="resnet50"),
}
MODEL_NAMES: tuple[str, ...] = tuple(ARCHITECTURES)

if TYPE_CHECKING:
    ModelName = str
else:
    # The names as a Literal, for what renders or validates a choice from a type: pydantic
    # (the config's training.model) and Prefect (the run form's model field).
    ModelName = Literal[MODEL_NAMES]


def architecture(name: str) -> Architecture:
    """The row of ``name``; a ValueError naming the choices when there is none."""
    if name not in ARCHITECTURES:
        raise ValueError(f"--model {name!r} is unknown; choose one of {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def input_sizes() -> str:
    """The table's input sizes for a help text: ``32 or 224``."""
    return " or ".join(str(n) for n in sorted({a.input_size for a in ARCHITECTURES.values()}))
