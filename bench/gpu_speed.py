"""What each speed switch of the trainer buys on one GPU: ResNet-50 at 224 px, per engine.

``python -m bench.gpu_speed --json OUT`` runs, for each engine (Horovod under ``horovodrun
-np 1``, DDP under ``torchrun --nproc-per-node 1``), the trainer's own set-up and its own
``train_step`` with the switches added one at a time (the steps below, cumulative), each step in
a process of its own. Batches are generated once on the GPU as uint8, so the figure is what the
model, the step and the engine can do (the synthetic rate); several timed windows after a
warm-up give the spread, and the warm-up (with ``--compile``, the compilation) is timed
separately. Then, with the last step's switches:

* memory: peak GPU memory per batch size, doubling until the GPU is full, and the largest
  batch that fits (bisected);
* fed from packed shards: the trainer itself (``python -m training.train``) on image folders
  packed at 224 px, its last epoch's images/s against the synthetic rate.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Cumulative: each step adds its options to those of the steps before it.
STEPS: list[tuple[str, list[str]]] = [
    (
        "today's trainer (fp16 autocast, NHWC inputs, foreach SGD, batch 64)",
        ["--precision", "fp16", "--optimizer-kernel", "foreach"],
    ),
    ("bf16 autocast (no loss scaling)", ["--precision", "bf16"]),
    ("fused SGD", ["--optimizer-kernel", "fused"]),
    ("channels-last weights", ["--channels-last", "--optimizer-kernel", "auto"]),
    ("batch 256 per GPU", ["--batch-size", "256"]),
    ("torch.compile", ["--compile"]),
    # Not cumulative in spirit: the one row that undoes a choice, to show why bf16 is kept.
    ("fp16 autocast instead of bf16 (with loss scaling)", ["--precision", "fp16"]),
]
BASE = ["--model", "resnet50", "--image-size", "224", "--batch-size", "64"]


def step_options(upto: int) -> list[str]:
    """The trainer options of step ``upto`` (later options win, as in argparse)."""
    words = list(BASE)
    for _, options in STEPS[: upto + 1]:
        words += options
    return words


# ---------------------------------------------------------------------------- worker side


def _job(options: list[str], out: Path) -> Any:
    """The trainer's set-up, as ``python -m training.train`` does it, on synthetic data."""
    import training.train as trainer
    from training.args import parse_trainer_args

    args = parse_trainer_args([*options, "--data-dir", "synthetic:4096", "--output-dir", str(out)])
    return trainer.set_up(args, trainer.start_world(args))


def _batch(job: Any, size: int) -> tuple[Any, Any]:
    import torch

    from training import speed as fast

    side = job.args.input_size()
    gen = torch.Generator(device=job.world.device).manual_seed(0)
    images = torch.randint(
        0, 256, (size, 3, side, side), dtype=torch.uint8, device=job.world.device, generator=gen
    )
    labels = torch.randint(0, 10, (size,), device=job.world.device, generator=gen)
    return fast.to_input(images, job.trainer.speed), labels


def _timed_steps(job: Any, images: Any, labels: Any, steps: int) -> float:
    import torch

    cuda = job.world.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        job.trainer.train_step(images, labels)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def worker_rate(job: Any, warmup: int, windows: int, steps: int) -> dict[str, Any]:
    """Images/s of the trainer's step on resident batches: mean and spread over windows."""
    import torch

    size = job.args.batch_size
    images, labels = _batch(job, size)
    warm = _timed_steps(job, images, labels, warmup)
    cuda = job.world.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rates = [size * steps / _timed_steps(job, images, labels, steps) for _ in range(windows)]
    return {
        "batch_size": size,
        "speed": job.trainer.speed.describe(),
        "warmup_seconds": warm,
        "warmup_steps": warmup,
        "images_per_sec": statistics.mean(rates),
        "images_per_sec_sd": statistics.stdev(rates) if len(rates) > 1 else 0.0,
        "windows": rates,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def worker_memory(job: Any, start: int, limit: int) -> dict[str, Any]:
    """Peak memory and images/s per batch size, doubling until out of memory, then bisecting
    between the last size that fit and the first that did not."""
    import torch

    results: dict[int, dict[str, float]] = {}

    def fits(size: int) -> bool:
        try:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            images, labels = _batch(job, size)
            _timed_steps(job, images, labels, 3)
            seconds = _timed_steps(job, images, labels, 5)
            results[size] = {
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "images_per_sec": size * 5 / seconds,
            }
            del images, labels
            return True
        except torch.OutOfMemoryError:
            job.trainer.optimizer.zero_grad()
            torch.cuda.empty_cache()
            return False

    good, bad = 0, None
    size = start
    while size <= limit:
        if not fits(size):
            bad = size
            break
        good, size = size, size * 2
    while bad is not None and bad - good > max(8, good // 16):
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return {
        "per_batch": {str(k): v for k, v in sorted(results.items())},
        "largest_batch": good,
        "first_failing_batch": bad,
        "gpu_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
    }


# ---------------------------------------------------------------------------- launcher side


def launched(engine: str, module: str, procs: int = 1) -> list[str]:
    """The command that starts ``python -m module`` as ``procs`` ranks of ``engine``."""
    bindir = Path(sys.executable).parent
    if engine == "ddp":
        ranks = ["--standalone", "--nproc-per-node", str(procs)]
        return [str(bindir / "torchrun"), *ranks, "-m", module]
    hosts = ["-np", str(procs), "-H", f"localhost:{procs}"]
    return [str(bindir / "horovodrun"), *hosts, sys.executable, "-m", module]


def engine_options(engine: str) -> list[str]:
    return [] if engine == "horovod" else ["--engine", engine]


def _child_env() -> dict[str, str]:
    bindir = Path(sys.executable).parent
    return {
        **os.environ,
        "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
    }


def _in_worker(engine: str, mode: list[str], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [
            *launched(engine, "bench.gpu_speed"),
            *mode,
            "--result",
            str(result),
        ]
        subprocess.run(cmd, cwd=ROOT, env=_child_env(), check=True, timeout=timeout)
        return dict(json.loads(result.read_text()))


# The shards-fed run augments on the device, as a run on real data would: the feed measured is
# the whole of it (ShardBatches on the host, crops and flips on the GPU).
FED_EXTRA = ["--augment"]


def fed_from_shards(engine: str, options: list[str], images: int, work: Path) -> dict[str, Any]:
    """The trainer itself on packed image folders: its last epoch's images/s."""
    from bench import dataset
    from imagedata.shards import pack_shards

    folder = dataset.images(work, images, 224 * 224 * dataset.BYTES_PER_PIXEL_PNG / 1024)
    packed = pack_shards(folder, 224)
    out = work / f"fed-{engine}"
    cmd = [
        *launched(engine, "training.train"),
        *engine_options(engine),
        *options,
        *FED_EXTRA,
        "--data-dir",
        str(folder),
        "--output-dir",
        str(out),
        "--epochs",
        "3",
        "--no-verify-images",
    ]
    subprocess.run(cmd, cwd=ROOT, env=_child_env(), check=True, timeout=1200)
    metrics = json.loads((out / "metrics.json").read_text())
    epochs = metrics["epochs"]
    return {
        "images": images,
        "pack": packed.as_dict(),
        "epoch_images_per_sec": [e["images_per_sec"] for e in epochs],
        "images_per_sec": epochs[-1]["images_per_sec"],
        "read_from": metrics["dataset"]["kind"],
        "extra": FED_EXTRA,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_speed", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--json", type=Path, help="write the report here (launcher)")
    p.add_argument("--engines", nargs="+", default=["horovod", "ddp"])
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--steps", type=int, default=25, help="steps per timed window")
    p.add_argument("--fed-images", type=int, default=16000, help="0: skip the shards run")
    p.add_argument("--work", type=Path, default=ROOT / ".bench" / "gpu_speed")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-steps", action="store_true", help="only the memory and shards runs")
    p.add_argument("--step-indices", type=int, nargs="+", help="run only these steps")
    p.add_argument("--final", help="trainer options of the memory and shards runs")
    p.add_argument(
        "--fed-only",
        action="store_true",
        help="only the synthetic rate with every switch on and the shards-fed runs, reported "
        "as the gpu_fed benchmark (minutes, where the whole table takes most of an hour)",
    )
    # Under the launcher: --result FILE {rate|memory} <trainer options>
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.result is not None:
        return _worker(args, rest)
    return _launch(args)


def _worker(args: argparse.Namespace, words: list[str]) -> int:
    mode, options = words[0], words[1:]
    with tempfile.TemporaryDirectory() as out:
        job = _job(options, Path(out))
        if mode == "memory":
            report = worker_memory(job, start=64, limit=4096)
        else:
            report = worker_rate(job, args.warmup, args.windows, args.steps)
        if job.world.is_root:
            args.result.write_text(json.dumps({"options": options, **report}))
    return 0


def _launch(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_speed needs a CUDA GPU")
    if args.fed_only:
        args.step_indices = [[name for name, _ in STEPS].index("torch.compile")]
        args.skip_memory = True
    report: dict[str, Any] = {
        "benchmark": "gpu_fed" if args.fed_only else "gpu_speed",
        "machine": f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {platform.python_version()}",
        "method": f"ResNet-50 at 224 px, synthetic uint8 batches resident on the GPU, the "
        f"trainer's own step; {args.warmup} warm-up steps, then {args.windows} windows of "
        f"{args.steps} steps; each step of the table in a fresh process",
        "steps": [name for name, _ in STEPS],
        "engines": {},
    }

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))

    for engine in [] if args.skip_steps else args.engines:
        rows: list[dict[str, Any]] = []
        report["engines"][engine] = {"steps": rows}
        for i, (name, _) in enumerate(STEPS):
            if args.step_indices is not None and i not in args.step_indices:
                continue
            options = [*engine_options(engine), *step_options(i)]
            print(f"== {engine}: {name}", flush=True)
            try:
                row = _in_worker(engine, ["rate", *options], timeout=900)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                row = {"error": str(exc)}
            rows.append({"step": name, **row})
            print(f"   {row.get('images_per_sec', row.get('error'))}", flush=True)
            save()
    best = [name for name, _ in STEPS].index("torch.compile")
    final = step_options(best) if args.final is None else args.final.split()
    eager = [w for w in final if w != "--compile"]
    first = args.engines[0]
    if not args.skip_memory:
        print("== memory per batch size", flush=True)
        report["memory"] = _in_worker(
            first, ["memory", *engine_options(first), *eager], timeout=900
        )
        save()
    if args.fed_images:
        for engine in args.engines:
            print(f"== {engine}: fed from packed shards", flush=True)
            try:
                fed = fed_from_shards(engine, final, args.fed_images, args.work)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
                fed = {"error": str(exc)}
            report.setdefault("fed", {})[engine] = fed
            save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
