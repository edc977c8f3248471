"""The trainer's data loading, loose image files against packed shards, in one run.

On one image-folder dataset (by default 20,000 PNGs of about 20 KB, ``bench/dataset.py``):

* the trainer's start-up, ``open_dataset``: loose (it decodes every image once to find damaged
  ones) against shards (damaged images were found when packing);
* one epoch through the same ``DataLoader`` the trainer builds (shuffled, batch 64), with the
  loader in the training process and with worker processes, images/sec each way;
* the packing itself, which staging pays once per data version.

``--gpu-model`` adds what a GPU consumes: that model's training steps per second on batches
already on the device, so the report says whether loading or compute bounds an epoch.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from bench import dataset
from bench.output import dataset_main
from imagedata.data import open_dataset
from imagedata.shards import pack_shards


def epoch_rate(split: Any, batch_size: int, workers: int, batches: int | None) -> float:
    """Images/sec of one shuffled pass (or its first ``batches``), worker start-up included."""
    loader = DataLoader(
        split.dataset,
        batch_size=batch_size,
        sampler=RandomSampler(split.dataset, generator=torch.Generator().manual_seed(0)),
        num_workers=workers,
    )
    images = 0
    started = time.perf_counter()
    for i, (x, _) in enumerate(loader):
        images += len(x)
        if batches is not None and i + 1 >= batches:
            break
    return images / (time.perf_counter() - started)


def gpu_consumption(model_name: str, size: int, batch_size: int, classes: int) -> dict[str, Any]:
    """Training images/sec of the model on device-resident batches: the rate to keep fed."""
    from training.models import build_model

    device = torch.device("cuda")
    model = build_model(model_name, classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randint(0, 256, (batch_size, 3, size, size), device=device).float()
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch_size,), device=device)

    def step() -> None:
        with torch.autocast("cuda"):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    steps = 200
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return {
        "model": model_name,
        "device": torch.cuda.get_device_name(device),
        "images_per_sec": round(steps * batch_size / (time.perf_counter() - started), 1),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    source = dataset.images(args.source, args.images, args.kb)
    folder = args.work / "images"
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    subprocess.run(["cp", "-r", str(source), str(folder)], check=True)
    files, size = dataset.tree_bytes(folder)
    workers = (
        args.workers if args.workers is not None else max(1, min(8, (os.cpu_count() or 2) - 1))
    )
    started = time.perf_counter()
    loose = open_dataset(str(folder), args.size, use_shards=False)
    t_open_loose = time.perf_counter() - started
    pack = pack_shards(folder, args.size)
    started = time.perf_counter()
    packed = open_dataset(str(folder), args.size)
    t_open_packed = time.perf_counter() - started
    if packed.kind != "image-folders (packed shards)":
        raise RuntimeError(f"shards not used: {packed.notes}")
    rates: dict[str, dict[str, float]] = {}
    for name, info in (("loose", loose), ("shards", packed)):
        rates[name] = {
            f"workers_{w}": round(
                epoch_rate(info.splits["train"], args.batch_size, w, args.batches), 1
            )
            for w in (0, workers)
        }
    best = {name: max(r.values()) for name, r in rates.items()}
    report: dict[str, Any] = {
        "benchmark": "loading",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "method": f"{files} PNGs ({size / 1e6:.0f} MB) at {args.size} px, batch "
        f"{args.batch_size}, shuffled, "
        + (f"first {args.batches} batches" if args.batches else "one epoch of train")
        + f"; loader in-process and with {workers} worker processes; page cache warm",
        "images": files,
        "train_images": len(loose.splits["train"]),
        "open_seconds": {"loose": round(t_open_loose, 3), "shards": round(t_open_packed, 3)},
        "open_loose_over_shards": round(t_open_loose / t_open_packed, 1),
        "images_per_sec": rates,
        "shards_over_loose": round(best["shards"] / best["loose"], 1),
        "pack": {
            **pack.as_dict(),
            "images_per_sec": round(pack.images / pack.seconds, 1),
        },
    }
    if args.gpu_model:
        report["gpu"] = gpu_consumption(
            args.gpu_model, args.size, args.batch_size, len(loose.class_names)
        )
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.loading",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--images", type=int, default=20_000)
    p.add_argument("--kb", type=float, default=20, help="size of each PNG, about")
    p.add_argument("--size", type=int, default=32, help="the model's input size")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batches", type=int, help="stop each pass after this many batches")
    p.add_argument("--workers", type=int, help="loader processes (default: the trainer's)")
    p.add_argument("--gpu-model", help="also measure this model's training rate on the GPU")
    return dataset_main(p, "loading", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
