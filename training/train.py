"""Data-parallel trainer: ``[horovodrun -np N -H localhost:N --gloo] python -m training.train``.

The command line is a contract shared with the pipeline's task specs; add options, never
rename them. Rank 0 owns every file it writes (checkpoints, model, metrics, TensorBoard), and
writes each atomically, so a job killed at any moment leaves either the old file or the new.
Each epoch ends with one machine-readable ``PROGRESS {json}`` line on stdout for orchestrators.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from training import checkpoint as ckpt
from training import distributed as dist
from training.atomic import atomic_write_json
from training.data import DatasetError, DatasetInfo, SplitData, open_dataset
from training.distributed import World
from training.models import build_model, default_input_size
from training.shards import ShardSplit

log = dist.log


class NonFiniteLossError(RuntimeError):
    """Training diverged; continuing would only write a useless model."""


class UsageError(ValueError):
    """An option this Horovod build or machine cannot honour."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.train", description=__doc__)
    p.add_argument(
        "--data-dir", required=True, help="image folders, CIFAR-10 batches, or synthetic:N"
    )
    p.add_argument("--output-dir", required=True, type=Path)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument(
        "--lr", type=float, default=0.05, help="single-worker rate; scaled by world size"
    )
    p.add_argument("--model", default="cnn", choices=["cnn", "resnet18", "resnet50"])
    p.add_argument("--checkpoint-dir", type=Path, help="default: <output-dir>/checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeline", action="store_true", help="write a Horovod timeline")
    p.add_argument("--image-size", type=int, help="default: the model's own input size")
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16")
    p.add_argument("--backward-passes-per-step", type=int, default=1)
    p.add_argument("--adasum", action="store_true", help="Adasum instead of averaging")
    p.add_argument("--no-amp", action="store_true", help="disable mixed precision on GPU")
    p.add_argument("--workers", type=int, default=-1, help="data loader processes; -1: auto")
    p.add_argument(
        "--no-verify-images",
        action="store_true",
        help="skip decoding every image at start (when a data gate already did)",
    )
    p.add_argument("--keep-checkpoints", type=int, default=3)
    p.add_argument("--log-every", type=int, default=50, help="steps between loss checks")
    args = p.parse_args(argv)
    for name in (
        "epochs",
        "batch_size",
        "backward_passes_per_step",
        "keep_checkpoints",
        "log_every",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.lr > 0 or not math.isfinite(args.lr):
        p.error("--lr must be a positive number")
    return args


# ---------------------------------------------------------------------------- helpers


class ShardSampler(Sampler[int]):
    """Every rank takes indices rank, rank+N, ...: no padding, so eval counts are exact."""

    def __init__(self, length: int, world: World) -> None:
        self.indices = list(range(world.rank, length, world.size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


# Measured (bench/loading.py on a 16-core H100 machine): 3 KB rows (32 px) load 2x faster in
# the training process than through 8 worker processes; 150 KB rows (224 px) 1.8x slower.
IN_PROCESS_ROW_BYTES = 32 * 1024


def _loader_workers(requested: int, world: World, split: SplitData) -> int:
    if requested >= 0:
        return requested
    if isinstance(split.dataset, ShardSplit) and split.dataset.row_bytes <= IN_PROCESS_ROW_BYTES:
        return 0  # small decoded rows: a copy is cheaper than passing it between processes
    if len(split) < 2048:
        return 0  # starting worker processes costs more than decoding a few images
    per_rank = dist.usable_cpus() // world.local_size
    return max(0, min(8, per_rank - 1))


def _loader(
    split: SplitData, sampler: Sampler[int], args: argparse.Namespace, world: World
) -> DataLoader[Any]:
    workers = _loader_workers(args.workers, world, split)
    return DataLoader(
        split.dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=world.device.type == "cuda",
        persistent_workers=workers > 0,
    )


def _rng_state() -> dict[str, Any]:
    name, keys, *rest = cast(tuple[Any, ...], np.random.get_state())
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses: store a list.
        "numpy": (name, keys.tolist(), *rest),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Schedule:
    """Linear warm-up from the single-worker rate to the scaled rate, then cosine decay.

    Warm-up avoids the early instability of a large effective batch (Goyal et al. 2017).
    """

    base_lr: float
    peak_lr: float
    warmup_steps: int
    total_steps: int

    def lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base_lr + (self.peak_lr - self.base_lr) * step / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.peak_lr * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------- train / eval


@dataclass
class Trainer:
    args: argparse.Namespace
    world: World
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    scaler: torch.amp.GradScaler | None
    loss_fn: nn.Module
    # Wall-clock time of this process's first optimizer step: with the time a launcher started,
    # it gives the launch overhead (bench.nodes).
    first_step_time: float | None = None

    def _prepare(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        images = images.to(self.world.device, non_blocking=True).float()
        if self.world.device.type == "cuda":
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels.to(self.world.device, non_blocking=True)

    def _forward(self, images: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.world.device.type, enabled=self.scaler is not None):
            return self.model(images)

    def train_epoch(
        self, epoch: int, loader: DataLoader[Any], step: int
    ) -> tuple[dict[str, float], int]:
        """One pass over this rank's shard; returns the epoch's summed stats and the next step."""
        self.model.train()
        k = self.args.backward_passes_per_step
        # With gradient accumulation, a trailing group of fewer than k batches would leave
        # Horovod's per-parameter pass counters out of step with the other ranks: drop it.
        usable = len(loader) - len(loader) % k
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.world.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.world.device)
        seen = 0
        started = time.perf_counter()
        for i, (images, labels) in enumerate(loader):
            if i >= usable:
                break
            if i % k == 0:
                for group in self.optimizer.param_groups:
                    group["lr"] = self.schedule.lr(step)
            images, labels = self._prepare(images, labels)
            logits = self._forward(images)
            loss = self.loss_fn(logits.float(), labels)
            scaled = loss / k
            if self.scaler is not None:
                self.scaler.scale(scaled).backward()
            else:
                scaled.backward()
            if (i + 1) % k == 0:
                self._step()
                step += 1
            loss_sum += loss.detach().double() * len(labels)
            correct += (logits.argmax(1) == labels).sum().double()
            seen += len(labels)
            if (i + 1) % self.args.log_every == 0:
                self._check_finite(epoch, i + 1, loss_sum, seen)
        if self.world.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        total_loss, total_correct, total_seen, rank_seconds = dist.allreduce_sum(
            [float(loss_sum), float(correct), float(seen), seconds], name=f"train.{epoch}"
        )
        if not math.isfinite(total_loss):
            raise NonFiniteLossError(
                f"training loss became {total_loss} in epoch {epoch}; lower --lr "
                f"(now {self.args.lr}) or check the data"
            )
        stats = {
            "train_loss": total_loss / max(1.0, total_seen),
            "train_accuracy": total_correct / max(1.0, total_seen),
            "images": total_seen,
            "seconds": rank_seconds / self.world.size,
        }
        return stats, step

    def _step(self) -> None:
        if self.scaler is not None:
            # Horovod averages the (scaled) gradients first; GradScaler then unscales and skips
            # the step on overflow, identically on every rank since gradients are identical.
            self.optimizer.synchronize()  # type: ignore[attr-defined]
            with self.optimizer.skip_synchronize():  # type: ignore[attr-defined]
                self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        if self.first_step_time is None:
            self.first_step_time = time.time()

    def _check_finite(self, epoch: int, batch: int, loss_sum: torch.Tensor, seen: int) -> None:
        """Agree across ranks whether the loss is still finite, so all stop together."""
        total, count = dist.allreduce_sum([float(loss_sum), float(seen)], name="loss.check")
        if not math.isfinite(total):
            raise NonFiniteLossError(
                f"training loss became {total} at epoch {epoch}, batch {batch}; lower --lr "
                f"(now {self.args.lr}) or check the data"
            )
        log.info("epoch %d batch %d: mean loss so far %.4f", epoch, batch, total / max(1.0, count))

    @torch.no_grad()
    def evaluate(self, split: SplitData, name: str) -> dict[str, float]:
        self.model.eval()
        loader = _loader(split, ShardSampler(len(split), self.world), self.args, self.world)
        loss_sum = correct = seen = 0.0
        for images, labels in loader:
            images, labels = self._prepare(images, labels)
            logits = self._forward(images).float()
            loss_sum += float(self.loss_fn(logits, labels)) * len(labels)
            correct += float((logits.argmax(1) == labels).sum())
            seen += len(labels)
        total_loss, total_correct, total_seen = dist.allreduce_sum(
            [loss_sum, correct, seen], name=f"eval.{name}"
        )
        return {
            "loss": total_loss / max(1.0, total_seen),
            "accuracy": total_correct / max(1.0, total_seen),
        }


# ---------------------------------------------------------------------------- checkpoints


def _resume(
    args: argparse.Namespace,
    world: World,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
) -> tuple[int, list[dict[str, Any]], int | None]:
    """Rank 0 loads the newest valid checkpoint; its epoch and history go to every rank.

    Weights and optimizer state reach the other ranks through the broadcast that follows,
    so only one process reads the (possibly remote) checkpoint file.
    """
    found = (
        ckpt.newest_valid_checkpoint(
            args.checkpoint_dir, lambda state: ckpt.mismatch(state, model, optimizer)
        )
        if world.is_root
        else None
    )
    rngs: list[Any] | None = None
    if found is not None:
        model.load_state_dict(found["model"])
        optimizer.load_state_dict(found["optimizer"])
        if scaler is not None and found.get("scaler"):
            scaler.load_state_dict(found["scaler"])
        rngs = found.get("rng")
    meta = (found["epoch"], found["history"], rngs) if found is not None else (0, [], None)
    done, history, rngs = cast(tuple[int, list[dict[str, Any]], Any], dist.broadcast_object(meta))
    if rngs is not None and len(rngs) == world.size:
        _set_rng_state(rngs[world.rank])
    return done + 1, history, (done or None)


def _save_checkpoint(
    args: argparse.Namespace,
    world: World,
    epoch: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    history: list[dict[str, Any]],
) -> None:
    rngs = dist.gather_objects(_rng_state())  # every rank's, so each resumes its own stream
    if not world.is_root:
        return
    state = {
        "format_version": ckpt.FORMAT_VERSION,
        "epoch": epoch,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": rngs,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "history": history,
    }
    ckpt.atomic_save(state, ckpt.checkpoint_path(args.checkpoint_dir, epoch))
    ckpt.prune_checkpoints(args.checkpoint_dir, args.keep_checkpoints)


# ---------------------------------------------------------------------------- main


def _progress(record: dict[str, Any]) -> None:
    print("PROGRESS " + json.dumps(record), flush=True)


def run(args: argparse.Namespace, world: World) -> dict[str, Any]:
    wall_start = time.perf_counter()
    if args.adasum and not dist.adasum_available(world):
        raise UsageError(
            "--adasum needs Horovod with MPI (CPU) or NCCL (GPU); this build has "
            "Gloo only: drop --adasum or use the training image's Horovod"
        )
    args.checkpoint_dir = args.checkpoint_dir or args.output_dir / "checkpoints"
    image_size = args.image_size or default_input_size(args.model)
    _seed_everything(args.seed + world.rank)

    info: DatasetInfo = open_dataset(
        args.data_dir,
        image_size,
        seed=args.seed,
        verify_images=not args.no_verify_images,
        rank=world.rank,
        world=world.size,
        gather=dist.gather_objects,  # type: ignore[arg-type]
    )
    train_split = info.splits["train"]
    skipped = sorted({s for split in info.splits.values() for s in split.skipped})
    for line in skipped[:20]:
        log.warning("skipped %s", line)
    if len(skipped) > 20:
        log.warning("... and %d more damaged images", len(skipped) - 20)
    log.info(
        "data: %s, %d classes, %s; %d damaged images skipped",
        info.kind,
        len(info.class_names),
        ", ".join(f"{k}={len(v)}" for k, v in info.splits.items()),
        len(skipped),
    )
    for note in info.notes:
        log.info("data: %s", note)

    # channels_last goes on the inputs only: convolutions then run in NHWC, while weights and
    # so gradients stay contiguous, which Horovod's in-place collectives require.
    model = build_model(args.model, len(info.class_names)).to(world.device)
    scale = dist.lr_scale(world, args.backward_passes_per_step, args.adasum)
    base = torch.optim.SGD(
        model.parameters(),
        lr=args.lr * scale,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
    )
    use_amp = world.device.type == "cuda" and not args.no_amp
    scaler = torch.amp.GradScaler("cuda") if use_amp else None

    start_epoch, history, resumed_from = _resume(args, world, model, base, scaler)
    if resumed_from:
        log.info("resuming from checkpoint-%d.pt: starting at epoch %d", resumed_from, start_epoch)
    dist.broadcast_state(model, base)
    optimizer = dist.distributed_optimizer(
        base,
        model,
        fp16_allreduce=args.fp16_allreduce,
        backward_passes_per_step=args.backward_passes_per_step,
        adasum=args.adasum,
    )

    sampler: DistributedSampler[Any] = DistributedSampler(
        train_split.dataset,
        num_replicas=world.size,
        rank=world.rank,
        shuffle=True,
        seed=args.seed,
    )
    train_loader = _loader(train_split, sampler, args, world)
    steps_per_epoch = len(train_loader) // args.backward_passes_per_step
    if steps_per_epoch == 0:
        raise DatasetError(
            f"train split has {len(train_split)} images: too few for batch size "
            f"{args.batch_size} x {world.size} workers x {args.backward_passes_per_step} passes"
        )
    schedule = Schedule(
        args.lr,
        args.lr * scale,
        int(args.warmup_epochs * steps_per_epoch),
        args.epochs * steps_per_epoch,
    )
    trainer = Trainer(args, world, model, optimizer, schedule, scaler, nn.CrossEntropyLoss())

    writer = _tensorboard(args, world)
    if args.timeline:
        dist.start_timeline(str(args.output_dir / "timeline.json"))
    step = (start_epoch - 1) * steps_per_epoch
    for epoch in range(start_epoch, args.epochs + 1):
        sampler.set_epoch(epoch)
        stats, step = trainer.train_epoch(epoch, train_loader, step)
        dist.sync_buffers(model)
        record: dict[str, Any] = {
            "epoch": epoch,
            "epochs": args.epochs,
            **stats,
            "lr": schedule.lr(step - 1),
            "images_per_sec": stats["images"] / max(stats["seconds"], 1e-9),
        }
        if "val" in info.splits:
            val = trainer.evaluate(info.splits["val"], f"val.{epoch}")
            record["val_accuracy"] = val["accuracy"]
        history.append(record)
        _save_checkpoint(args, world, epoch, model, base, scaler, history)
        if world.is_root:
            _progress(record)
            if writer is not None:
                for key in ("train_loss", "train_accuracy", "val_accuracy", "lr", "images_per_sec"):
                    if key in record:
                        writer.add_scalar(key.replace("_", "/", 1), record[key], epoch)
                writer.flush()
    if args.timeline:
        dist.stop_timeline()

    test = trainer.evaluate(info.splits["test"], "test")
    digests = dist.gather_objects(dist.state_digest(model.state_dict()))
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks ended with different weights: {digests}")
    images = sum(r["images"] for r in history)
    seconds = sum(r["seconds"] for r in history)
    metrics = {
        "epochs": history,
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "images_per_sec": images / seconds if seconds else None,
        "images_per_sec_per_worker": images / seconds / world.size if seconds else None,
        "world_size": world.size,
        "wall_seconds": time.perf_counter() - wall_start,
        "first_step_time": trainer.first_step_time,
        "model": args.model,
        "input_size": image_size,
        "class_names": info.class_names,
        "dataset": {"kind": info.kind, **{f"num_{k}": len(v) for k, v in info.splits.items()}},
        "skipped_images": {"count": len(skipped), "files": skipped},
        "resumed_from_epoch": resumed_from,
        "weights_digest_per_rank": digests,
        "device": str(world.device),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    if world.is_root:
        ckpt.atomic_save(
            {
                "state_dict": model.state_dict(),
                "class_names": info.class_names,
                "model_name": args.model,
                "input_size": image_size,
            },
            args.output_dir / "model.pt",
        )
        atomic_write_json(metrics, args.output_dir / "metrics.json")
        if writer is not None:
            writer.add_scalar("test/accuracy", test["accuracy"], args.epochs)
            writer.close()
        log.info(
            "test accuracy %.4f; %.1f images/sec over %d workers; outputs in %s",
            test["accuracy"],
            metrics["images_per_sec"] or 0.0,
            world.size,
            args.output_dir,
        )
    return metrics


def _tensorboard(args: argparse.Namespace, world: World) -> Any:
    if not world.is_root:
        return None
    from torch.utils.tensorboard import SummaryWriter  # heavy: import only on the writing rank

    return SummaryWriter(log_dir=str(args.output_dir / "tensorboard"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = dist.init(timeline=args.timeline)
    if world.is_root:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    try:
        run(args, world)
    except (DatasetError, NonFiniteLossError, UsageError) as exc:
        print(f"[rank {world.rank}] error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
