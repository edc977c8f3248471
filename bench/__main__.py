"""Run every benchmark and write docs/performance.md: ``python -m bench`` (``make bench``).

Each benchmark runs in a process of its own (they set up their own Azurite, Prefect API and
thread counts) and leaves its JSON in the results folder; ``bench.report`` renders the page.
On a machine with a CUDA GPU the GPU variants run too, and their results are kept in
docs/bench-gpu/ for machines without one.
"""

from __future__ import annotations

import argparse
import json
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
}
QUICK: dict[str, list[str]] = {
    "staging": ["--small", "300", "--large", "2", "--large-mb", "12", "--delays-ms", "0", "2"],
    "loading": ["--images", "600"],
    "trainer": ["--images", "600", "--epochs", "1"],
    "pipeline": ["--repeats", "1"],
    "train_throughput": ["--images", "400", "--epochs", "1"],
    "nodes": ["--images", "400", "--epochs", "1", "--repeats", "1"],
    "gate_scale": [
        *("--train", "20000", "--test", "1000", "--classes", "100"),
        *("--expect-rows", "5000", "--sample", "100"),
    ],
    "image": [],  # one build from nothing, then one after a code change: no smaller size
}


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the code, not speed")
    p.add_argument("--only", nargs="+", choices=sorted(FULL), help="run just these")
    p.add_argument("--scratch", type=Path, default=ROOT / ".bench", help="datasets, work dirs")
    p.add_argument("--results", type=Path, default=ROOT / ".bench" / "results")
    p.add_argument("--output", type=Path, default=ROOT / "docs" / "performance.md")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    args.results.mkdir(parents=True, exist_ok=True)
    for name in args.only or plan:  # results of benchmarks not run this time are kept
        (args.results / f"{name}.json").unlink(missing_ok=True)
    # Where the benchmarks on generated datasets keep them and their scratch folders.
    where = {
        name: ["--source", str(args.scratch / "source"), "--work", str(args.scratch / name)]
        for name in ("staging", "loading", "trainer")
    }
    where["nodes"] = ["--work", str(args.scratch / "nodes")]
    where["gate_scale"] = ["--work", str(args.scratch / "gate_scale")]
    for name in args.only or plan:
        _run(name, [*plan[name], *where.get(name, [])], args.results / f"{name}.json")
    gpus = _gpus()
    if gpus and not args.quick:
        GPU_RESULTS.mkdir(parents=True, exist_ok=True)
        for size, model in (("32", "resnet18"), ("224", "resnet50")):
            _run(
                "loading",
                ["--size", size, "--gpu-model", model, *where["loading"]],
                GPU_RESULTS / f"loading-{size}.json",
            )
        _run(
            "trainer",
            ["--model", "resnet18", "--epochs", "3", "--batch-size", "128", *where["trainer"]],
            GPU_RESULTS / "trainer.json",
        )
        horovodrun = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(gpus)]
        _run("train_throughput", ["--gpu"], GPU_RESULTS / "train_throughput.json", horovodrun)
        torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(gpus)]
        _run(
            "train_throughput",
            ["--gpu", "--engine", "ddp"],
            GPU_RESULTS / "train_throughput-ddp.json",
            [*torchrun, "--no-python"],  # it runs _run's own interpreter command
        )
        # Each speed switch per engine, memory per batch size, the trainer fed from shards.
        speed_work = ["--work", str(args.scratch / "gpu_speed")]
        _run("gpu_speed", speed_work, GPU_RESULTS / "gpu_speed.json")
        for path in GPU_RESULTS.glob("*.json"):
            _stamp(path)
    return render([str(args.results), str(args.output)])


if __name__ == "__main__":
    raise SystemExit(main())
