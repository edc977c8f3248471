"""The Horovod engine: ``horovodrun`` starts the ranks, ``DistributedOptimizer`` averages the
gradients. Imported only when chosen (``--engine horovod``, the default)."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

from training.engine import GradientOptions, UsageError, World


class HorovodEngine:
    name = "horovod"
    contiguous_tensors = True

    def start(self, timeline: bool) -> tuple[int, int, int, int]:
        if timeline:
            os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")
        hvd.init()
        return hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()

    def allreduce_sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        return hvd.allreduce(values, op=hvd.Sum, name=name)

    def gather_objects(self, value: object) -> list[object]:
        return list(hvd.allgather_object(value))

    def broadcast_object(self, value: object) -> object:
        return hvd.broadcast_object(value, root_rank=0)

    def sync_buffers(self, model: nn.Module) -> None:
        for name, buffer in model.named_buffers():
            if buffer.is_floating_point():
                hvd.allreduce_(buffer, op=hvd.Average, name=f"buffer.{name}")
            else:
                hvd.broadcast_(buffer, root_rank=0, name=f"buffer.{name}")

    def _adasum_available(self, world: World) -> bool:
        """Horovod implements Adasum over MPI (CPU) or NCCL (GPU), not over Gloo alone."""
        return bool(hvd.mpi_enabled() or (world.device.type == "cuda" and hvd.nccl_built()))

    def check_options(self, world: World, options: GradientOptions) -> None:
        if options.adasum and not self._adasum_available(world):
            raise UsageError(
                "--adasum needs Horovod with MPI (CPU) or NCCL (GPU); this build has "
                "Gloo only: drop --adasum or use the training image's Horovod"
            )
        if options.sync_batchnorm:
            raise UsageError("--sync-batchnorm needs --engine ddp (on GPU)")
        if options.shard_optimizer_state:
            raise UsageError(
                "--shard-optimizer-state needs --engine ddp (Horovod keeps the whole optimizer "
                "state on every rank)"
            )

    def wrap(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, options: GradientOptions
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model as it is, and a DistributedOptimizer over the same parameter groups.

        The wrapper is what steps, so it holds the optimizer state (momentum): checkpoints
        save and load its state dict, an ordinary SGD one.
        """
        compression = hvd.Compression.fp16 if options.fp16_allreduce else hvd.Compression.none
        wrapped = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=compression,
            backward_passes_per_step=options.backward_passes_per_step,
            op=hvd.Adasum if options.adasum else hvd.Average,
        )
        return model, wrapped

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer state first: on a rank whose optimizer has no state yet, Horovod creates it
        by taking one step with zero gradients, and weight decay makes that step move the
        weights. When resuming only rank 0 has state, so the weights' broadcast comes last."""
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """Every rank holds the whole state (DistributedOptimizer's is an SGD state dict)."""
        return optimizer.state_dict() if hvd.rank() == 0 else None

    def accumulating(self, net: nn.Module, sync: bool) -> AbstractContextManager[None]:
        # DistributedOptimizer counts backward passes and allreduces after the k-th itself.
        return nullcontext()

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> None:
        """With mixed precision Horovod averages the scaled gradients first; GradScaler then
        unscales them and skips the step on overflow, identically on every rank."""
        if scaler is None:
            optimizer.step()
            return
        optimizer.synchronize()  # type: ignore[attr-defined]
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            scaler.step(optimizer)
        scaler.update()

    def lr_scale(self, world: World, options: GradientOptions) -> float:
        """Adasum combines gradients adaptively and needs no scaling, except across the local
        GPUs that NCCL sums hierarchically."""
        if options.adasum:
            on_nccl = world.device.type == "cuda" and hvd.nccl_built()
            return float(world.local_size) if on_nccl else 1.0
        return float(world.size * options.backward_passes_per_step)

    def start_timeline(self, path: str) -> None:
        hvd.start_timeline(path, mark_cycles=False)

    def stop_timeline(self) -> None:
        hvd.stop_timeline()

    def barrier(self) -> None:
        hvd.barrier()

    def shutdown(self) -> None:
        hvd.shutdown()
