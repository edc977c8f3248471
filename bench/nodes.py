"""Training across hosts: what crossing them costs, and how long a launch takes.

On emulated Batch nodes (tests/fakes/hosts.py: each node its own network stack with an eth0 on
a shared bridge, host name and process tree; sshd started by the coordination command), the
training task the pipeline sends to Batch runs, with the same data, model and world size, as
  (a) 1 node x 2 processes: the ranks talk over the node's loopback, started locally,
  (b) 2 nodes x 1 process: the ranks talk over eth0 through the bridge, the second started
      over SSH,
each with the Horovod engine and again with the DDP engine (one torchrun per node),
and reports training images/s of each and the ratio b/a (the cost of the network stack between
hosts; the bridge has no real wire, so it is a floor for what a network adds), and the launch
overhead of each: seconds from the application command's start to rank 0's first optimizer
step, with the coordination command's time beside it. Needs root for the emulated nodes;
elsewhere the report says why it did not run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.output import ROOT, emit

SHAPES = {"1 node x 2 processes": (1, 2), "2 nodes x 1 process": (2, 1)}
DDP = "ddp, "  # the DDP engine's shapes are named with this prefix; Horovod's are not


def _engine(name: str) -> tuple[str, str]:
    """The engine and the shape of a measured row's name."""
    return ("ddp", name[len(DDP) :]) if name.startswith(DDP) else ("horovod", name)


def _run(
    pool: Any, nodes: int, ppn: int, args: argparse.Namespace, repeat: int, engine: str
) -> dict[str, Any]:
    from tests.nodes_helpers import metrics, run_task, training_spec

    shutil.rmtree(pool.nfs_dir / "checkpoints", ignore_errors=True)  # no run resumes another
    spec = training_spec(
        nodes,
        ppn,
        f"training.epochs={args.epochs}",
        f"training.batch_size={args.batch_size}",
        f"training.seed={repeat}",
        "training.extra_args=['--warmup-epochs', '0']",
        f"training.engine={engine}",
    )
    run = run_task(pool, spec)
    if run.exit_code != 0:
        raise SystemExit(f"{nodes}x{ppn} failed:\n{run.primary.stderr()[-3000:]}")
    m = metrics(run)
    assert run.application_started is not None
    return {
        "images_per_sec": m["images_per_sec"],
        "wall_seconds": m["wall_seconds"],
        "coordination_seconds": run.application_started - run.started,
        "launch_overhead_seconds": m["first_step_time"] - run.application_started,
        "world_size": m["world_size"],
        "test_accuracy": m["test_accuracy"],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    # The emulated nodes are the test suite's (run from the repository root, as make bench does).
    from tests.fakes.hosts import unavailable_reason

    report: dict[str, Any] = {
        "benchmark": "nodes",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "method": f"cnn at 32 px, {args.images} synthetic images, batch {args.batch_size} per "
        f"process, {args.epochs} epochs, world size 2, {args.repeats} runs of each shape "
        "alternating (medians); the 1-node shape on a node with all cores, the 2-node shape on "
        "nodes with half of them each",
    }
    reason = unavailable_reason()
    if reason is not None:
        return {**report, "not_run": reason}
    from imagedata.make_images import write_synthetic
    from tests.fakes.node import PoolNodes
    from tests.nodes_helpers import NODES, copy_scripts

    shutil.rmtree(args.work, ignore_errors=True)
    per_class = max(2, args.images // 10)
    write_synthetic(
        args.work / "nfs" / "data",
        classes=10,
        per_class=per_class,
        size=32,
        test_fraction=0.2,
        seed=0,
    )
    # The same cores in both shapes: one node with all of them, or two nodes with half each
    # (emulated nodes otherwise share every core, and each rank would size its threads to all).
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2 or 1
    split = [cores[:half], cores[half:] or cores[:half]]
    names = [*SHAPES, *(DDP + name for name in SHAPES)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    nfs = args.work / "nfs"
    with (
        PoolNodes(args.work / "one", NODES[:1], nfs, copy_scripts, cpus=[cores]) as one,
        PoolNodes(args.work / "two", NODES, nfs, copy_scripts, cpus=split) as two,
    ):
        pools = {"1 node x 2 processes": one, "2 nodes x 1 process": two}
        for repeat in range(args.repeats):  # alternate, so drift on a shared machine hits all
            for name in names:
                engine, shape = _engine(name)
                nodes, ppn = SHAPES[shape]
                runs[name].append(_run(pools[shape], nodes, ppn, args, repeat, engine))
    load = os.getloadavg()[1]  # the last 5 minutes: other work on a shared machine
    shapes = {
        name: {
            key: statistics.median(r[key] for r in results)
            for key in results[0]
            if key not in ("world_size",)
        }
        for name, results in runs.items()
    }
    one, two = (shapes[name] for name in SHAPES)
    ddp_one, ddp_two = (shapes[DDP + name] for name in SHAPES)
    return {
        **report,
        "shapes": shapes,
        "runs": runs,
        "load_average_5min": round(load, 2),
        "two_nodes_over_one_images_per_sec": round(
            two["images_per_sec"] / one["images_per_sec"], 3
        ),
        "ddp_two_nodes_over_one_images_per_sec": round(
            ddp_two["images_per_sec"] / ddp_one["images_per_sec"], 3
        ),
        "ddp_over_horovod_two_nodes_images_per_sec": round(
            ddp_two["images_per_sec"] / two["images_per_sec"], 3
        ),
        "launch_overhead_seconds": {
            "1 node": round(one["launch_overhead_seconds"], 2),
            "2 nodes": round(two["launch_overhead_seconds"], 2),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.nodes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--images", type=int, default=4000, help="synthetic images (80%% train)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="runs of each shape")
    p.add_argument("--work", type=Path, default=ROOT / ".bench" / "nodes", help="scratch")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    return emit(measure(args), args.json)


if __name__ == "__main__":
    sys.exit(main())
