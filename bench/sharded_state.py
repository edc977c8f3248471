"""Optimizer state sharded across ranks: memory per rank and throughput, 2 ranks on CPU (Gloo).

One run trains ResNet-50 by default (SGD with momentum, fp32) for a few steps under each way,
each in 2 processes of its own started by ``torchrun``:

* ``ddp``: the DDP engine as it was, every rank holding the whole optimizer state;
* ``ddp_zero1``: the DDP engine with ``--shard-optimizer-state`` (``training.engine_ddp``'s
  ``ShardedOptimizer``, PyTorch's ``ZeroRedundancyOptimizer``: ZeRO stage 1);
* ``fsdp2``: PyTorch's ``fully_shard`` on every bottleneck block and the model (weights,
  gradients and optimizer state all sharded: ZeRO stage 3);
* ``deepspeed_zero1``, ``deepspeed_zero2``: DeepSpeed's ZeRO stages 1 and 2 with the same
  optimizer (DeepSpeed's CPU accelerator over Gloo), installed beside the bench when missing.

Per rank: the process's resident memory the model and training added (RSS after the steps,
less RSS before the model was built), its peak, and the bytes of optimizer state the rank holds
(the innermost PyTorch optimizer's state tensors; DeepSpeed's fp32 partitions counted too).
Throughput: images/s of all ranks over the timed steps, after warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.output import ROOT, emit

VARIANTS = ["ddp", "ddp_zero1", "fsdp2", "deepspeed_zero1", "deepspeed_zero2"]
DEEPSPEED = ["deepspeed==0.19.8", "hjson", "py-cpuinfo", "msgpack", "einops", "ninja"]


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _tensor_mib(values: Any) -> float:
    import torch

    total = 0
    for value in values:
        if isinstance(value, dict):
            total += int(_tensor_mib(value.values()) * 2**20)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total / 2**20


# ---------------------------------------------------------------------------- worker side


def _worker(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from training.models import build_model

    torch.set_num_threads(1)
    if variant.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    before = _rss_mib()
    torch.manual_seed(0)
    model = build_model(args.model, 10)
    sgd = {"lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}
    step, state_mib = _prepare(variant, model, sgd, args.batch_size)
    images = torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size)).float()
    labels = torch.arange(args.batch_size) % 10
    for _ in range(args.warmup):
        step(images, labels)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(args.steps):
        step(images, labels)
    dist.barrier()
    seconds = time.perf_counter() - started
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "images_per_sec": args.steps * args.batch_size * dist.get_world_size() / seconds,
        "rss_added_mib": round(_rss_mib() - before, 1),
        "peak_added_mib": round(_peak_mib() - before, 1),
        "optimizer_state_mib": round(state_mib(), 1),
        "param_mib": round(_tensor_mib(model.state_dict().values()), 1),
    }


def _prepare(variant: str, model: Any, sgd: dict[str, float], batch: int) -> tuple[Any, Any]:
    """The step of ``variant`` and a function giving the optimizer state this rank holds."""
    import torch
    from torch.nn.functional import cross_entropy

    optimizer: torch.optim.Optimizer
    if variant.startswith("deepspeed"):
        import deepspeed

        stage = int(variant[-1])
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
        }
        optimizer = torch.optim.SGD(model.parameters(), **sgd)  # type: ignore[arg-type]
        engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

        def ds_step(x: Any, y: Any) -> None:
            engine.backward(cross_entropy(engine(x), y))
            engine.step()

        def ds_state() -> float:
            inner = _tensor_mib(zero.optimizer.state.values())
            return inner + _tensor_mib(getattr(zero, "single_partition_of_fp32_groups", []))

        return ds_step, ds_state
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        from training.models import Bottleneck

        for block in [m for m in model.modules() if isinstance(m, Bottleneck)]:
            fully_shard(block)
        fully_shard(model)
        net, optimizer = model, torch.optim.SGD(model.parameters(), foreach=True, **sgd)  # type: ignore[arg-type]
        inner: Any = optimizer
    else:
        from torch.nn.parallel import DistributedDataParallel

        from training.engine_ddp import _shard

        net = DistributedDataParallel(model)
        plain = torch.optim.SGD(model.parameters(), foreach=True, **sgd)  # type: ignore[arg-type]
        optimizer = _shard(plain) if variant == "ddp_zero1" else plain
        inner = getattr(optimizer, "optim", optimizer)

    def step(x: Any, y: Any) -> None:
        cross_entropy(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, lambda: _tensor_mib(inner.state.values())


# ---------------------------------------------------------------------------- launcher side


def deepspeed_path(work: Path) -> tuple[Path | None, str]:
    """A folder with DeepSpeed for the worker's import path (installed there when missing, as
    the staging bench installs rclone), or None and why not."""
    target = work / "deepspeed"
    if not (target / "deepspeed").is_dir():
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            *DEEPSPEED,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return None, f"pip install deepspeed failed: {proc.stderr.strip()[-400:]}"
    return target, "installed"


def _launch(variant: str, args: argparse.Namespace, extra_path: Path | None) -> dict[str, Any]:
    torchrun = Path(sys.executable).parent / "torchrun"
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result"
        cmd = [
            str(torchrun), "--standalone", "--nproc-per-node", str(args.ranks),
            "-m", "bench.sharded_state", "--worker", variant, "--result", str(result),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch-size", str(args.batch_size), "--image-size", str(args.image_size),
            "--model", args.model,
        ]  # fmt: skip
        path = [str(ROOT), *([str(extra_path)] if extra_path else [])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "DS_ACCELERATOR": "cpu"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            return {"error": (proc.stdout + proc.stderr).strip()[-1500:]}
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("result.rank*"))]
    return {
        "images_per_sec": round(min(r["images_per_sec"] for r in ranks), 2),
        "per_rank": ranks,
        "rss_added_mib": max(r["rss_added_mib"] for r in ranks),
        "peak_added_mib": max(r["peak_added_mib"] for r in ranks),
        "optimizer_state_mib": max(r["optimizer_state_mib"] for r in ranks),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    args.work.mkdir(parents=True, exist_ok=True)
    ds_path, ds_note = deepspeed_path(args.work)
    results: dict[str, Any] = {}
    for variant in args.variants:
        if variant.startswith("deepspeed") and ds_path is None:
            results[variant] = {"error": ds_note}
            continue
        print(f"== {variant}", file=sys.stderr, flush=True)
        results[variant] = _launch(variant, args, ds_path if variant.startswith("deep") else None)
    base = results.get("ddp", {})
    ratios = {
        name: {
            "optimizer_state_over_ddp": round(
                r["optimizer_state_mib"] / base["optimizer_state_mib"], 3
            ),
            "rss_added_over_ddp": round(r["rss_added_mib"] / base["rss_added_mib"], 3),
            "images_per_sec_over_ddp": round(r["images_per_sec"] / base["images_per_sec"], 3),
        }
        for name, r in results.items()
        if "error" not in r and "error" not in base and base
    }
    return {
        "benchmark": "sharded_state",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "method": f"{args.model}, SGD with momentum, fp32, {args.ranks} ranks on CPU over Gloo "
        f"(one torch thread each), batch {args.batch_size} per rank at {args.image_size} px; "
        f"{args.warmup} warm-up steps, then {args.steps} timed; memory per rank is the largest "
        "over the ranks, throughput the slowest rank's view of all ranks' images/s",
        "deepspeed": ds_note,
        "variants": results,
        "ratios": ratios,
        "load_average": round(os.getloadavg()[0], 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.sharded_state",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--work", type=Path, default=ROOT / ".bench" / "sharded_state")
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        report = _worker(args.worker, args)
        Path(f"{args.result}.rank{report['rank']}").write_text(json.dumps(report))
        import torch.distributed as dist

        dist.destroy_process_group()
        return 0
    return emit(run(args), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
