"""The DDP engine: ``torchrun`` starts the ranks, PyTorch's DistributedDataParallel averages the
gradients over NCCL on GPU and Gloo on CPU. Imported only when chosen (``--engine ddp``); it
needs nothing but torch.

Started without torchrun (no ``RANK`` in the environment) it runs as a world of one over an
in-memory store, as the Horovod engine does without horovodrun.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import inspect
import logging
import os
import signal
import sys
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from training.engine import GradientOptions, UsageError, World

log = logging.getLogger("training")

# torch 2.13 renamed DDP's broadcast_buffers (deprecated there, with a warning) to
# forward_sync_buffers; torch 2.11, in the CUDA images, knows only the old name.
_BUFFER_SYNC = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else "broadcast_buffers"
)


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it on the CPU: an optimizer state travels as a pickle,
    and a CUDA tensor in it would land on the sender's GPU index on every receiver."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _die_with_launcher() -> None:
    """Be killed when the torchrun that started this rank dies.

    torchrun starts each rank in a session of its own, so a launcher killed outright (a
    task killed by its process group, an out-of-memory kill) would leave its ranks training
    and writing checkpoints beside the next attempt's. Linux only; elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != launcher:  # it died before the request took effect
        os._exit(1)


def _torchrun_store(rank: int, size: int) -> dist.Store:
    """The store the ranks of this attempt meet in: torchrun's, under a prefix of the attempt.

    torchrun keeps one store for all the attempts of a job, and a restarted attempt that joins
    Gloo through ``env://`` reads the dead attempt's addresses from it (both ranks then fail
    with "Connection refused"); a prefix per restart keeps each attempt's keys apart.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        size,
        is_master=rank == 0 and not agent_store,
        timeout=timedelta(minutes=10),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"retrain/attempt-{attempt}", store)


class ShardedOptimizer(ZeroRedundancyOptimizer):
    """PyTorch's ZeRO stage 1: each rank keeps the optimizer state (momentum) of its share of
    the parameters, steps that share, and broadcasts the updated weights to the other ranks.

    Checkpoints stay engine-neutral: :meth:`DdpEngine.optimizer_state` gathers the shards into
    a plain optimizer's state dict on rank 0. Loading keeps only this rank's shard, so rank 0
    also remembers the whole state it loaded from a checkpoint, for the other ranks to take
    theirs from (``DdpEngine.broadcast_state``).
    """

    loaded: dict[str, Any] | None = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = copy.deepcopy(state_dict)
        super().load_state_dict(copy.deepcopy(state_dict))  # it blanks the other ranks' shares

    def state_dict(self) -> dict[str, Any]:
        """The whole state, once ``consolidate_state_dict`` gathered it here; the gathered
        shares are let go after, or rank 0 would keep a whole copy beside its own share."""
        try:
            return super().state_dict()
        finally:
            self._all_state_dicts: list[dict[str, Any]] = []


def _shard(optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
    """``optimizer``'s parameters and settings, its state partitioned across the ranks."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return ShardedOptimizer(params, optimizer_class=type(optimizer), **optimizer.defaults)


class DdpEngine:
    name = "ddp"
    contiguous_tensors = False  # DDP's buckets follow each weight's layout

    def __init__(self) -> None:
        self.size = 1

    def start(self, timeline: bool) -> tuple[int, int, int, int]:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:  # started by torchrun
            _die_with_launcher()
            rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = _torchrun_store(rank, size)
            dist.init_process_group(backend, store=store, rank=rank, world_size=size)
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            local_rank, local_size = 0, 1
        self.size = dist.get_world_size()
        return dist.get_rank(), self.size, local_rank, local_size

    def allreduce_sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def gather_objects(self, value: object) -> list[object]:
        gathered: list[object] = [None] * self.size
        dist.all_gather_object(gathered, value)
        return gathered

    def broadcast_object(self, value: object) -> object:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sync_buffers(self, model: nn.Module) -> None:
        for buffer in model.buffers():
            if buffer.is_floating_point():
                dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
                buffer.div_(self.size)
            else:
                dist.broadcast(buffer, src=0)

    def check_options(self, world: World, options: GradientOptions) -> None:
        if options.adasum:
            raise UsageError("--adasum is Horovod's: use --engine horovod or drop --adasum")
        if options.sync_batchnorm and world.device.type != "cuda":
            raise UsageError(
                "--sync-batchnorm needs GPUs (torch's SyncBatchNorm runs on CUDA only): "
                "drop it on CPU"
            )

    def wrap(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, options: GradientOptions
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """DDP around the model (the optimizer is the plain one).

        Buffers are not broadcast at every forward: like Horovod's runs, the epoch ends with
        their average (``sync_buffers``), and evaluation runs the bare model, whose ranks see
        different numbers of batches.
        """
        if options.sync_batchnorm:
            # In place for the model's children: the parameters (and so the optimizer's
            # references) stay the same objects.
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        cuda = next(model.parameters()).is_cuda
        net = DistributedDataParallel(
            model,
            device_ids=[torch.cuda.current_device()] if cuda else None,
            **cast(dict[str, Any], {_BUFFER_SYNC: False}),
        )
        if options.fp16_allreduce:
            # The counterpart of Horovod's Compression.fp16: buckets travel as fp16, are
            # averaged, and come back in the parameters' precision.
            net.register_comm_hook(None, cast(Any, default_hooks.fp16_compress_hook))
        if options.shard_optimizer_state:
            return net, _shard(optimizer)
        return net, optimizer

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Rank 0's optimizer state (momentum included) and then its weights and buffers.

        Sharded, rank 0 hands on the whole state it loaded from a checkpoint (none on a fresh
        start), and each other rank keeps its own share of it."""
        root = dist.get_rank() == 0
        if isinstance(optimizer, ShardedOptimizer):
            state = self.broadcast_object(optimizer.loaded if root else None)
            optimizer.loaded = None
        else:
            state = self.broadcast_object(_to_cpu(optimizer.state_dict()) if root else None)
        if not root and state is not None:
            optimizer.load_state_dict(cast(dict[str, Any], state))
            if isinstance(optimizer, ShardedOptimizer):
                optimizer.loaded = None  # its own share is what this rank keeps
        for tensor in model.state_dict().values():
            if tensor.is_contiguous():
                dist.broadcast(tensor, src=0)
            else:  # channels-last weights: collectives take contiguous tensors
                flat = tensor.contiguous()
                dist.broadcast(flat, src=0)
                tensor.copy_(flat)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """Sharded, every rank sends its share to rank 0 (a collective); else rank 0's own."""
        if isinstance(optimizer, ShardedOptimizer):
            optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if dist.get_rank() == 0 else None

    def accumulating(self, net: nn.Module, sync: bool) -> AbstractContextManager[None]:
        if sync or not isinstance(net, DistributedDataParallel):
            return nullcontext()
        return cast(AbstractContextManager[None], net.no_sync())

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> None:
        """DDP averaged the (scaled) gradients during backward; GradScaler unscales them and
        skips the step on overflow, identically on every rank."""
        if scaler is None:
            optimizer.step()
            return
        scaler.step(optimizer)
        scaler.update()

    def lr_scale(self, world: World, options: GradientOptions) -> float:
        return float(world.size * options.backward_passes_per_step)

    def start_timeline(self, path: str) -> None:
        if dist.get_rank() == 0:
            log.warning("--timeline is Horovod's: no timeline is written under --engine ddp")

    def stop_timeline(self) -> None:
        pass

    def barrier(self) -> None:
        dist.barrier()

    def shutdown(self) -> None:
        # A DDP model left in a reference cycle keeps the process group alive until the
        # interpreter is torn down, where Gloo's threads then abort the process: collect it now.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
