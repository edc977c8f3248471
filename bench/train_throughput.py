"""Training throughput, measured side by side in one run and reported as ratios.

Default mode (CPU is fine): the same synthetic data, model and batch size through
  (a) a plain single-process PyTorch loop (no Horovod at all),
  (b) the trainer under ``horovodrun -np 1`` (what Horovod's machinery costs on one worker),
  (c) the trainer under ``horovodrun -np 2`` (scaling on this machine's cores),
  (d), (e) the trainer with ``--engine ddp`` under ``torchrun --standalone --nproc-per-node 1``
  and ``2`` (PyTorch's DistributedDataParallel over Gloo),
and prints images/sec and the ratios b/a, c/b, d/a, e/d and e/c.

``--gpu`` mode reproduces Horovod's synthetic benchmark: ResNet-50 on random 224x224 batches
resident on the GPU, AMP and channels_last, timed over several iterations after a warm-up;
run it as ``horovodrun -np <gpus> python -m bench.train_throughput --gpu`` (or
``torchrun --nproc-per-node <gpus> -m bench.train_throughput --gpu --engine ddp``) and it
reports images/sec per GPU and in total.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]


def plain_loop(data: str, model_name: str, batch_size: int, epochs: int, lr: float) -> float:
    """Images/sec of the simplest correct loop over the same data: the baseline."""
    from imagedata.data import open_dataset
    from training.args import default_input_size
    from training.models import build_model

    info = open_dataset(data, default_input_size(model_name))
    model = build_model(model_name, len(info.class_names))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    loss_fn = nn.CrossEntropyLoss()
    loader = DataLoader(info.splits["train"].dataset, batch_size=batch_size, shuffle=True)
    images, seconds = 0, 0.0
    for _ in range(epochs):
        model.train()
        started = time.perf_counter()
        for x, y in loader:
            loss = loss_fn(model(x.float()), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            images += len(y)
        seconds += time.perf_counter() - started
    return images / seconds


def trainer_run(
    np: int,
    data: str,
    model_name: str,
    batch_size: int,
    epochs: int,
    lr: float,
    engine: str = "horovod",
) -> float:
    """Images/sec the trainer itself reports (training time only, like the plain loop)."""
    bindir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as out:
        args = [
            *("--data-dir", data, "--output-dir", out, "--epochs", str(epochs)),
            *("--batch-size", str(batch_size), "--lr", str(lr), "--model", model_name),
            *("--warmup-epochs", "0", "--engine", engine),
        ]
        if engine == "ddp":  # torchrun starts the interpreter itself
            launcher = [str(bindir / "torchrun"), "--standalone", "--nproc-per-node", str(np)]
        else:
            launcher = [str(bindir / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}"]
            launcher += ["--gloo", sys.executable]
        cmd = [*launcher, "-m", "training.train", *args]
        env = {
            **os.environ,
            "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT),
        }
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        return float(json.loads((Path(out) / "metrics.json").read_text())["images_per_sec"])


def cpu_report(args: argparse.Namespace) -> dict[str, object]:
    data = f"synthetic:{args.images}"
    torch.set_num_threads(os.cpu_count() or 1)
    plain = plain_loop(data, args.model, args.batch_size, args.epochs, args.lr)
    rates = {
        f"{engine}_np{np}": trainer_run(
            np, data, args.model, args.batch_size, args.epochs, args.lr, engine
        )
        for engine in ("horovod", "ddp")
        for np in (1, 2)
    }
    return {
        "benchmark": "train_throughput",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "method": f"{args.model}, synthetic {args.images} images, batch {args.batch_size}/worker, "
        f"{args.epochs} epochs, training time only",
        "plain_images_per_sec": plain,
        **{f"{name}_images_per_sec": rate for name, rate in rates.items()},
        "horovod_np1_over_plain": rates["horovod_np1"] / plain,
        "horovod_np2_over_np1": rates["horovod_np2"] / rates["horovod_np1"],
        "ddp_np1_over_plain": rates["ddp_np1"] / plain,
        "ddp_np2_over_np1": rates["ddp_np2"] / rates["ddp_np1"],
        "ddp_np2_over_horovod_np2": rates["ddp_np2"] / rates["horovod_np2"],
    }


def gpu_benchmark(args: argparse.Namespace) -> dict[str, object] | None:
    """Horovod's synthetic benchmark method, through the trainer's own engine layer (so
    ``--engine ddp`` under torchrun measures the same step); only rank 0 returns the report."""
    from training import distributed as dist

    world = dist.init(args.engine)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        raise SystemExit("--gpu: no CUDA device here (pass --allow-cpu for a smoke run)")
    device = world.device
    rates = _timed_rates(args, device, world.size, cuda)
    mean = statistics.mean(rates)
    spread = 1.96 * statistics.stdev(rates) if len(rates) > 1 else 0.0
    all_means = [float(m) for m in dist.gather_objects(mean)]  # type: ignore[arg-type]
    # The wrapped model is gone by now (it lived in _timed_rates): a DDP model still alive when
    # the group is destroyed keeps Gloo's threads until the interpreter's teardown, where they
    # can hang or abort a finished run (the trainer's run() ends before its shutdown likewise).
    dist.shutdown(together=True)
    if world.rank != 0:
        return None
    return {
        "benchmark": "train_throughput --gpu",
        "machine": torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.machine()})",
        "method": f"{args.model} {args.image_size}x{args.image_size}, batch {args.batch_size}/GPU, "
        f"AMP={cuda}, channels_last, {args.iters}x{args.batches_per_iter} batches "
        f"after {args.warmup_batches} warm-up, engine {args.engine}",
        "engine": args.engine,
        "gpus": world.size,
        "images_per_sec_per_gpu": mean,
        "images_per_sec_per_gpu_ci95": spread,
        "images_per_sec_total": sum(all_means),
    }


def _timed_rates(
    args: argparse.Namespace, device: torch.device, world_size: int, cuda: bool
) -> list[float]:
    """Images/s of each timed iteration on this rank; the model and its wrapper live only here."""
    from training import distributed as dist
    from training.models import build_model

    if cuda:
        torch.backends.cudnn.benchmark = True
    model = build_model(args.model, 1000).to(device)  # channels_last on inputs: see trainer
    options = dist.GradientOptions(
        fp16_allreduce=args.fp16_allreduce,
        backward_passes_per_step=1,
        adasum=False,
        sync_batchnorm=False,
    )
    base = torch.optim.SGD(model.parameters(), lr=0.01 * world_size)
    net, optimizer = dist.wrap(model, base, options)
    dist.broadcast_state(model, optimizer)
    scaler = torch.amp.GradScaler("cuda", enabled=cuda)
    data = (
        torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size), device=device)
        .float()
        .contiguous(memory_format=torch.channels_last)
    )
    target = torch.randint(0, 1000, (args.batch_size,), device=device)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        with torch.autocast(device.type, enabled=cuda):
            loss = loss_fn(net(data).float(), target)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        dist.optimizer_step(optimizer, scaler)

    for _ in range(args.warmup_batches):
        step()
    rates = []
    for _ in range(args.iters):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(args.batches_per_iter):
            step()
        if cuda:
            torch.cuda.synchronize()
        rates.append(args.batch_size * args.batches_per_iter / (time.perf_counter() - started))
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.train_throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--gpu", action="store_true", help="Horovod synthetic benchmark mode")
    p.add_argument("--model", help="default: cnn, or resnet50 with --gpu")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--images", type=int, default=4000, help="CPU mode: synthetic images")
    p.add_argument("--epochs", type=int, default=3, help="CPU mode")
    p.add_argument("--lr", type=float, default=0.05, help="CPU mode")
    p.add_argument("--image-size", type=int, default=224, help="--gpu mode")
    p.add_argument("--iters", type=int, default=10, help="--gpu mode")
    p.add_argument("--batches-per-iter", type=int, default=10, help="--gpu mode")
    p.add_argument("--warmup-batches", type=int, default=10, help="--gpu mode")
    p.add_argument("--fp16-allreduce", action="store_true", help="--gpu mode")
    p.add_argument(
        "--engine",
        choices=("horovod", "ddp"),
        default="horovod",
        help="--gpu mode: under horovodrun, or ddp under torchrun",
    )
    p.add_argument("--allow-cpu", action="store_true", help="--gpu mode without a GPU (smoke)")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    args.model = args.model or ("resnet50" if args.gpu else "cnn")
    args.batch_size = args.batch_size or (64 if args.gpu else 32)
    report = gpu_benchmark(args) if args.gpu else cpu_report(args)
    if report is None:
        return 0
    for key, value in report.items():
        print(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
