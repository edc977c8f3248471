"""Run every benchmark and write docs/performance.md: ``python -m bench`` (``make bench``).

Each benchmark runs in a process of its own (they set up their own Azurite, Prefect API and
thread counts) and leaves its JSON in the results folder; ``bench.report`` renders the page.
On a machine with a CUDA GPU the GPU variants run too, and their results are kept in
docs/bench-gpu/ for machines without one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.report import GPU_RESULTS, ROOT
from bench.report import main as render

FULL: dict[str, list[str]] = {
    "staging": [],
    "loading": [],
    "trainer": [],
    "pipeline": [],
    "train_throughput": [],
    "nodes": [],
    "gate_scale": [],
    "image": [],
    "feed": [],
    "compile_tail": [],
    "checkpoint_stall": [],
    "sharded_state": [],
    "tracking": [],
    "warm_start": [],
    "cost_estimate": [],
    "preemption": [],
    # Six flow runs per seed (3 seeds): about an hour on 2 cores; not in the quick plan.
    "warm_start_flow": [],
}
QUICK: dict[str, list[str]] = {
    "staging": [
        *("--small", "300", "--large", "2", "--large-mb", "34"),  # 3 ranges each
        *("--delays-ms", "0", "2", "--large-rounds", "2", "--resyncs", "1"),
    ],
    "loading": ["--images", "600"],
    "trainer": ["--images", "600", "--epochs", "1"],
    "pipeline": ["--repeats", "1"],
    "train_throughput": ["--images", "400", "--epochs", "1"],
    "nodes": ["--images", "400", "--epochs", "1", "--repeats", "1"],
    "gate_scale": [
        *("--train", "20000", "--test", "1000", "--classes", "100"),
        *("--expect-rows", "5000", "--sample", "100"),
        *("--ahead-blobs", "12000", "--page-delay-ms", "20", "--ahead-rounds", "1"),
    ],
    "image": [],  # one build from nothing, then one after a code change: no smaller size
    "feed": ["--images", "300", "--batch-size", "32"],
    "compile_tail": ["--batch-size", "16", "--partial", "8", "--steps", "1"],
    "checkpoint_stall": ["--model", "cnn", "--image-size", "32", "--repeats", "1", "--steps", "1"],
    "sharded_state": [
        *("--model", "cnn", "--image-size", "32", "--variants", "ddp", "ddp_zero1"),
        *("--steps", "1", "--warmup", "1"),
    ],
    "tracking": ["--pairs", "1", "--epochs", "1"],
    "warm_start": ["--epochs", "2", "--v1-epochs", "1", "--seeds", "0"],
    "cost_estimate": ["--runs", "3", "--small", "20"],
    "preemption": ["--trials", "1", "--epochs", "2", "--repeats", "1"],
    "warm_start_flow": ["--datasets", "digits", "--seeds", "0"],
}
# The benchmarks run on a machine with a CUDA GPU, whose results docs/bench-gpu/ keeps.
GPU_BENCHES = [
    "loading",
    "trainer",
    "train_throughput",
    "gpu_speed",
    "gpu_fed",
    "feed",
    "checkpoint_stall",
]


def _run(module: str, args: list[str], output: Path, prefix: list[str] | None = None) -> None:
    started = time.perf_counter()
    print(f"== bench.{module} {' '.join(args)}", flush=True)
    cmd = [*(prefix or []), sys.executable, "-m", f"bench.{module}", *args, "--json", str(output)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    print(f"   done in {time.perf_counter() - started:.0f} s", flush=True)


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _stamp(path: Path) -> None:
    data = json.loads(path.read_text())
    data["date"] = f"{datetime.now(UTC):%Y-%m-%d}"
    path.write_text(json.dumps(data, indent=2))


def _gpu_benches(chosen: list[str], gpus: int, where: dict[str, list[str]], scratch: Path) -> None:
    """The GPU variants, each result kept in docs/bench-gpu/ and stamped with the date."""
    GPU_RESULTS.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def run(module: str, args: list[str], name: str, prefix: list[str] | None = None) -> None:
        written.append(GPU_RESULTS / f"{name}.json")
        _run(module, args, written[-1], prefix)

    if "loading" in chosen:
        for size, model in (("32", "resnet18"), ("224", "resnet50")):
            run(
                "loading",
                ["--size", size, "--gpu-model", model, *where["loading"]],
                f"loading-{size}",
            )
    if "trainer" in chosen:
        options = ["--model", "resnet18", "--epochs", "3", "--batch-size", "128"]
        run("trainer", [*options, *where["trainer"]], "trainer")
    if "train_throughput" in chosen:
        horovodrun = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(gpus)]
        run("train_throughput", ["--gpu"], "train_throughput", horovodrun)
        torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(gpus)]
        run(
            "train_throughput",
            ["--gpu", "--engine", "ddp"],
            "train_throughput-ddp",
            [*torchrun, "--no-python"],  # it runs _run's own interpreter command
        )
    speed_work = ["--work", str(scratch / "gpu_speed")]
    if "gpu_speed" in chosen:
        # Each speed switch per engine, memory per batch size, the trainer fed from shards.
        run("gpu_speed", speed_work, "gpu_speed")
    if "gpu_fed" in chosen:
        run("gpu_speed", ["--fed-only", *speed_work], "gpu_fed")
    if "feed" in chosen:  # one core feeding the GPU: pinned batches, augmented on the device
        run("feed", where["feed"], "feed")
    if "checkpoint_stall" in chosen:
        run(
            "checkpoint_stall", ["--device", "cuda", *where["checkpoint_stall"]], "checkpoint_stall"
        )
    for path in written:
        _stamp(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the code, not speed")
    p.add_argument(
        "--only",
        nargs="*",
        choices=sorted(FULL),
        help="run just these (none: only the GPU benchmarks, on a GPU machine)",
    )
    p.add_argument(
        "--gpu-only",
        nargs="+",
        choices=GPU_BENCHES,
        help="on a GPU machine, run just these GPU benchmarks (default: all but gpu_fed, which "
        "gpu_speed includes)",
    )
    p.add_argument("--scratch", type=Path, default=ROOT / ".bench", help="datasets, work dirs")
    p.add_argument("--results", type=Path, default=ROOT / ".bench" / "results")
    p.add_argument("--output", type=Path, default=ROOT / "docs" / "performance.md")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    chosen = list(plan) if args.only is None else args.only
    args.results.mkdir(parents=True, exist_ok=True)
    for name in chosen:  # results of benchmarks not run this time are kept
        (args.results / f"{name}.json").unlink(missing_ok=True)
    # Where the benchmarks on generated datasets keep them and their scratch folders.
    where = {
        name: ["--source", str(args.scratch / "source"), "--work", str(args.scratch / name)]
        for name in ("staging", "loading", "trainer", "feed")
    }
    for name in (
        "nodes",
        "gate_scale",
        "checkpoint_stall",
        "sharded_state",
        "warm_start",
        "warm_start_flow",
    ):
        where[name] = ["--work", str(args.scratch / name)]
    try:
        for name in chosen:
            _run(name, [*plan[name], *where.get(name, [])], args.results / f"{name}.json")
        gpus = _gpus()
        if gpus and not args.quick:
            on_gpu = args.gpu_only or [name for name in GPU_BENCHES if name != "gpu_fed"]
            _gpu_benches(on_gpu, gpus, where, args.scratch)
    finally:
        # The staging benchmark's folders (thousands of files) go once nothing is measured
        # any more: deleting them taxes every file created soon after (bench.staging.run).
        if "staging" in chosen:
            shutil.rmtree(args.scratch / "staging", ignore_errors=True)
    return render([str(args.results), str(args.output)])


if __name__ == "__main__":
    raise SystemExit(main())
