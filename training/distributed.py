"""The data-parallel engine behind the trainer, chosen once where the process group starts.

Two engines keep one contract: Horovod under ``horovodrun`` (the default) and PyTorch's
DistributedDataParallel under ``torchrun`` (``--engine ddp``). :func:`init` starts the chosen
one; the functions below hand each collective to it, so the training loop reads as plain
PyTorch and never asks which engine runs it. Each engine lives in a module of its own
(``training.engine_horovod``, ``training.engine_ddp``), imported only when chosen: a user of
``ddp`` needs no Horovod build.

An engine is started in every run, single process included (world size 1), so the same code
path is exercised by a laptop smoke run and by a 64-GPU Batch job.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from training.engine import Engine, GradientOptions, UsageError, World

__all__ = ["Engine", "GradientOptions", "UsageError", "World"]  # the contract, handed on

log = logging.getLogger("training")


def usable_cpus() -> int:
    """The cores this process may run on: a node's or container's CPU set, not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity (macOS)
        return os.cpu_count() or 1


_active: Engine | None = None
_world: World | None = None


def engine() -> Engine:
    if _active is None:
        raise RuntimeError("no data-parallel engine started: call training.distributed.init")
    return _active


def _new_engine(name: str) -> Engine:
    """The engine called ``name``, checked against the launcher that started this process:
    ranks of one launcher that each believe they are alone would all write the outputs."""
    under_horovodrun = "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if name == "ddp":
        if under_horovodrun:
            raise UsageError(
                "--engine ddp was started by horovodrun (or mpirun): start it with torchrun, "
                "or use --engine horovod"
            )
        from training.engine_ddp import DdpEngine

        return DdpEngine()
    if name == "horovod":
        if under_torchrun:
            raise UsageError(
                "--engine horovod was started by torchrun: start it with horovodrun, "
                "or use --engine ddp"
            )
        from training.engine_horovod import HorovodEngine

        return HorovodEngine()
    raise UsageError(f"--engine {name!r} is unknown; choose horovod or ddp")


def init(engine_name: str = "horovod", timeline: bool = False) -> World:
    """Start ``engine_name``, pin one GPU per local rank, share the CPU fairly between ranks.

    ``timeline`` lets a Horovod run start and stop a timeline itself (only the epochs, not
    start-up), which Horovod allows only when asked for before init.
    """
    global _active, _world
    chosen = _new_engine(engine_name)
    if torch.cuda.is_available():
        # Before the process group starts: NCCL binds the current device.
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("HOROVOD_LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
    rank, size, local_rank, local_size = chosen.start(timeline)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        # Every rank on a node otherwise starts one thread per core: N ranks x N threads
        # oversubscribes the CPU and is several times slower than one share each.
        torch.set_num_threads(max(1, usable_cpus() // local_size))
    world = World(rank, size, local_rank, local_size, device)
    _active, _world = chosen, world
    _configure_logging(world)
    log.info("engine: %s, %d process(es) on %s", chosen.name, size, device.type)
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
    return engine().gather_objects(value)


def broadcast_object(value: object) -> object:
    """Rank 0's value on every rank."""
    return engine().broadcast_object(value)


def allreduce_sum(values: list[float], name: str) -> list[float]:
    """Sum a few scalars across ranks (exact counts, unlike averaging per-rank means)."""
    device = _world.device if _world is not None else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    return [float(v) for v in engine().allreduce_sum(tensor, name).cpu()]


def sync_buffers(model: nn.Module) -> None:
    """Average BatchNorm running statistics across ranks, broadcast integer buffers.

    Buffers are not gradients, so neither engine averages them (DDP is told not to broadcast
    them at every forward): without this each rank ends an epoch with its own statistics and
    rank 0's saved model would not match distributed eval.
    """
    engine().sync_buffers(model)


def state_digest(state_dict: dict[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor in a state dict, in key order: equal digests, equal weights."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        digest.update(key.encode())
        digest.update(state_dict[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def contiguous_tensors() -> bool:
    """Whether the running engine's collectives take contiguous tensors only."""
    return engine().contiguous_tensors


def check_options(world: World, options: GradientOptions) -> None:
    """Refuse, by name, an option the running engine or this machine cannot honour."""
    engine().check_options(world, options)


def wrap(
    model: nn.Module, optimizer: torch.optim.Optimizer, options: GradientOptions
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The module the training step runs and the optimizer that steps it.

    Horovod wraps the optimizer (the module is the model itself); DDP wraps the module (the
    optimizer is the plain one). Either way the model's and the stepping optimizer's state
    dicts are plain PyTorch ones, so a checkpoint written under one engine resumes under the
    other.
    """
    return engine().wrap(model, optimizer, options)


def accumulating(net: nn.Module, sync: bool) -> AbstractContextManager[None]:
    """Around one batch's forward and backward: ``sync`` false for the batches whose gradients
    only accumulate (DDP's ``no_sync``; Horovod counts the passes itself)."""
    return engine().accumulating(net, sync)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """One step of ``optimizer`` on the gradients averaged across ranks (unscaled first with
    mixed precision: a skipped step on overflow is skipped on every rank alike)."""
    engine().optimizer_step(optimizer, scaler)


def lr_scale(world: World, options: GradientOptions) -> float:
    """How much the single-worker learning rate grows with the effective batch.

    Averaging gradients over N workers x k passes is an N*k times larger batch (Goyal et al.:
    scale the rate linearly); the engine may know better (Horovod's Adasum).
    """
    return engine().lr_scale(world, options)


def broadcast_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make every rank start from rank 0's weights and optimizer state (fresh or resumed)."""
    engine().broadcast_state(model, optimizer)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The whole optimizer state, as a plain optimizer's state dict, on rank 0 (None on the
    others; every rank calls it): gathered from the ranks when they each hold a shard of it,
    so a checkpoint is the same whichever engine and options wrote it."""
    return engine().optimizer_state(optimizer)


def start_timeline(path: str) -> None:
    engine().start_timeline(path)


def stop_timeline() -> None:
    engine().stop_timeline()


def barrier() -> None:
    engine().barrier()


def shutdown(*, together: bool) -> None:
    """Leave the process group.

    ``together`` when every rank reached the end of the job: the ranks meet first, because a
    rank that closes its connections while a peer is still in its last collective can abort
    that peer (Gloo: "terminate called without an active exception") and fail a finished job.
    After an error the ranks may not all get here, so none waits for the others.
    """
    global _active, _world
    if _active is not None:
        if together:
            _active.barrier()
        _active.shutdown()
    _active = _world = None
