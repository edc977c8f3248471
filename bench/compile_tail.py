"""The last, smaller batch of an epoch under ``torch.compile``: recompile for it, pad it, or drop
it; what each costs, measured in one run on one compiled model.

A compiled step is specialised to its input's shape. The epoch's last batch (the train split's
size modulo the batch) has another shape, so the compiler runs again for it, and then keeps a
graph with a dynamic batch size that full batches may use too. Measured, with the model
compiled as the trainer compiles it (``training.speed.forward_fn``):

* compile: the first full step (the compilation the run pays once anyway);
* recompile: the first partial step, with the compiler's count of graphs before and after;
* full steps before and after the recompilation (after it, the dynamic-shape graph);
* pad: the partial batch filled to the full size with repeated rows whose loss weight is zero,
  one full-sized step each epoch (and the duplicated rows still move BatchNorm's statistics);
* drop: nothing computed; the partial batch's images wait for the next epoch's shuffle.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch.nn.functional import cross_entropy

from bench.output import emit
from training import speed as fast
from training.models import build_model


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    # A cold compiler cache, as on a fresh node: compiled graphs cached on disk by an earlier
    # run would make both compilations look free.
    cache = tempfile.mkdtemp(prefix="compile-tail-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    speed = fast.resolve(
        device=device,
        precision="auto",
        no_amp=False,
        channels_last=False,
        compile_model=True,
        optimizer_kernel="auto",
        contiguous_grads=False,
    )
    model = build_model(args.model, 10).to(device)
    optimizer = fast.sgd(model.parameters(), speed, lr=0.01, momentum=0.9)
    forward = fast.forward_fn(model, speed)
    side = args.image_size

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 256, (n, 3, side, side), device=device)
        return fast.to_input(x, speed), torch.arange(n, device=device) % 10

    def step(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> float:
        started = time.perf_counter()
        with fast.autocast(speed):
            losses = cross_entropy(forward(x).float(), y, reduction="none")
        loss = losses.mean() if weight is None else (losses * weight).sum() / weight.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    full, part = batch(args.batch_size), batch(args.partial)
    compile_s = step(*full)
    before = statistics.median(step(*full) for _ in range(args.steps))
    graphs_before = _graphs()
    recompile_s = step(*part)
    graphs_after = _graphs()
    after = statistics.median(step(*full) for _ in range(args.steps))
    partial = statistics.median(step(*part) for _ in range(args.steps))
    repeat = args.batch_size // args.partial + 1
    padded_x = part[0].repeat(repeat, 1, 1, 1)[: args.batch_size]
    padded_y = part[1].repeat(repeat)[: args.batch_size]
    weight = (torch.arange(args.batch_size, device=device) < args.partial).float()
    pad = statistics.median(step(padded_x, padded_y, weight) for _ in range(args.steps))
    return {
        "benchmark": "compile_tail",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "method": f"{args.model} at {side} px on {device.type}, torch.compile as the trainer "
        f"does, full batches of {args.batch_size}, a last batch of {args.partial}; medians of "
        f"{args.steps} steps",
        "compile_seconds": round(compile_s, 2),
        "recompile_seconds": round(recompile_s, 2),
        "graphs_before_partial": graphs_before,
        "graphs_after_partial": graphs_after,
        "full_step_seconds": {"before": round(before, 4), "after_recompile": round(after, 4)},
        "partial_step_seconds": round(partial, 4),
        "padded_step_seconds": round(pad, 4),
        # Against dropping (nothing computed): recompiling costs the compilation once per
        # process (each restart of a job again), and then every epoch the partial step; every
        # full step after it may run the dynamic-shape graph. Padding costs every epoch one
        # full-sized step.
        "cost_against_drop_seconds": {
            "recompile_once": round(recompile_s - partial, 2),
            "recompile_per_epoch_after": round(partial, 4),
            "pad_per_epoch": round(pad, 4),
        },
        "recompile_over_pad_per_epoch": round((recompile_s - partial) / pad, 1),
        "images_deferred_by_drop": args.partial,
        "compiler_cache": "cold (a new cache folder)",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.compile_tail",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="cnn")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--partial", type=int, default=24, help="images in the last batch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    try:
        report = run(args)
    finally:
        shutil.rmtree(os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""), ignore_errors=True)
    return emit(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
