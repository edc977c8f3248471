"""Data-parallel trainer: ``[horovodrun -np N -H localhost:N --gloo] python -m training.train``,
or with ``--engine ddp`` ``[torchrun --standalone --nproc-per-node N] -m training.train``.

The command line (defined in ``training.args``) is a contract shared with the pipeline's task
specs; add options, never rename them. Rank 0 owns every file it writes (checkpoints, model,
metrics, TensorBoard), and writes each atomically, so a job killed at any moment leaves either
the old file or the new. Each epoch ends with one machine-readable ``PROGRESS {json}`` line on
stdout for orchestrators: the epoch's record plus ``resumed_from``, the checkpoint's epoch this
attempt resumed from (null on a fresh start). An attempt that resumes after the last epoch
trains nothing and prints one line without ``epoch``: ``{"epochs": E, "resumed_from": E}``.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TextIO, cast

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from common.atomic import atomic_write_json, file_md5
from imagedata import augment
from imagedata.batches import ShardBatches
from imagedata.data import open_dataset
from imagedata.dataset import DatasetError, DatasetInfo, SplitData
from imagedata.shards import ShardSplit
from training import checkpoint as ckpt
from training import checkpoint_policy as moments
from training import distributed as dist
from training import profiling
from training import speed as fast
from training.args import (
    DEFAULT_BACKBONE_LR_SCALE,
    DEFAULT_HEAD_ONLY_EPOCHS,
    TrainerArgs,
    parse_trainer_args,
)
from training.distributed import GradientOptions, UsageError, World
from training.models import MODEL_FORMAT_VERSION, build_model, upgrade_state_dict
from training.onnx_export import ExportError, check_images, write_onnx
from training.preemption import Notice, PreemptionWatcher
from training.stopping import StoppingRule, hold_out, metric_value
from training.weights import InitFromError, carry, network_parameters, read_weights

log = dist.log


class NonFiniteLossError(RuntimeError):
    """Training diverged; continuing would only write a useless model."""


# ---------------------------------------------------------------------------- helpers


class EvalSampler(Sampler[int]):
    """Every rank takes indices rank, rank+N, ... (of ``indices``, when given: a slice of the
    split): no padding (unlike DistributedSampler), so every image is evaluated exactly once
    and the counts summed across ranks are exact."""

    def __init__(self, length: int, world: World, indices: list[int] | None = None) -> None:
        chosen = indices if indices is not None else list(range(length))
        self.indices = chosen[world.rank :: world.size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class SliceSampler(DistributedSampler[Any]):
    """A DistributedSampler over ``indices`` of a split (the train split less the slice held
    out for early stopping): this rank's shuffled share of them, as indices into the split."""

    def __init__(self, indices: list[int], world: World, seed: int) -> None:
        super().__init__(indices, num_replicas=world.size, rank=world.rank, shuffle=True, seed=seed)  # type: ignore[arg-type]
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return (self.indices[i] for i in super().__iter__())


class ResumingSampler(Sampler[int]):
    """This rank's share of an epoch in ``DistributedSampler``'s order (a function of the seed,
    the epoch and the images trained on: the whole train split, or what a ``SliceSampler``
    leaves of it), from a position: an attempt that resumes inside an epoch trains exactly the
    batches its checkpoint had not, in the order the first attempt would have."""

    def __init__(self, inner: DistributedSampler[Any]) -> None:
        self.inner = inner
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """The order of ``epoch``, its first ``skip`` indices left out."""
        self.inner.set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.inner)[self.skip :])

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)


@dataclass(frozen=True)
class EpochSums:
    """What one rank has summed of an epoch so far (``training.checkpoint.PARTIAL_KEYS``)."""

    loss_sum: float
    correct: float
    seen: int
    seconds: float


@dataclass(frozen=True)
class EpochStart:
    """Where an epoch resumes: ``batch`` of its batches trained, this rank's sums of them, and
    its random streams as they were then (set once the epoch's loader has started: starting it
    draws a seed, which the first attempt drew before its first batch, not at this one)."""

    batch: int
    sums: EpochSums
    rng: dict[str, Any] | None = None


AfterBatch = Callable[[int, int, Callable[[], EpochSums]], None]


def _loader_workers(requested: int, world: World, split: SplitData) -> int:
    if requested >= 0:
        return requested
    if len(split) < 2048:
        return 0  # starting worker processes costs more than decoding a few images
    per_rank = dist.usable_cpus() // world.local_size
    return max(0, min(8, per_rank - 1))


Batches = DataLoader[Any] | ShardBatches


def _loader(
    split: SplitData,
    sampler: Sampler[int],
    args: TrainerArgs,
    world: World,
    drop_last: bool = False,
) -> Batches:
    """Packed shards a batch at a time, gathered in this process (imagedata.batches); any other
    dataset image by image through a DataLoader, with worker processes when it is large."""
    pin = world.device.type == "cuda"
    if isinstance(split.dataset, ShardSplit):
        return ShardBatches(split.dataset, sampler, args.batch_size, drop_last=drop_last, pin=pin)
    workers = _loader_workers(args.workers, world, split)
    return DataLoader(
        split.dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
        drop_last=drop_last,
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


@dataclass(frozen=True)
class FineTuning:
    """A training that starts from weights has two optimizer groups, the backbone's and the
    classifier's: for the first ``head_only_epochs`` only the classifier learns (the fresh rows
    of new classes would otherwise send large gradients into a backbone that already works),
    then the backbone learns at ``backbone_lr_scale`` of the classifier's rate."""

    head_only_epochs: int
    backbone_lr_scale: float

    @classmethod
    def from_args(cls, args: TrainerArgs) -> FineTuning:
        return cls(
            DEFAULT_HEAD_ONLY_EPOCHS if args.head_only_epochs is None else args.head_only_epochs,
            DEFAULT_BACKBONE_LR_SCALE if args.backbone_lr_scale is None else args.backbone_lr_scale,
        )

    def scales(self, epoch: int) -> list[float]:
        """The backbone's and the classifier's rate, as fractions of the schedule's."""
        return [0.0 if epoch <= self.head_only_epochs else self.backbone_lr_scale, 1.0]

    def as_record(self) -> dict[str, Any]:
        return {
            "head_only_epochs": self.head_only_epochs,
            "backbone_lr_scale": self.backbone_lr_scale,
        }


# ---------------------------------------------------------------------------- train / eval


@dataclass
class Trainer:
    args: TrainerArgs
    world: World
    model: nn.Module
    optimizer: torch.optim.Optimizer  # the one that steps; its state is what checkpoints hold
    schedule: Schedule
    scaler: torch.amp.GradScaler | None
    loss_fn: nn.Module
    speed: fast.Speed
    forward: Any  # the model, or its compiled form (see training.speed.forward_fn)
    # Wall-clock time of this process's first optimizer step: with the time a launcher started,
    # it gives the launch overhead (bench.nodes).
    first_step_time: float | None = None
    # The module a training step runs: the model itself, or the engine's wrapper around it
    # (DDP's); evaluation and the saved state use ``model``.
    net: nn.Module | None = None
    # How the optimizer's groups' rates relate to the schedule's (the backbone's and the
    # classifier's, when starting from weights).
    tuning: FineTuning | None = None
    classes: int = 0  # the classifier's outputs

    def _prepare(
        self, images: torch.Tensor, labels: torch.Tensor, train: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch on the device, as the model reads it; training batches augmented there."""
        images = images.to(self.world.device, non_blocking=True)
        if train and self.args.augment:
            images = augment.flip_crop(images)
        return fast.to_input(images, self.speed), labels.to(self.world.device, non_blocking=True)

    def _forward(self, images: torch.Tensor, module: nn.Module | None = None) -> torch.Tensor:
        """The training forward (compiled, through the engine's wrapper) or ``module``'s."""
        with fast.autocast(self.speed):
            return cast(torch.Tensor, (module or self.forward)(images))

    def train_step(
        self, images: torch.Tensor, labels: torch.Tensor, *, accumulate: int = 1, apply: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one batch already on the device (its loss divided by
        ``accumulate``, the batches summed into one step); with ``apply`` (the last of the
        batches: gradients travel now), the optimizer step. Returns the batch's loss and
        logits, detached."""
        with dist.accumulating(self.net or self.model, apply):
            logits = self._forward(images)
            loss = self.loss_fn(logits.float(), labels)
            scaled = loss / accumulate
            if self.scaler is not None:
                self.scaler.scale(scaled).backward()
            else:
                scaled.backward()
        if apply:
            self._step()
        return loss.detach(), logits.detach()

    def train_epoch(
        self,
        epoch: int,
        loader: Batches,
        step: int,
        profiler: Any = None,
        start: EpochStart | None = None,
        after_batch: AfterBatch | None = None,
    ) -> tuple[dict[str, float], int]:
        """One pass over this rank's shard; returns the epoch's summed stats and the next step.
        ``profiler`` (training.profiling), when given, is told of every batch's end. ``start``:
        the loader begins after the batches a checkpoint inside this epoch had trained, whose
        sums it carries. ``after_batch(done, step, sums)`` is called after every batch (``done``
        of the epoch's batches trained; ``sums()`` gives this rank's sums so far, waiting for
        the device, so it is called only when they are needed)."""
        self.model.train()
        k = self.args.backward_passes_per_step
        skip = start.batch if start is not None else 0
        total = skip + len(loader)
        # With gradient accumulation, a trailing group of fewer than k batches would leave
        # Horovod's per-parameter pass counters (DDP's unsynchronised gradients) out of step
        # with the other ranks: drop it.
        usable = total - total % k
        before = start.sums if start is not None else EpochSums(0.0, 0.0, 0, 0.0)
        device = self.world.device
        loss_sum = torch.full((), before.loss_sum, dtype=torch.float64, device=device)
        correct = torch.full((), before.correct, dtype=torch.float64, device=device)
        seen = before.seen
        started = time.perf_counter() - before.seconds

        def sums() -> EpochSums:
            return EpochSums(float(loss_sum), float(correct), seen, time.perf_counter() - started)

        batches = iter(loader)
        if start is not None and start.rng is not None:
            _set_rng_state(start.rng)
        for i, (images, labels) in enumerate(batches, start=skip):
            if i >= usable:
                break
            if i % k == 0:
                rate = self.schedule.lr(step)
                scales = self.tuning.scales(epoch) if self.tuning else [1.0]
                for group, scale in zip(self.optimizer.param_groups, scales, strict=True):
                    group["lr"] = rate * scale
            images, labels = self._prepare(images, labels, train=True)
            apply = (i + 1) % k == 0
            loss, logits = self.train_step(images, labels, accumulate=k, apply=apply)
            step += apply
            loss_sum += loss.double() * len(labels)
            correct += (logits.argmax(1) == labels).sum().double()
            seen += len(labels)
            if (i + 1) % self.args.log_every == 0:
                self._check_finite(epoch, i + 1, loss_sum, seen)
            if profiler is not None:
                profiler.step()
            if after_batch is not None:
                after_batch(i + 1, step, sums)
        if profiler is not None:
            profiler.stop()  # writes the trace, also when the epoch ended before its last step
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
        dist.optimizer_step(self.optimizer, self.scaler)
        fast.zero_grads(self.optimizer, keep=self.speed.keeps_grads)
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
    def evaluate(
        self, split: SplitData, name: str, indices: list[int] | None = None
    ) -> dict[str, float]:
        """Loss, accuracy and ``--val-metric`` over ``split`` (or its ``indices``), summed
        over the ranks' shares: every rank gets the same figures."""
        self.model.eval()
        sampler = EvalSampler(len(split), self.world, indices)
        loader = _loader(split, sampler, self.args, self.world)
        # Per class: images of it, images labelled it, and both (every metric a promotion
        # decides on follows from these).
        counts = torch.zeros((3, self.classes), dtype=torch.float64, device=self.world.device)
        loss_sum = 0.0
        for images, labels in loader:
            images, labels = self._prepare(images, labels)
            logits = self._forward(images, self.model).float()
            loss_sum += float(self.loss_fn(logits, labels)) * len(labels)
            predicted = logits.argmax(1)
            for row, values in enumerate((labels, predicted, labels[predicted == labels])):
                counts[row] += torch.bincount(values, minlength=self.classes)[: self.classes]
        total_loss, *summed = dist.allreduce_sum(
            [loss_sum, *counts.flatten().tolist()], name=f"eval.{name}"
        )
        n = self.classes
        true, predicted_n, correct = summed[:n], summed[n : 2 * n], summed[2 * n :]
        seen = sum(true)
        return {
            "loss": total_loss / max(1.0, seen),
            "accuracy": sum(correct) / max(1.0, seen),
            "metric": metric_value(self.args.val_metric, correct, true, predicted_n),
        }


# ---------------------------------------------------------------------------- checkpoints


@dataclass
class Best:
    """The best epoch so far and its weights, a host copy every rank keeps (None: the model
    as it stands is that epoch's, as in a checkpoint written at the best epoch's end)."""

    epoch: int
    weights: dict[str, Any] | None


@dataclass(frozen=True)
class Resumed:
    """Where this attempt starts: ``start_epoch`` (at ``start``'s batch when the checkpoint was
    inside it), the epochs' history (from which the stopping rule is replayed), ``resumed_from``
    (whole epochs the checkpoint had done; None on a fresh start), what the training started
    from, why the checkpoint was written, and its best epoch."""

    start_epoch: int
    history: list[dict[str, Any]]
    resumed_from: int | None
    started_from: dict[str, Any] | None
    start: EpochStart | None = None
    reason: str | None = None
    name: str = ""  # the checkpoint's file name
    best: Best | None = None


# What must be equal for a checkpoint inside an epoch to resume at its batch: each rank's share
# of the epoch (and of the train images left after a held-out slice, which the seed draws), and
# the batches it falls into, depend on them.
_SAME_ORDER = ("batch_size", "backward_passes_per_step", "seed", "compile")


def partial_mismatch(state: dict[str, Any], args: TrainerArgs, ranks: int) -> str | None:
    """Why a checkpoint inside an epoch cannot resume this run (None: it can, or it is a
    whole-epoch one). Its weights saw part of the epoch in the order of its ``_SAME_ORDER``
    settings and number of ranks; under others the position means nothing, and the weights are
    not those of any epoch's end, so the search goes on to an older checkpoint."""
    if not state.get("batch"):
        return None
    record = state["args"] if isinstance(state.get("args"), dict) else {}
    changed = [k for k in _SAME_ORDER if record.get(k) != getattr(args, k)]
    partial = state.get("partial")
    if not isinstance(partial, list) or len(partial) != ranks:
        changed.append("number of ranks")
    if not changed:
        return None
    return (
        f"written inside epoch {state['epoch']} with another {', '.join(changed)}: that "
        "position does not carry over, so an older whole-epoch checkpoint resumes instead"
    )


def _resume(
    args: TrainerArgs,
    world: World,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
) -> Resumed:
    """Rank 0 loads the newest valid checkpoint; its position, history, what the training
    started from and its best epoch go to every rank, and each rank its own sums of an epoch
    it was inside of.

    Weights and optimizer state reach the other ranks through the broadcast that follows,
    so only one process reads the (possibly remote) checkpoint file. The best epoch's weights
    travel here only when they are not the checkpoint's own (an epoch after the best one).
    """

    def fits(state: dict[str, Any]) -> str | None:
        # A checkpoint written before the ResNets took torchvision's names resumes under them.
        if isinstance(state["model"], dict):
            state["model"] = upgrade_state_dict(args.model, state["model"])
        return partial_mismatch(state, args, world.size) or ckpt.mismatch(state, model, optimizer)

    found = ckpt.newest_valid_checkpoint(args.checkpoints, fits) if world.is_root else None
    rngs: list[Any] | None = None
    if found is not None:
        model.load_state_dict(found["model"])
        optimizer.load_state_dict(found["optimizer"])
        if scaler is not None and found.get("scaler"):
            scaler.load_state_dict(found["scaler"])
        rngs = found.get("rng")
    meta: tuple[Any, ...] = (None, 0, [], None, None, None, None, "", None)
    if found is not None:
        batch = found.get("batch", 0)
        name = ckpt.checkpoint_path(args.checkpoints, found["epoch"], batch).name
        partial = found.get("partial")
        meta = (
            found["epoch"],
            batch,
            found["history"],
            rngs,
            found.get("init_from"),
            partial if batch else None,
            found.get("reason"),
            name,
            found.get("best"),
        )
    epoch, batch, history, rngs, started_from, partial, reason, name, best = cast(
        tuple[Any, ...], dist.broadcast_object(meta)
    )
    if epoch is None:
        return Resumed(1, [], None, None)
    kept = Best(best["epoch"], best.get("model")) if best is not None else None
    rng = rngs[world.rank] if rngs is not None and len(rngs) == world.size else None
    if not batch:
        if rng is not None:
            _set_rng_state(rng)
        return Resumed(epoch + 1, history, epoch, started_from, reason=reason, name=name, best=kept)
    start = EpochStart(batch, EpochSums(**partial[world.rank]), rng)
    return Resumed(epoch, history, epoch - 1, started_from, start, reason, name, kept)


def _init_from(
    args: TrainerArgs, world: World, model: nn.Module, class_names: list[str]
) -> dict[str, Any]:
    """Rank 0 reads ``--init-from`` and loads what it can carry into its model; the others
    receive the weights with the broadcast that follows, as after a checkpoint. Every rank
    learns the outcome, so a refused file stops them all with the same error."""
    assert args.init_from is not None
    outcome: tuple[str, Any] = ("ok", None)
    if world.is_root:
        try:
            weights = read_weights(args.init_from)
            carried = carry(
                weights,
                model,
                args.model,
                args.input_size(),
                class_names,
                run_id=args.init_from_run,
            )
            outcome = ("ok", carried.as_record())
        except InitFromError as exc:
            outcome = ("error", str(exc))
    status, value = cast(tuple[str, Any], dist.broadcast_object(outcome))
    if status == "error":
        raise InitFromError(value)
    log.info(
        "started from %s (%s): %d classes carried, %d new, %d dropped",
        value["source"],
        value["kind"],
        len(value["classes_carried"]),
        len(value["classes_new"]),
        len(value["classes_dropped"]),
    )
    return cast(dict[str, Any], value)


def _save_checkpoint(
    job: Job,
    epoch: int,
    batch: int = 0,
    sums: EpochSums | None = None,
    decision: moments.Decision | None = None,
) -> None:
    """Rank 0 writes the state after ``epoch`` (or inside it, after ``batch`` of its batches,
    with every rank's ``sums`` of them): weights, optimizer, every rank's random streams, the
    arguments and the history so far. One written on a preemption notice is on disk before
    training goes on."""
    args, trainer = job.args, job.trainer
    notice = decision.notice if decision is not None else None
    mine = {
        "rng": _rng_state(),  # every rank's, so each resumes its own stream
        "partial": asdict(sums) if sums is not None else None,
        "notice": asdict(notice) if notice is not None else None,
    }
    ranks = cast(list[dict[str, Any]], dist.gather_objects(mine))
    optimizer = dist.optimizer_state(trainer.optimizer)  # whole, even when ranks shard it
    job.policy.saved()
    if not job.world.is_root:
        return
    notices = [Notice(**r["notice"]) for r in ranks if r["notice"] is not None]
    reason = decision.reason if decision is not None else "epoch"
    state = {
        "format_version": ckpt.FORMAT_VERSION,
        "epoch": epoch,
        "batch": batch,
        "model": trainer.model.state_dict(),
        "optimizer": optimizer,
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "rng": [r["rng"] for r in ranks],
        "partial": [r["partial"] for r in ranks] if batch else None,
        "args": args.as_record(),
        "history": job.history,
        "init_from": job.init_from,
        "reason": reason if not notices else f"preemption: {notices[0].describe()}",
        "saved_at": time.time(),
        # The best epoch, with its weights when they are not this checkpoint's own (never
        # inside an epoch): a resumed training still ends with the best epoch's model.
        "best": (
            None
            if job.best is None
            else {"epoch": job.best.epoch}
            if job.best.epoch == epoch and not batch
            else {"epoch": job.best.epoch, "model": job.best.weights}
        ),
    }
    name = ckpt.checkpoint_path(args.checkpoints, epoch, batch).name
    # The step waits for the copy to host memory only; the file is written in the background.
    stall = job.checkpoints.save(state, epoch, batch)
    if decision is None or decision.reason in ("interval", "stop"):
        log.info("%s: training held %.3f s to copy its state", name, stall)
        return
    job.checkpoints.wait()  # on a notice, the file is on disk before another step
    if notices:
        seconds = time.time() - notices[0].seen_at
        why = f"{notices[0].describe()}, {seconds:.2f} s after the node read it"
    else:
        why = "a notice another rank read"
    log.warning("emergency %s on disk (%s); training goes on until the node is taken", name, why)


# ---------------------------------------------------------------------------- main


@dataclass
class Job:
    """One training run once set up: what the epochs loop and the finish both read."""

    args: TrainerArgs
    world: World
    data: DatasetInfo
    skipped: list[str]
    trainer: Trainer
    sampler: ResumingSampler
    loader: Batches
    steps_per_epoch: int
    start_epoch: int
    history: list[dict[str, Any]]
    resumed_from: int | None  # the whole epochs of the checkpoint this run resumed from
    checkpoints: ckpt.CheckpointWriter  # written by rank 0 only
    policy: moments.CheckpointPolicy  # when to checkpoint inside an epoch (every rank alike)
    batches: int  # in a whole epoch, on each rank
    watched: Watched
    rule: StoppingRule  # replayed from the history when resuming
    init_from: dict[str, Any] | None = None  # what it started from (metrics.json's init_from)
    start: EpochStart | None = None  # inside the first epoch this attempt trains, if resumed so
    heartbeat: moments.Heartbeat | None = None  # rank 0's
    best: Best | None = None  # the best epoch's weights (None: no split is watched)


@dataclass(frozen=True)
class Watched:
    """What early stopping watches: the val split, a slice held out of train (``indices``
    into it), or nothing (``split`` None: ``why`` says why)."""

    name: str | None
    split: SplitData | None
    indices: list[int] | None
    why: str

    def as_record(self) -> dict[str, Any]:
        return {
            "split": self.name,
            "images": None if self.split is None else len(self.indices or self.split),
            "why": self.why,
        }


def _labels(dataset: Any) -> list[int]:
    """Every image's class id, read without decoding the images where the dataset says."""
    if hasattr(dataset, "labels"):
        return [int(label) for label in dataset.labels]
    if hasattr(dataset, "samples"):
        return [int(label) for _, label in dataset.samples]
    if hasattr(dataset, "label"):
        return [dataset.label(i) for i in range(len(dataset))]
    return [int(dataset[i][1]) for i in range(len(dataset))]


def _watched(args: TrainerArgs, data: DatasetInfo) -> tuple[Watched, list[int] | None]:
    """The split early stopping watches, and the train split's indices left to train on (None:
    all of them)."""
    if "val" in data.splits:
        split = data.splits["val"]
        return Watched("val", split, None, f"the val split ({len(split)} images)"), None
    train = data.splits["train"]
    cut = hold_out(_labels(train.dataset), args.seed)
    if cut.refused is not None:
        return Watched(None, None, None, cut.refused), None
    why = (
        f"no val split: a slice of {len(cut.held)} of the {len(train)} train images, held out "
        "of training"
    )
    return Watched("train slice", train, cut.held, why), cut.train


def run(args: TrainerArgs, world: World) -> dict[str, Any]:
    """Set up, train the epochs not yet done, finish; returns the metrics (rank 0 also writes
    them, with the model, to the output folder)."""
    started = time.perf_counter()
    if args.prune_checkpoint_folders is not None and world.is_root:
        for folder, why in ckpt.prune_checkpoint_folders(
            args.checkpoints, args.prune_checkpoint_folders
        ):
            log.info("removed checkpoint folder %s: %s", folder, why)
    job = set_up(args, world)
    writer = _tensorboard(args, world)
    stopped = _train(job, writer)
    if stopped is not None:
        return {"stopped_after_epoch": stopped}
    return _finish(job, writer, started)


def set_up(args: TrainerArgs, world: World) -> Job:
    """Data, model and optimizer on every rank, resumed from the newest checkpoint if any."""
    options = GradientOptions(
        fp16_allreduce=args.fp16_allreduce,
        backward_passes_per_step=args.backward_passes_per_step,
        adasum=args.adasum,
        sync_batchnorm=args.sync_batchnorm,
        shard_optimizer_state=args.shard_optimizer_state,
    )
    dist.check_options(world, options)
    _seed_everything(args.seed + world.rank)
    data, skipped = _open_data(args, world)
    speed = _speed(args, world)
    model = build_model(args.model, len(data.class_names)).to(world.device)
    if not speed.contiguous_grads:
        fast.set_layout(model, speed)  # before DDP builds its buckets on the weights' layout
    scale = dist.lr_scale(world, options)
    tuning = FineTuning.from_args(args) if args.init_from is not None else None
    params: Any = model.parameters()
    if tuning is not None:
        backbone, classifier = network_parameters(model, args.model)
        params = [{"params": backbone}, {"params": classifier}]
    base = fast.sgd(
        params,
        speed,
        lr=args.lr * scale,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
    )
    # Wrapped before resuming, so the state loaded is the stepping optimizer's own.
    net, optimizer = dist.wrap(model, base, options)
    scaler = fast.grad_scaler(speed)
    resumed = _resume(args, world, model, optimizer, scaler)
    started_from, best = resumed.started_from, resumed.best
    if resumed.resumed_from is not None:
        _log_resume(resumed)
    elif args.init_from is not None:
        started_from = _init_from(args, world, model, data.class_names)
    dist.broadcast_state(model, optimizer)
    if speed.contiguous_grads:
        fast.set_layout(model, speed)  # after Horovod's broadcast, which takes contiguous tensors
    fast.match_state_layout(optimizer)
    watched, train_indices = _watched(args, data)
    log.info("early stopping watches %s", watched.why)
    sampler, loader, steps_per_epoch = _train_loader(
        args, world, data.splits["train"], train_indices
    )
    if best is not None and best.weights is None:  # the checkpoint's own weights: the best's
        best = Best(best.epoch, ckpt.host_copy(model.state_dict()))
    schedule = Schedule(
        # From weights, the warm-up starts at 0: the first steps' gradients, through the fresh
        # rows of new classes, are the largest and least informed.
        0.0 if tuning is not None else args.lr,
        args.lr * scale,
        int(args.warmup() * steps_per_epoch),
        args.epoch_cap() * steps_per_epoch,
    )
    trainer = Trainer(
        args,
        world,
        model,
        optimizer,
        schedule,
        scaler,
        nn.CrossEntropyLoss(),
        speed,
        fast.forward_fn(net, speed),
        net=net,
        tuning=tuning,
        classes=len(data.class_names),
    )
    return Job(
        args=args,
        world=world,
        data=data,
        skipped=skipped,
        trainer=trainer,
        sampler=sampler,
        loader=loader,
        steps_per_epoch=steps_per_epoch,
        start_epoch=resumed.start_epoch,
        history=resumed.history,
        resumed_from=resumed.resumed_from,
        init_from=started_from,
        checkpoints=ckpt.CheckpointWriter(args.checkpoints, args.keep_checkpoints),
        policy=_checkpoint_policy(args, world),
        batches=len(loader),
        start=resumed.start,
        heartbeat=moments.Heartbeat(sys.stdout, args.heartbeat_seconds) if world.is_root else None,
        watched=watched,
        rule=StoppingRule.replay(args.patience, args.min_improvement, resumed.history),
        best=best,
    )


def _log_resume(resumed: Resumed) -> None:
    reason = resumed.reason or "epoch"
    why = (
        " (written by time)"
        if reason == "interval"
        else f" (written on a notice: {reason.split(': ', 1)[-1]})"
        if reason.startswith("preemption")
        else ""
    )
    if resumed.start is None:
        log.info("resuming from %s%s: starting at epoch %d", resumed.name, why, resumed.start_epoch)
        return
    epoch, batch = resumed.start_epoch, resumed.start.batch
    log.info(
        "resuming from %s%s: epoch %d goes on at batch %d", resumed.name, why, epoch, batch + 1
    )


def _checkpoint_policy(args: TrainerArgs, world: World) -> moments.CheckpointPolicy:
    """Checkpoints by time (``--checkpoint-minutes``) and on a preemption notice, which the
    first rank of each node watches for where the node has Scheduled Events. Whether any rank
    watches is agreed: every rank must then take part in the agreement points."""
    watcher = PreemptionWatcher.from_environment() if world.local_rank == 0 else None
    watched = dist.allreduce_sum([float(watcher is not None)], name="ckpt.watch")[0] > 0
    stop_file = args.stop_file if world.is_root else None
    policy = moments.CheckpointPolicy(
        args.checkpoint_minutes,
        watcher.start() if watcher is not None else None,
        accumulate=args.backward_passes_per_step,
        watching=watched,
        stop=stop_file.exists if stop_file is not None else None,
    )
    return policy


def _speed(args: TrainerArgs, world: World) -> fast.Speed:
    """The step's switches on this device; a choice the device can't honour is a usage error."""
    try:
        speed = fast.resolve(
            device=world.device,
            precision=args.precision,
            no_amp=args.no_amp,
            channels_last=args.channels_last,
            compile_model=args.compile,
            optimizer_kernel=args.optimizer_kernel,
            contiguous_grads=dist.contiguous_tensors(),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    fast.configure_backends(speed)
    log.info("speed: %s", ", ".join(f"{k}={v}" for k, v in speed.describe().items()))
    return speed


def _train_loader(
    args: TrainerArgs, world: World, split: SplitData, indices: list[int] | None = None
) -> tuple[ResumingSampler, Batches, int]:
    """This rank's shuffled share of the train split (of its ``indices``, when given), and the
    optimizer steps in an epoch."""
    sampler = ResumingSampler(
        DistributedSampler(
            split.dataset, num_replicas=world.size, rank=world.rank, shuffle=True, seed=args.seed
        )
        if indices is None
        else SliceSampler(indices, world, args.seed)
    )
    # A compiled step is specialised to the batch's shape: a last, smaller batch would compile
    # it again (tens of seconds on a GPU, each epoch's end) for a few images. Dropping it costs
    # nothing and loses no image for good, as the sampler reshuffles every epoch; padding it
    # would cost a full step's compute (bench/compile_tail.py measures the three).
    loader = _loader(split, sampler, args, world, drop_last=args.compile)
    steps_per_epoch = len(loader) // args.backward_passes_per_step
    if steps_per_epoch == 0:
        count = len(split) if indices is None else len(indices)
        raise DatasetError(
            f"train split has {count} images to train on: too few for batch size "
            f"{args.batch_size} x {world.size} workers x {args.backward_passes_per_step} passes"
        )
    return sampler, loader, steps_per_epoch


def _open_data(args: TrainerArgs, world: World) -> tuple[DatasetInfo, list[str]]:
    """The dataset at ``--data-dir`` at the input size, and the damaged images left out."""
    info = open_dataset(
        args.data_dir,
        args.input_size(),
        seed=args.seed,
        verify_images=not args.no_verify_images,
        rank=world.rank,
        world=world.size,
        gather=dist.gather_objects,  # type: ignore[arg-type]
    )
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
    return info, skipped


def _stop_requested(args: TrainerArgs, world: World) -> bool:
    """Whether ``--stop-file`` exists, as rank 0 sees it: every rank gets its answer, so all
    stop at the same checkpoint."""
    if args.stop_file is None:
        return False
    return bool(dist.broadcast_object(world.is_root and args.stop_file.exists()))


def _stop(job: Job, cap: int, done: int, where: str) -> int:
    """A stop request ends the training at the checkpoint just taken (``where``): status 0,
    resumable; returns the whole epochs done."""
    job.checkpoints.wait()  # the checkpoint to resume from is on disk
    job.policy.close()
    if job.args.timeline:
        dist.stop_timeline()
    if job.world.is_root:
        log.info("stop requested (%s): stopping %s", job.args.stop_file, where)
        emit_progress(
            {
                "stopped": "requested",
                "epochs": cap,
                "epochs_done": done,
                "resumed_from": job.resumed_from,
            }
        )
    return done


def _train(job: Job, writer: Any) -> int | None:
    """The epochs not yet done: train, evaluate, decide whether to stop, checkpoint and report
    each one. Returns the epoch whose checkpoint training stopped at when a stop was requested
    (None: it was not)."""
    args, world, trainer = job.args, job.world, job.trainer
    cap = args.epoch_cap()
    # Resumed after the epoch that stopped the training (killed before its export): no more.
    last = job.start_epoch - 1 if job.rule.stopped else cap
    if args.timeline:
        dist.start_timeline(str(args.output_dir / "timeline.json"))
    k = args.backward_passes_per_step
    step = (job.start_epoch - 1) * job.steps_per_epoch
    if job.start is not None:
        step += job.start.batch // k
    for epoch in range(job.start_epoch, last + 1):
        if _stop_requested(args, world):  # at a checkpoint: the last epoch's, or the resumed one
            return _stop(job, cap, epoch - 1, f"after epoch {epoch - 1}")
        start = job.start if epoch == job.start_epoch else None
        done = start.batch if start is not None else 0
        job.sampler.set_epoch(epoch, skip=done * args.batch_size)
        job.policy.start_epoch(done)
        if job.heartbeat is not None and epoch == job.start_epoch:
            resumed: dict[str, object] = {"resumed_from": job.resumed_from}
            job.heartbeat.start(epoch, done, job.batches, resumed)
        # The first epoch this attempt trains is profiled when asked (rank 0).
        profiler = (
            profiling.step_profiler(args.profile_steps, args.output_dir, world.rank, world.device)
            if epoch == job.start_epoch
            else None
        )
        try:
            stats, step = trainer.train_epoch(
                epoch, job.loader, step, profiler, start, _after_batch(job, epoch)
            )
        except _StopInside as inside:  # checkpointed inside the epoch (--checkpoint-minutes)
            return _stop(job, cap, epoch - 1, f"inside epoch {epoch}, after batch {inside.done}")
        if profiler is not None:
            log.info(
                "profiler trace of epoch %d in %s", epoch, profiling.trace_dir(args.output_dir)
            )
        dist.sync_buffers(trainer.model)
        record: dict[str, Any] = {
            "epoch": epoch,
            "epochs": cap,
            **stats,
            "lr": trainer.schedule.lr(step - 1),
            "images_per_sec": stats["images"] / max(stats["seconds"], 1e-9),
        }
        stop = _watch(job, epoch, record)
        job.history.append(record)
        _save_checkpoint(job, epoch)
        if world.is_root:
            at = {"resumed_batch": job.start.batch} if job.start is not None else {}
            emit_progress({**record, "resumed_from": job.resumed_from, **at})
            _add_scalars(writer, record, epoch)
        if stop:
            log.info(
                "early stop after epoch %d: %s %s has not improved for %d epochs; the model "
                "kept is epoch %d's",
                epoch,
                job.watched.name,
                args.val_metric,
                args.patience,
                job.rule.best_epoch,
            )
            break
    if args.timeline:
        dist.stop_timeline()
    if job.start_epoch > last and world.is_root:
        # Resumed after the last epoch (a job killed after its last checkpoint): nothing is
        # trained, but orchestrators still learn where this attempt started.
        emit_progress({"epochs": cap, "resumed_from": job.resumed_from})
    return None


def _watch(job: Job, epoch: int, record: dict[str, Any]) -> bool:
    """Evaluate the watched split after ``epoch`` (its figures into ``record``), keep the best
    epoch's weights, and say whether to stop. The figures are rank 0's, sent to every rank, so
    every rank's rule takes the same decision from the same numbers."""
    watched = job.watched
    if watched.split is None:
        return False
    val = job.trainer.evaluate(watched.split, f"val.{epoch}", watched.indices)
    val = cast(dict[str, float], dist.broadcast_object(val))
    verdict = job.rule.update(epoch, val["metric"], val["loss"])
    if verdict.best:
        job.best = Best(epoch, ckpt.host_copy(job.trainer.model.state_dict()))
    record.update(
        val_split=watched.name,
        val_loss=val["loss"],
        val_accuracy=val["accuracy"],
        val_metric=val["metric"],
        val_metric_name=job.args.val_metric,
        best_epoch=job.rule.best_epoch,
        stop=verdict.stop,
    )
    return verdict.stop


def _kept_epoch(job: Job) -> int | None:
    """The epoch whose model the job exports: the best one, else the last trained."""
    if job.best is not None:
        return job.best.epoch
    return job.history[-1]["epoch"] if job.history else None


def _keep_best(job: Job) -> None:
    """Every rank takes the best epoch's weights, which it holds (a host copy, identical on
    every rank): the test figures, the weights' check across ranks and the exported model are
    that epoch's."""
    if job.best is None or job.best.weights is None:
        return
    trained = job.history[-1]["epoch"] if job.history else None
    if job.best.epoch != trained:
        job.trainer.model.load_state_dict(job.best.weights)
        log.info("the model kept is epoch %d's (the best), not epoch %s's", job.best.epoch, trained)


def _after_batch(job: Job, epoch: int) -> AfterBatch:
    """What follows each batch of ``epoch``: rank 0's heartbeat, and at the policy's agreement
    points a checkpoint inside the epoch when the ranks agree one is due."""

    def after(done: int, step: int, sums: Callable[[], EpochSums]) -> None:
        if job.heartbeat is not None:
            job.heartbeat.after_batch(epoch, done, job.batches)
        if not job.policy.due(done):
            return
        decision = job.policy.decide(
            done, lambda votes: dist.allreduce_sum(votes, name=f"ckpt.{epoch}.{done}")
        )
        if decision is not None:
            _save_checkpoint(job, epoch, done, sums(), decision)
        if decision is not None and decision.reason == "stop":
            raise _StopInside(done)

    return after


class _StopInside(Exception):
    """A stop request agreed inside an epoch, once its checkpoint is taken: ends the epoch."""

    def __init__(self, done: int) -> None:
        super().__init__(done)
        self.done = done


def _finish(job: Job, writer: Any, started: float) -> dict[str, Any]:
    """The best epoch's model: its test accuracy, a check that every rank holds the same
    weights, and the outputs."""
    job.policy.close()
    _keep_best(job)
    test = job.trainer.evaluate(job.data.splits["test"], "test")
    job.checkpoints.wait()  # the last checkpoint is on disk before the outputs say "done"
    digests = dist.gather_objects(dist.state_digest(job.trainer.model.state_dict()))
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks ended with different weights: {digests}")
    # Every rank's own stopping decision: the same, or the job's outputs would be one rank's.
    decisions = dist.gather_objects(
        {"epochs_trained": len(job.history), "kept_epoch": _kept_epoch(job)}
    )
    if any(d != decisions[0] for d in decisions):
        raise RuntimeError(f"ranks stopped differently: {decisions}")
    metrics = _metrics(job, test, digests, time.perf_counter() - started)
    metrics["early_stopping"]["per_rank"] = decisions
    failed = None
    if job.world.is_root:
        try:
            _write_outputs(job, metrics, writer)
        except ExportError as exc:
            failed = str(exc)
    # Every rank learns whether rank 0's export failed, so all stop with the same error
    # instead of waiting for it at the end of the job.
    failed = cast(str | None, dist.broadcast_object(failed))
    if failed is not None:
        raise ExportError(failed)
    if job.world.is_root:
        ckpt.mark_finished(job.args.checkpoints, job.args.epoch_cap())  # after the model is out
    return metrics


def _metrics(
    job: Job, test: dict[str, float], digests: list[object], wall_seconds: float
) -> dict[str, Any]:
    args, world = job.args, job.world
    images = sum(r["images"] for r in job.history)
    seconds = sum(r["seconds"] for r in job.history)
    return {
        "epochs": job.history,
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "images_per_sec": images / seconds if seconds else None,
        "images_per_sec_per_worker": images / seconds / world.size if seconds else None,
        "world_size": world.size,
        "wall_seconds": wall_seconds,
        "first_step_time": job.trainer.first_step_time,
        "model": args.model,
        "input_size": args.input_size(),
        "class_names": job.data.class_names,
        "dataset": {
            "kind": job.data.kind,
            **{f"num_{k}": len(v) for k, v in job.data.splits.items()},
        },
        "skipped_images": {"count": len(job.skipped), "files": job.skipped},
        "resumed_from_epoch": job.resumed_from,
        "early_stopping": {
            **job.watched.as_record(),
            "metric": args.val_metric,
            "epoch_cap": args.epoch_cap(),
            "epochs_trained": len(job.history),
            **job.rule.as_record(),
            "kept_epoch": _kept_epoch(job),
        },
        "init_from": (
            {**job.init_from, **job.trainer.tuning.as_record()}
            if job.init_from is not None and job.trainer.tuning is not None
            else None
        ),
        "weights_digest_per_rank": digests,
        "device": str(world.device),
        "speed": job.trainer.speed.describe(),
        "args": args.as_record(),
    }


def _write_outputs(job: Job, metrics: dict[str, Any], writer: Any) -> None:
    """model.pt (with what the scorer needs to read it), model.onnx (checked against it on
    the test split: training.onnx_export), metrics.json, the last scalar."""
    args = job.args
    saved = {
        "format_version": MODEL_FORMAT_VERSION,
        "state_dict": job.trainer.model.state_dict(),
        "class_names": job.data.class_names,
        "model_name": args.model,
        "input_size": args.input_size(),
    }
    ckpt.atomic_save(saved, args.output_dir / "model.pt")
    onnx_path = args.output_dir / "model.onnx"
    onnx_path.unlink(missing_ok=True)  # an earlier attempt's is not this model's
    metrics["onnx"] = metrics["onnx_md5"] = None
    if not args.no_onnx:
        check = write_onnx(saved, check_images(job.data.splits["test"].dataset), onnx_path)
        log.info(
            "model.onnx: top class agrees with PyTorch on %d of %d test images, probabilities "
            "within %.2g",
            round(check.top1_agreement * check.images),
            check.images,
            check.max_prob_diff,
        )
        metrics["onnx"] = check.as_metrics()
        metrics["onnx_md5"] = file_md5(onnx_path)
    # Blob storage keeps no MD5 of a model uploaded in blocks (over 64 MB, or by Batch's output
    # files): the ones recorded here are what a download of either file is checked against.
    metrics["model_md5"] = file_md5(args.output_dir / "model.pt")
    atomic_write_json(metrics, args.output_dir / "metrics.json")
    if writer is not None:
        writer.add_scalar("test/accuracy", metrics["test_accuracy"], len(job.history))
        writer.close()
    log.info(
        "test accuracy %.4f; %.1f images/sec over %d workers; outputs in %s",
        metrics["test_accuracy"],
        metrics["images_per_sec"] or 0.0,
        job.world.size,
        args.output_dir,
    )


def write_line(stream: TextIO, text: str) -> None:
    """One line in one call: the task runs Python unbuffered (live logs), where print() writes
    the text and its newline separately, and a line the checkpoint writer's thread logs to the
    same pipe could land between the two, gluing itself to this one."""
    stream.write(text + "\n")
    stream.flush()


def emit_progress(record: dict[str, Any]) -> None:
    write_line(sys.stdout, "PROGRESS " + json.dumps(record))


def _add_scalars(writer: Any, record: dict[str, Any], epoch: int) -> None:
    if writer is None:
        return
    for key in (
        "train_loss",
        "train_accuracy",
        "val_loss",
        "val_accuracy",
        "val_metric",
        "lr",
        "images_per_sec",
    ):
        if key in record:
            writer.add_scalar(key.replace("_", "/", 1), record[key], epoch)
    writer.flush()


def _tensorboard(args: TrainerArgs, world: World) -> Any:
    if not world.is_root:
        return None
    from torch.utils.tensorboard import SummaryWriter  # heavy: import only on the writing rank

    return SummaryWriter(log_dir=str(args.output_dir / "tensorboard"))


def start_world(args: TrainerArgs) -> World:
    """Join the job's process group (also what the GPU benchmark calls before ``set_up``)."""
    return dist.init(args.engine, timeline=args.timeline)


def main(argv: list[str] | None = None) -> int:
    args = parse_trainer_args(argv, description=__doc__)
    try:
        world = start_world(args)
    except UsageError as exc:
        write_line(sys.stderr, f"error: {exc}")
        return 2
    if world.is_root:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    try:
        run(args, world)
    except (DatasetError, ExportError, InitFromError, NonFiniteLossError, UsageError) as exc:
        write_line(sys.stderr, f"[rank {world.rank}] error: {exc}")
        dist.shutdown(together=False)
        return 2
    dist.shutdown(together=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
