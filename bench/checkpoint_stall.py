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

Once to the local disk, then again in a process whose every fsync strace holds for a while: a
checkpoint folder on a network share (Azure Files over NFS on Batch) acknowledges a flush later
than a local disk, as ``bench/delay_proxy.py`` makes Azurite answer later. Reported per target:
the stall per checkpoint each way (median wall seconds, and the CPU seconds of the stalled
thread), their ratio, the background write's own duration, and the steps' slowdown during a
write. Nothing is asserted about the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
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


def _timed(fn: Any) -> tuple[float, float]:
    """Wall seconds of ``fn()`` and the CPU seconds this thread spent in it (on a core shared
    with other work, the second is the work itself)."""
    started, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - started, time.thread_time() - cpu


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both ways, alternating, in this process: the stalls, the write, the steps beside it."""
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    device = torch.device(args.device)
    model, optimizer, step = _setup(args.model, args.image_size, args.batch_size, device)

    def steps() -> None:
        for _ in range(args.steps):
            step()

    steps()  # warm: allocations and kernels chosen before anything is timed
    got: dict[str, list[float]] = {
        k: [] for k in ("in_line", "in_line_cpu", "background", "background_cpu", "write")
    }
    clean, during = [], []
    writer = ckpt.CheckpointWriter(args.work, keep=2)
    epoch = 0
    for _ in range(args.repeats):
        epoch += 1
        state = _state(model, optimizer, epoch)

        def in_line(state: dict[str, Any] = state, epoch: int = epoch) -> None:
            ckpt.atomic_save(state, ckpt.checkpoint_path(args.work, epoch))
            ckpt.prune_checkpoints(args.work, 2)

        wall, cpu = _timed(in_line)
        got["in_line"].append(wall)
        got["in_line_cpu"].append(cpu)
        clean.append(_timed(steps)[0])
        epoch += 1
        started = time.perf_counter()
        state = _state(model, optimizer, epoch)
        wall, cpu = _timed(lambda state=state, epoch=epoch: writer.save(state, epoch))
        got["background"].append(wall)
        got["background_cpu"].append(cpu)
        during.append(_timed(steps)[0])
        writer.wait()
        got["write"].append(time.perf_counter() - started)
    median = statistics.median
    stall = {k: round(median(v), 4) for k, v in got.items() if k != "write"}
    return {
        "checkpoint_mb": round(ckpt.checkpoint_path(args.work, epoch).stat().st_size / 1e6, 1),
        "stall_seconds": stall,
        "in_line_over_background": round(stall["in_line"] / stall["background"], 1),
        "background_write_seconds": round(median(got["write"]), 3),
        "steps_seconds": {
            "no_write": round(median(clean), 3),
            "during_write": round(median(during), 3),
        },
        "steps_during_write_over_no_write": round(median(during) / median(clean), 2),
        "samples": got,
    }


def _held_fsync(args: argparse.Namespace, delay_ms: int) -> dict[str, Any]:
    """:func:`measure` in a process whose every fsync strace holds ``delay_ms`` (a share that
    acknowledges a flush that much later, as ``bench/delay_proxy.py`` delays each request)."""
    strace = shutil.which("strace")
    if strace is None:
        return {"error": "strace is missing (make setup installs it as root)"}
    result = args.work.with_name(f"{args.work.name}-{delay_ms}ms.json")
    cmd = [
        strace, "-f", "-qq", "-o", os.devnull, "-e", "trace=fsync",
        "-e", f"inject=fsync:delay_enter={delay_ms * 1000}",
        sys.executable, "-m", "bench.checkpoint_stall", "--measure-only",
        "--model", args.model, "--repeats", str(args.repeats), "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--image-size", str(args.image_size),
        "--device", args.device, "--work", str(args.work.with_name(f"{args.work.name}-held")),
        "--json", str(result),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return dict(json.loads(result.read_text()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    targets = {"local disk": measure(args)}
    for delay in args.fsync_delay_ms:
        targets[f"a share whose fsync takes {delay:,} ms"] = _held_fsync(args, delay)
    size = targets["local disk"]["checkpoint_mb"]
    held = bool(args.fsync_delay_ms)
    return {
        "benchmark": "checkpoint_stall",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "method": f"{args.model} (weights and SGD momentum: {size:,.0f} MB per checkpoint) on "
        f"{_device_name(device)}, {torch.get_num_threads()} torch threads, written with fsync; "
        f"{args.repeats} repeats of each way, alternating; {args.steps} training steps (batch "
        f"{args.batch_size} at {args.image_size} px) after each checkpoint"
        + ("; a slower share is the same disk with every fsync held by strace" * held),
        "device": _device_name(device),
        "checkpoint_mb": size,
        "load_average": round(os.getloadavg()[0], 1),
        "targets": targets,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.checkpoint_stall",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="resnet50")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="training steps after each checkpoint")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--work", type=Path, default=ROOT / ".bench" / "checkpoint_stall")
    p.add_argument(
        "--fsync-delay-ms",
        type=int,
        nargs="*",
        default=[1000],
        help="also measure with every fsync held this long (strace)",
    )
    p.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    return emit(measure(args) if args.measure_only else run(args), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
