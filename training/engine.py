"""The contract between the trainer and a data-parallel engine: what an engine must do, and the
values that cross it. Kept apart from ``training.distributed`` (which picks and starts an engine)
so the engines import only the contract, never the module that imports them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


class UsageError(ValueError):
    """An option this engine, build or machine cannot honour."""


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device

    @property
    def is_root(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class GradientOptions:
    """How gradients travel between ranks; each engine honours them its own way."""

    fp16_allreduce: bool
    backward_passes_per_step: int
    adasum: bool
    sync_batchnorm: bool
    shard_optimizer_state: bool = False


class Engine(Protocol):
    """What the trainer needs of a data-parallel engine (one implementation per engine)."""

    name: str
    # Whether its collectives take contiguous tensors only (Horovod's do); then channels-last
    # weights need gradient buffers of their own layout (training.speed).
    contiguous_tensors: bool

    def start(self, timeline: bool) -> tuple[int, int, int, int]:
        """Join the process group; returns rank, size, local rank, local size."""
        ...

    def allreduce_sum(self, values: torch.Tensor, name: str) -> torch.Tensor: ...

    def gather_objects(self, value: object) -> list[object]: ...

    def broadcast_object(self, value: object) -> object: ...

    def sync_buffers(self, model: nn.Module) -> None: ...

    def check_options(self, world: World, options: GradientOptions) -> None: ...

    def wrap(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, options: GradientOptions
    ) -> tuple[nn.Module, torch.optim.Optimizer]: ...

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None: ...

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """The whole optimizer state as a plain optimizer's state dict, on rank 0 (None on the
        others): what a checkpoint holds, whichever engine wrote it. Every rank calls it."""
        ...

    def accumulating(self, net: nn.Module, sync: bool) -> AbstractContextManager[None]: ...

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> None: ...

    def lr_scale(self, world: World, options: GradientOptions) -> float: ...

    def start_timeline(self, path: str) -> None: ...

    def stop_timeline(self) -> None: ...

    def barrier(self) -> None: ...

    def shutdown(self) -> None: ...
