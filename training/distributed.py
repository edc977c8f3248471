"""The Horovod pieces of the trainer, kept apart so the training loop reads as plain PyTorch.

Horovod is initialised in every run, single process included (world size 1), so the same code
path is exercised by a laptop smoke run and by a 64-GPU Batch job.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from dataclasses import dataclass

import horovod.torch as hvd
import torch
from torch import nn

log = logging.getLogger("training")


def usable_cpus() -> int:
    """The cores this process may run on: a node's or container's CPU set, not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity (macOS)
        return os.cpu_count() or 1


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


def init(timeline: bool = False) -> World:
    """Start Horovod, pin one GPU per local rank, and share the CPU fairly between ranks.

    ``timeline`` lets the run start and stop a Horovod timeline itself (only the epochs, not
    start-up), which Horovod allows only when asked for before init.
    """
    if timeline:
        os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")
    hvd.init()
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
        # Every rank on a node otherwise starts one thread per core: N ranks x N threads
        # oversubscribes the CPU and is several times slower than one share each.
        torch.set_num_threads(max(1, usable_cpus() // hvd.local_size()))
    world = World(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), device)
    _configure_logging(world)
    return world


def _configure_logging(world: World) -> None:
    """Rank 0 logs progress; the others log only warnings and errors, each tagged by rank."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[rank {world.rank}] %(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO if world.is_root else logging.WARNING)


def gather_objects(value: object) -> list[object]:
    """Every rank's value, in rank order, on every rank."""
    return list(hvd.allgather_object(value))


def broadcast_object(value: object) -> object:
    return hvd.broadcast_object(value, root_rank=0)


def allreduce_sum(values: list[float], name: str) -> list[float]:
    """Sum a few scalars across ranks (exact counts, unlike averaging per-rank means)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    return [float(v) for v in hvd.allreduce(tensor, op=hvd.Sum, name=name)]


def sync_buffers(model: nn.Module) -> None:
    """Average BatchNorm running statistics across ranks, broadcast integer buffers.

    Buffers are not gradients, so Horovod never touches them: without this each rank ends an
    epoch with its own statistics and rank 0's saved model would not match distributed eval.
    """
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point():
            hvd.allreduce_(buffer, op=hvd.Average, name=f"buffer.{name}")
        else:
            hvd.broadcast_(buffer, root_rank=0, name=f"buffer.{name}")


def state_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor in a state dict, in key order: equal digests, equal weights."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        digest.update(key.encode())
        digest.update(state_dict[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def distributed_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    *,
    fp16_allreduce: bool,
    backward_passes_per_step: int,
    adasum: bool,
) -> torch.optim.Optimizer:
    compression = hvd.Compression.fp16 if fp16_allreduce else hvd.Compression.none
    return hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        op=hvd.Adasum if adasum else hvd.Average,
    )


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """One step of ``optimizer`` (Horovod's DistributedOptimizer) on the averaged gradients.

    With mixed precision, Horovod averages the (scaled) gradients first; GradScaler then
    unscales them and skips the step on overflow, identically on every rank since the
    gradients are identical.
    """
    if scaler is None:
        optimizer.step()
        return
    optimizer.synchronize()  # type: ignore[attr-defined]
    with optimizer.skip_synchronize():  # type: ignore[attr-defined]
        scaler.step(optimizer)
    scaler.update()


def adasum_available(world: World) -> bool:
    """Horovod implements Adasum over MPI (CPU) or NCCL (GPU), not over Gloo alone."""
    return bool(hvd.mpi_enabled() or (world.device.type == "cuda" and hvd.nccl_built()))


def lr_scale(world: World, backward_passes_per_step: int, adasum: bool) -> float:
    """How much the single-worker learning rate grows with the effective batch.

    Averaging gradients over N workers x k passes is an N*k times larger batch (Goyal et al.:
    scale the rate linearly). Adasum combines gradients adaptively and needs no scaling, except
    across the local GPUs that NCCL sums hierarchically.
    """
    if adasum:
        return float(world.local_size) if world.device.type == "cuda" and hvd.nccl_built() else 1.0
    return float(world.size * backward_passes_per_step)


def broadcast_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make every rank start from rank 0's weights and optimizer state (fresh or resumed).

    Optimizer state goes first: on a rank whose optimizer has no state yet, Horovod creates it
    by taking one step with zero gradients, and weight decay makes that step move the weights.
    When resuming, only rank 0 has state, so broadcasting weights first would let the other
    ranks drift; the weights' broadcast must come last.
    """
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)


def start_timeline(path: str) -> None:
    hvd.start_timeline(path, mark_cycles=False)


def stop_timeline() -> None:
    hvd.stop_timeline()


def shutdown() -> None:
    hvd.shutdown()
