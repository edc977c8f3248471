"""Warm start against from scratch, side by side in one run, on real images.

A v1 -> v2 pair from scikit-learn's real handwritten digits: v1 holds nine classes (no
``digit_9``) and half of the training images; v2 adds the other half and the tenth class, as a
new data version does. v1's model is trained from scratch; then on v2, one after the other in
this run:

- **scratch**: the recipe from random weights, ``--epochs E``;
- the same recipe from v1's ``model.pt`` (``--init-from``), once per fine-tuning variant:
  ``plain`` (no warm-up, the scratch recipe as it is: the trainer's default when starting from
  weights), ``warm-up`` (a linear warm-up from 0 over the first epoch), ``head-only 1``
  (only the classifier learns in epoch 1), ``backbone x0.1`` (the backbone at a tenth of the
  rate), the last two together, and ``lr x0.2`` (the whole network at a fifth of the
  recipe's rate);
- **short**: the default variant with ``--epochs k``, where k is the first epoch at which it
  reached scratch's final accuracy: the run a nightly would configure.

Each v2 run evaluates the test images after every epoch (they are also the ``val/`` split, read
for reporting only), and this process reads the trainer's own CPU time at each epoch's
``PROGRESS`` line: so "epochs and CPU-seconds until the test accuracy reaches scratch's final
accuracy" are read from one run of each, start-up included. Every run is one process on one
core of a shared machine: the CPU-seconds, not wall times, are the figure. Several seeds are
run, and each figure is given per seed: short runs on small data are chaotic, so one seed's
epoch count is an anecdote.

The on-paper cost per nightly run scales the measured share of epochs to an ImageNet-sized
data version (1.28 M images, 90 epochs from scratch) on the project's measured ResNet-50 rate
per H100 (docs/performance.md, "What each speed switch buys": 5,419 images/s, Horovod,
torch.compile, batch 256), an assumed 90% scaling across a node's GPUs, and the VMs' list
prices given on the command line (their source is recorded with the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from bench.output import ROOT, emit
from bench.warm_start_flow import add_arguments

# ResNet-50 at 224 px on one H100 80GB HBM3, the trainer's own step with torch.compile, batch
# 256, Horovod (docs/performance.md, "What each speed switch buys (2026-11-23)").
H100_IMAGES_PER_SEC = 5419
ASSUMED_SCALING = 0.9  # across the 8 GPUs of a node: assumed, not measured here
IMAGENET_IMAGES = 1_281_167
IMAGENET_EPOCHS = 90
# Linux pay-as-you-go list prices, US East; Azure's retail prices API
# (https://prices.azure.com/api/retail/prices) is not reachable from the machine that wrote
# these figures: check them there and pass --price-nd / --price-nc.
PRICE_SOURCE = (
    "Azure Linux pay-as-you-go list price, East US, as commonly quoted from Azure's retail "
    "prices API (prices.azure.com) in 2025; not re-checked from this machine, which cannot "
    "reach it"
)
SIZES = {  # name: (GPUs per node, $/hour)
    "ND96isr H100 v5": (8, 98.32),
    "NC40ads H100 v5": (1, 6.98),
}
VARIANTS: dict[str, list[str]] = {
    "plain": [],  # the trainer's defaults when starting from weights: no warm-up
    "warm-up": ["--warmup-epochs", "1"],
    "head-only 1": ["--head-only-epochs", "1"],
    "backbone x0.1": ["--backbone-lr-scale", "0.1"],
    "head-only 1, backbone x0.1": ["--head-only-epochs", "1", "--backbone-lr-scale", "0.1"],
    "lr x0.2": ["--lr", "0.01"],
}
DEFAULT_VARIANT = "plain"


def write_versions(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """v1 and v2 of the digits below ``root`` (the module docstring); each test split is
    also its val split, for the accuracy after every epoch."""
    from imagedata.make_images import write_digits

    v2, v1 = root / "v2", root / "v1"
    for folder in (v1, v2):
        shutil.rmtree(folder, ignore_errors=True)
    write_digits(v2, test_fraction=0.25, seed=seed, per_class=None)
    for split in ("train", "test"):
        for folder in sorted((v2 / split).iterdir()):
            if folder.name == "digit_9":
                continue
            files = sorted(folder.iterdir())
            if split == "train":
                files = files[::2]  # v2 adds the other half
            (v1 / split / folder.name).mkdir(parents=True)
            for f in files:
                shutil.copy(f, v1 / split / folder.name / f.name)
    for version in (v1, v2):
        shutil.copytree(version / "test", version / "val")
    return v1, v2


def train(data: Path, out: Path, epochs: int, seed: int, *extra: str) -> dict[str, Any]:
    """One trainer process; its metrics and its CPU-seconds at the end of each epoch."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "training.train",
        *("--data-dir", str(data), "--output-dir", str(out)),
        *("--epochs", str(epochs), "--seed", str(seed), "--batch-size", "32"),
        "--workers",
        "0",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    # One core: the trainer then runs one thread (training.distributed sizes torch's threads
    # by the CPU set), whose CPU-seconds do not grow with spinning when the machine is busy.
    core = max(os.sched_getaffinity(0))
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )
    watched = psutil.Process(proc.pid)
    cpu: list[float] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("PROGRESS ") and '"epoch"' in line:
            times = watched.cpu_times()
            cpu.append(times.user + times.system)
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
    metrics = json.loads((out / "metrics.json").read_text())
    return {
        "accuracy": [e["val_accuracy"] for e in metrics["epochs"]],
        "test_accuracy": metrics["test_accuracy"],
        "cpu_seconds": cpu,
        "wall_seconds": time.perf_counter() - started,
        "init_from": metrics.get("init_from"),
    }


def reached(run: dict[str, Any], target: float) -> tuple[int | None, float | None]:
    """The first epoch whose test accuracy reaches ``target``, and the CPU-seconds by then."""
    for epoch, accuracy in enumerate(run["accuracy"], start=1):
        if accuracy >= target - 1e-9:
            return epoch, run["cpu_seconds"][epoch - 1]
    return None, None


def one_seed(root: Path, seed: int, epochs: int, v1_epochs: int) -> dict[str, Any]:
    v1, v2 = write_versions(root / f"data-{seed}", seed)
    work = root / f"runs-{seed}"
    base = train(v1, work / "v1", v1_epochs, seed)
    model = work / "v1" / "model.pt"
    runs: dict[str, dict[str, Any]] = {"scratch": train(v2, work / "scratch", epochs, seed)}
    target = runs["scratch"]["accuracy"][-1]
    for name, extra in VARIANTS.items():
        runs[name] = train(v2, work / name, epochs, seed, "--init-from", str(model), *extra)
    for run in runs.values():
        run["reached_epoch"], run["reached_cpu_seconds"] = reached(run, target)
    short = runs[DEFAULT_VARIANT]["reached_epoch"]
    if short is not None:
        runs["short"] = train(
            v2, work / "short", short, seed, "--init-from", str(model), *VARIANTS[DEFAULT_VARIANT]
        )
        runs["short"]["reached_epoch"], runs["short"]["reached_cpu_seconds"] = reached(
            runs["short"], target
        )
    return {
        "seed": seed,
        "v1_accuracy": base["test_accuracy"],
        "v1_cpu_seconds": base["cpu_seconds"][-1],
        "target": target,
        "runs": runs,
    }


def nightly_cost(epoch_share: float, prices: dict[str, float]) -> list[dict[str, Any]]:
    """One nightly run of an ImageNet-sized version, from scratch and warm (``epoch_share`` of
    scratch's epochs), on one node of each size."""
    rows = []
    for size, (gpus, default_price) in SIZES.items():
        price = prices.get(size, default_price)
        rate = H100_IMAGES_PER_SEC * gpus * (ASSUMED_SCALING if gpus > 1 else 1.0)
        for start, epochs in (
            ("scratch", IMAGENET_EPOCHS),
            ("warm", IMAGENET_EPOCHS * epoch_share),
        ):
            hours = IMAGENET_IMAGES * epochs / rate / 3600
            rows.append(
                {
                    "size": size,
                    "gpus": gpus,
                    "price_per_hour": price,
                    "start": start,
                    "epochs": round(epochs, 1),
                    "hours": hours,
                    "cost": hours * price,
                }
            )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.work.mkdir(parents=True, exist_ok=True)
    if args.flow_only:
        from bench.warm_start_flow import measure, summary

        runs = measure(args.work / "flow", args.datasets, args.seeds, args.warm_args)
        return {"benchmark": "warm_start_flow", "flow": summary(runs)}
    seeds = [one_seed(args.work, seed, args.epochs, args.v1_epochs) for seed in args.seeds]
    shares = [
        s["runs"][DEFAULT_VARIANT]["reached_epoch"] / args.epochs
        for s in seeds
        if s["runs"][DEFAULT_VARIANT]["reached_epoch"] is not None
    ]
    share = max(shares) if shares else 1.0  # the least favourable seed
    prices = {"ND96isr H100 v5": args.price_nd, "NC40ads H100 v5": args.price_nc}
    return {
        "benchmark": "warm_start",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "method": (
            f"scikit-learn digits, cnn at 32 px, batch 32, lr 0.05, one process pinned to one "
            "core (one thread); "
            f"v1 trained {args.v1_epochs} epochs; every v2 run {args.epochs} epochs (short: "
            "until the default variant reached scratch's final accuracy)"
        ),
        "epochs": args.epochs,
        "v1_epochs": args.v1_epochs,
        "default_variant": DEFAULT_VARIANT,
        "seeds": seeds,
        "epoch_share": share,
        "cost": {
            "rows": nightly_cost(share, prices),
            "h100_images_per_sec": H100_IMAGES_PER_SEC,
            "scaling": ASSUMED_SCALING,
            "images": IMAGENET_IMAGES,
            "price_source": PRICE_SOURCE if args.price_source is None else args.price_source,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.warm_start", description=__doc__)
    p.add_argument("--epochs", type=int, default=8, help="of every v2 run")
    p.add_argument("--v1-epochs", type=int, default=6)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--price-nd", type=float, default=SIZES["ND96isr H100 v5"][1])
    p.add_argument("--price-nc", type=float, default=SIZES["NC40ads H100 v5"][1])
    p.add_argument("--price-source", help="where the prices given come from")
    p.add_argument("--work", type=Path, default=ROOT / ".bench" / "warm_start", help="scratch")
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument(
        "--flow-only",
        action="store_true",
        help="only the flow's side by side, as the nightly runs it (bench/warm_start_flow.py)",
    )
    add_arguments(p)
    args = p.parse_args(argv)
    return emit(run(args), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
