"""The trainer itself on loose files and on packed shards: the same data, seed and model, run
twice in one run, so the difference is only how the images reach the model.

Each run is ``python -m training.train`` in one process (Horovod of size 1), on its own copy of
the image folders (``bench/dataset.py``); the packed copy is packed first at the model's input
size, as staging does. Reported: training images/s (the trainer's own figure, training time
only), the run's wall time (start-up, verification and evaluation included), the ratios, and a
check that both copies yield identical samples (so the runs differ only in how they read).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import dataset
from bench.output import ROOT, dataset_main
from imagedata.shards import pack_shards
from training.architectures import MODEL_NAMES
from training.args import default_input_size


def train(data: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "training.train",
        "--data-dir",
        str(data),
        "--output-dir",
        str(out),
        "--model",
        args.model,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--warmup-epochs",
        "0",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return dict(json.loads((out / "metrics.json").read_text()))


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def identical_samples(loose: Path, packed: Path, size: int, count: int = 256) -> int:
    """How many of ``count`` random train samples are bit-identical in both copies."""
    import torch

    from imagedata.data import open_dataset

    split = open_dataset(str(loose), size, use_shards=False).splits["train"]
    a, b = split.dataset, open_dataset(str(packed), size).splits["train"].dataset
    picks = torch.randperm(len(split), generator=torch.Generator().manual_seed(0))[:count]
    return sum(1 for i in picks.tolist() if a[i][1] == b[i][1] and torch.equal(a[i][0], b[i][0]))


def run(args: argparse.Namespace) -> dict[str, Any]:
    source = dataset.images(args.source, args.images, args.kb)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    runs: dict[str, dict[str, Any]] = {}
    for name in ("loose", "shards"):
        folder = args.work / name
        subprocess.run(["cp", "-r", str(source), str(folder)], check=True)
        if name == "shards":
            pack_shards(folder, default_input_size(args.model))
        metrics = train(folder, args.work / f"out-{name}", args)
        runs[name] = {
            "dataset": metrics["dataset"]["kind"],
            "images_per_sec": round(metrics["images_per_sec"], 1),
            "wall_seconds": round(metrics["wall_seconds"], 2),
            "test_loss": metrics["test_loss"],
            "device": metrics["device"],
        }
    return {
        "benchmark": "trainer",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, device {_device_name()}",
        "method": f"{args.model} at {default_input_size(args.model)} px, {args.images} PNGs of "
        f"~{args.kb} KB ({args.images * 4 // 5} train), batch {args.batch_size}, "
        f"{args.epochs} epochs, one process; the trainer's default data loader settings",
        **runs,
        "shards_over_loose_images_per_sec": round(
            runs["shards"]["images_per_sec"] / runs["loose"]["images_per_sec"], 2
        ),
        "loose_over_shards_wall": round(
            runs["loose"]["wall_seconds"] / runs["shards"]["wall_seconds"], 2
        ),
        "identical_samples": identical_samples(
            args.work / "loose", args.work / "shards", default_input_size(args.model)
        ),
        "samples_checked": 256,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="cnn", choices=MODEL_NAMES)
    p.add_argument("--images", type=int, default=20_000)
    p.add_argument("--kb", type=float, default=20)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    return p


def main(argv: list[str] | None = None) -> int:
    return dataset_main(parser(), "trainer", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
