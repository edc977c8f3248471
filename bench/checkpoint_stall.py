"""How long a checkpoint holds the training step: written in line (before) against copied to host
memory and written in the background (now), ResNet-50, in one run.

The state is the trainer's: ResNet-50's weights and SGD momentum (after one step, so the
momentum exists), the arguments and a history. Each repeat writes it both ways to the same
folder, alternating:

* in line: ``training.checkpoint.atomic_save`` and the pruning, as ``_save_checkpoint`` did;
  the step waits for all of it (serialise, write, fsync, rename);
* background: ``training.checkpoint.CheckpointWriter.save``, which returns once the state is
  copied; then the next training steps run while the file is written, timed against the same
  steps with no write in flight (what the write costs the steps it overlaps, on shared cores).

Reported: the stall per checkpoint each way (median), their ratio, the background write's own
duration, and the steps' slowdown during a write. Nothing is asserted about the figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.output import ROOT, emit
from training import checkpoint as ckpt
from training.models import build_model


def _setup(model_name: str, size: int, batch: int, device: torch.device) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = build_model(model_name, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    images = torch.randint(0, 256, (batch, 3, size, size), device=device).float()
    labels = torch.arange(batch, device=device) % 10

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # the momentum buffers exist from here on
    return model, optimizer, step


def _state(model: Any, optimizer: Any, epoch: int) -> dict[str, Any]:
    """What ``training.train._save_checkpoint`` writes (the tensors are the live ones)."""
    return {
        "format_version": ckpt.FORMAT_VERSION,
        "epoch": epoch,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": None,
        "rng": [{"python": None, "numpy": None, "torch": torch.get_rng_state()}],
        "args": {"model": "resnet50"},
        "history": [{"epoch": e, "train_loss": 1.0} for e in range(1, epoch + 1)],
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    device = torch.device(args.device)
    model, optimizer, step = _setup(args.model, args.image_size, args.batch_size, device)

    def steps() -> None:
        for _ in range(args.steps):
            step()

    steps()  # warm: allocations and kernels chosen before anything is timed
    inline, background, write, clean, during = [], [], [], [], []
    writer = ckpt.CheckpointWriter(args.work, keep=2)
    epoch = 0
    for _ in range(args.repeats):
        epoch += 1
        state = _state(model, optimizer, epoch)

        def in_line(state: dict[str, Any] = state, epoch: int = epoch) -> None:
            ckpt.atomic_save(state, ckpt.checkpoint_path(args.work, epoch))
            ckpt.prune_checkpoints(args.work, 2)

        inline.append(_timed(in_line))
        clean.append(_timed(steps))
        epoch += 1
        started = time.perf_counter()
        background.append(writer.save(_state(model, optimizer, epoch), epoch))
        during.append(_timed(steps))
        writer.wait()
        write.append(time.perf_counter() - started)
    size = ckpt.checkpoint_path(args.work, epoch).stat().st_size
    median = statistics.median
    report = {
        "benchmark": "checkpoint_stall",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "method": f"{args.model} (weights and SGD momentum: {size / 1e6:,.0f} MB per checkpoint) "
        f"on {_device_name(device)}, {torch.get_num_threads()} torch threads, written to a local "
        "disk with fsync; "
        f"{args.repeats} repeats of each way, alternating; {args.steps} training steps (batch "
        f"{args.batch_size} at {args.image_size} px) after each checkpoint",
        "device": _device_name(device),
        "checkpoint_mb": round(size / 1e6, 1),
        "stall_seconds": {
            "in_line": round(median(inline), 4),
            "background": round(median(background), 4),
        },
        "in_line_over_background": round(median(inline) / median(background), 1),
        "background_write_seconds": round(median(write), 3),
        "steps_seconds": {
            "no_write": round(median(clean), 3),
            "during_write": round(median(during), 3),
        },
        "steps_during_write_over_no_write": round(median(during) / median(clean), 2),
        "samples": {"in_line": inline, "background": background},
    }
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.checkpoint_stall",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="resnet50")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="training steps after each checkpoint")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--work", type=Path, default=ROOT / ".bench" / "checkpoint_stall")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    return emit(run(args), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
