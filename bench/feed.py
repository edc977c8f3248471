"""What one CPU core feeds a GPU from packed shards: images/s against what the GPU consumes.

On image folders packed at 224 px (``bench/dataset.py``, then ``imagedata.shards.pack_shards``,
as staging does), with this process and every thread it starts pinned to one core
(``os.sched_setaffinity``, ``torch.set_num_threads(1)``), one shuffled pass per way of reading,
in one run (the page cache warm: a first pass reads the shards once):

* ``per_image``: the trainer's loader before batches were gathered whole: a ``DataLoader`` in
  the process (no workers: one core), ``__getitem__`` per row, collated (and pinned on a GPU
  machine);
* ``batched``: the trainer's loader now (``imagedata.batches.ShardBatches``): each batch gathered
  whole into one (pinned) buffer, one batch ahead in a thread;
* ``cpu_augment``: what one core delivers when it also crops and flips each image on the CPU,
  as per-sample transforms do (edge padding, a random crop, a mirror half the time), which
  ``imagedata.augment.flip_crop`` does on the device instead.

The GPU's rate is the trainer's synthetic ResNet-50 rate at 224 px with every speed switch on
(``docs/bench-gpu/gpu_speed.json``, per engine). With a CUDA device here, ``gpu`` adds the
whole feed on one core: batches gathered into pinned memory, copied to the device and augmented
there (and the GPU rate is read from the same file, measured on its own machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler

from bench import dataset
from bench.output import ROOT, dataset_main
from imagedata.augment import SHIFT_FRACTION, flip_crop
from imagedata.batches import ShardBatches
from imagedata.data import open_dataset
from imagedata.shards import ShardSplit, pack_shards

# What ``bench.gpu_speed`` measured: the whole table of steps, and the fed-only run (which
# measures the last step, every switch on, beside the trainer fed from shards).
GPU_SPEED = [ROOT / "docs" / "bench-gpu" / name for name in ("gpu_speed.json", "gpu_fed.json")]
SIZE = 224


def gpu_rates(paths: list[Path] = GPU_SPEED, device: str | None = None) -> dict[str, Any]:
    """Images/s the GPU consumes per engine: the torch.compile step of ``bench.gpu_speed``,
    from its result measured on ``device`` (the GPU this run feeds) when there is one, else
    from the newest; so a feed measured on one GPU is set against that GPU's own rate. A
    result with no date is the newest: ``python -m bench`` dates the GPU results only once
    every GPU benchmark has run, and this one runs after ``gpu_speed``."""
    found = []
    for path in paths:
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        rates = {}
        for engine, per in report["engines"].items():
            for row in per["steps"]:
                if row["step"] == "torch.compile" and "images_per_sec" in row:
                    rates[engine] = round(row["images_per_sec"], 1)
        if rates:
            machine = str(report["machine"])
            mine = device is not None and machine.split(",")[0].strip() == device
            found.append((mine, report.get("date"), machine, rates))
    if not found:
        raise FileNotFoundError(f"no GPU rate measured: none of {[str(p) for p in paths]}")
    _, date, machine, rates = max(found, key=lambda f: (f[0], f[1] is None, f[1] or ""))
    return {"machine": machine, "date": date, "images_per_sec": rates}


def one_core() -> int:
    """Pin this process (and the threads it starts later) to one core; return which."""
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return core


def _sampler(split: ShardSplit, seed: int) -> RandomSampler:
    return RandomSampler(split, generator=torch.Generator().manual_seed(seed))


def _rate(batches: Iterable[Any], limit: int | None, consume: Any = None) -> dict[str, float]:
    """Images per second of wall time, and per second of this process's CPU time (all its
    threads): on a core shared with other work the second is what the core itself delivers."""
    images = 0
    started, cpu = time.perf_counter(), time.process_time()
    for i, (x, _) in enumerate(batches):
        if consume is not None:
            consume(x)
        images += len(x)
        if limit is not None and i + 1 >= limit:
            break
    return {
        "wall": round(images / (time.perf_counter() - started), 1),
        "cpu": round(images / (time.process_time() - cpu), 1),
    }


def per_image(split: ShardSplit, batch_size: int, pin: bool, limit: int | None) -> dict[str, float]:
    loader = DataLoader(split, batch_size=batch_size, sampler=_sampler(split, 1), pin_memory=pin)
    return _rate(loader, limit)


def batched(split: ShardSplit, batch_size: int, pin: bool, limit: int | None) -> dict[str, float]:
    return _rate(ShardBatches(split, _sampler(split, 2), batch_size, pin=pin), limit)


def cpu_augment(split: ShardSplit, batch_size: int, limit: int | None) -> dict[str, float]:
    """Images/s of cropping and flipping each image on the CPU, one at a time (the batches
    themselves gathered as above): the work a per-sample transform puts on the host."""

    rng = np.random.default_rng(0)
    pad = SIZE // SHIFT_FRACTION

    def each(x: torch.Tensor) -> None:
        # What torchvision's RandomCrop(padding, padding_mode="edge") and RandomHorizontalFlip
        # do to one image: pad, cut the crop out, mirror it half the time.
        for image in x.numpy():
            padded = np.pad(image, ((0, 0), (pad, pad), (pad, pad)), mode="edge")
            top, left = rng.integers(0, 2 * pad + 1, size=2)
            crop = padded[:, top : top + SIZE, left : left + SIZE]
            np.ascontiguousarray(crop[:, :, ::-1] if rng.random() < 0.5 else crop)

    return _rate(ShardBatches(split, _sampler(split, 3), batch_size), limit, each)


def gpu_feed(split: ShardSplit, batch_size: int, limit: int | None) -> dict[str, float]:
    """The whole feed on one core: pinned batches, copied to the device, augmented there."""
    device = torch.device("cuda")

    def to_device(x: torch.Tensor) -> None:
        flip_crop(x.to(device, non_blocking=True)).float()

    batches = ShardBatches(split, _sampler(split, 4), batch_size, pin=True)
    rate = _rate(batches, limit, to_device)["wall"]
    torch.cuda.synchronize()
    images = torch.randint(0, 256, (batch_size, 3, SIZE, SIZE), dtype=torch.uint8, device=device)
    flip_crop(images)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(50):
        flip_crop(images)
    torch.cuda.synchronize()
    augment = 50 * batch_size / (time.perf_counter() - started)
    return {"images_per_sec": round(rate, 1), "augment_on_device_images_per_sec": round(augment)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    source = dataset.images(args.source / "feed", args.images, args.kb)
    folder = args.work / "images"
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    shutil.copytree(source, folder)
    pack = pack_shards(folder, SIZE)
    info = open_dataset(str(folder), SIZE)
    split = info.splits["train"].dataset
    if not isinstance(split, ShardSplit):
        raise RuntimeError(f"shards not used: {info.notes}")
    core = one_core()
    cuda = torch.cuda.is_available()
    batched(split, args.batch_size, False, None)  # reads every shard once: the cache is warm
    rates = {
        "per_image": per_image(split, args.batch_size, cuda, args.batches),
        "batched": batched(split, args.batch_size, cuda, args.batches),
        "cpu_augment": cpu_augment(split, args.batch_size, args.batches),
    }
    gpu = gpu_rates(device=torch.cuda.get_device_name(0) if cuda else None)
    needed = max(gpu["images_per_sec"].values())
    cpu = {k: v["cpu"] for k, v in rates.items()}
    report: dict[str, Any] = {
        "benchmark": "feed",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "method": f"{len(split):,} training images packed at {SIZE} px "
        f"({len(split) * split.row_bytes / 1e6:,.0f} MB of shards), batch {args.batch_size}, "
        "shuffled, "
        + (f"first {args.batches} batches" if args.batches else "one pass")
        + f" per way; this process pinned to core {core}, one torch thread; page cache warm; "
        + (
            "pinned host memory"
            if cuda
            else "no GPU here, so pageable host memory (pinning is "
            "paid once per buffer by the allocator's cache, not per batch)"
        ),
        "images": len(split),
        "batch_size": args.batch_size,
        "pinned": cuda,
        "pack_seconds": pack.seconds,
        "images_per_sec": rates,
        "load_average": round(os.getloadavg()[0], 1),
        "batched_over_per_image": round(cpu["batched"] / cpu["per_image"], 2),
        "gpu_rate": gpu,
        "one_core_over_gpu": round(cpu["batched"] / needed, 2),
        "per_image_over_gpu": round(cpu["per_image"] / needed, 2),
        "cpu_augment_cores_per_gpu": round(needed / cpu["cpu_augment"], 2),
    }
    if cuda:
        report["gpu"] = {
            "device": torch.cuda.get_device_name(0),
            **gpu_feed(split, args.batch_size, args.batches),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.feed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--images", type=int, default=4000, help="PNGs generated, then packed")
    p.add_argument("--kb", type=float, default=3, help="size of each PNG, about")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--batches", type=int, help="stop each pass after this many batches")
    return dataset_main(p, "feed", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
