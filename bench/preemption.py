"""What a Spot preemption sets training back, against the checkpoint interval, and how long a
ResNet-50's emergency checkpoint takes.

Work lost: on an emulated Batch node (tests/fakes/hosts.py), the training task the pipeline
sends (2 ranks, its launcher and checkpoints on the NFS folder) is preempted at a random moment
of its training after its first checkpoint: every process on the node killed at once, as a VM
taken back. What a retry resumes from is the newest checkpoint that loads (the trainer's own
``newest_valid_checkpoint``); the work lost is the training time from that checkpoint's state
(its ``saved_at``) to the kill. Settings, side by side on the same data and model: checkpoints
once per epoch (as before ``training.checkpoint_minutes``), every I minutes for two I, and with a
``Preempt`` notice N s ahead on the node's Scheduled Events endpoint (tests/fakes/
scheduled_events.py) and no interval. The interval bounds the loss (plus the spacing of the
ranks' agreement points); a notice leaves only the seconds between the emergency checkpoint and
the end of the notice.

Emergency checkpoint: ResNet-50 in a trainer process (one rank, CPU unless a GPU is there, a few
batches at 32 px: the state does not depend on the image size), a ``Preempt`` event posted to its
endpoint; reported are the seconds from the event being posted to the checkpoint on disk (the
watcher's poll, the ranks' next agreement point, the copy to host memory, the write, fsync and
rename), as the trainer logs them and as the file's time shows, and the checkpoint's size.
Needs root for the emulated node; elsewhere the report says why the first part did not run.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.output import ROOT, emit

EPOCH_1 = re.compile(r'PROGRESS \{"epoch": 1, .*?"seconds": ([0-9.]+)')
EMERGENCY = re.compile(r"emergency (checkpoint-\S+\.pt) on disk .*?, ([0-9.]+) s after the node")


def _settings(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {"once per epoch": {"minutes": None, "notice": None}}
    for minutes in args.intervals:
        found[f"every {minutes:g} min"] = {"minutes": minutes, "notice": None}
    found[f"Preempt notice {args.notice:g} s ahead"] = {"minutes": None, "notice": args.notice}
    return found


def _newest_state(checkpoints: Path) -> tuple[str, float] | None:
    """(file name, saved_at) of what a retry would resume from."""
    from training.checkpoint import list_checkpoints, load_checkpoint

    for _, path in list_checkpoints(checkpoints):
        try:
            state = load_checkpoint(path)
        except ValueError:
            continue
        return path.name, float(state.get("saved_at") or path.stat().st_mtime)
    return None


def _trial(
    pool: Any, events: Any, setting: dict[str, Any], args: argparse.Namespace, n: int
) -> dict[str, Any]:
    from tests.nodes_helpers import JOB, task_body, training_spec

    overrides = [
        f"training.epochs={args.epochs}",
        "training.batch_size=4",
        f"training.image_size={args.image_size}",
        f"training.seed={n}",
        "pool.low_priority_nodes=1",
        "pool.dedicated_nodes=0",
        f"pool.scheduled_events_url={events.url()}",
    ]
    if setting["minutes"] is not None:
        overrides.append(f"training.checkpoint_minutes={setting['minutes']}")
    spec = training_spec(1, 2, *overrides)
    checkpoints = pool.nfs_dir / "checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)  # each trial from the start
    run = pool.start(task_body(spec), JOB)
    deadline = time.monotonic() + 3600
    # Epoch 1 over (its length) and its checkpoint on disk (written behind the PROGRESS line).
    while not (first := EPOCH_1.search(run.primary.stdout())) or not list(
        checkpoints.glob("*/checkpoint-*.pt")
    ):
        if run.done.is_set() or time.monotonic() > deadline:
            raise SystemExit(f"no first epoch:\n{run.primary.stdout()[-3000:]}")
        time.sleep(0.05)
    epoch_seconds = float(first.group(1))
    folder = next(checkpoints.glob("*/checkpoint-*.pt")).parent
    # A random moment of the second epoch.
    time.sleep(random.Random(n).uniform(0.0, epoch_seconds))
    noticed = None
    if setting["notice"] is not None:
        noticed = time.time()
        events.preempt([pool.ids[0]], setting["notice"])
        time.sleep(setting["notice"])
    killed = time.time()
    pool.node(pool.ids[0]).kill_processes()
    run.wait(timeout=120)
    newest = _newest_state(folder)
    assert newest is not None
    name, saved_at = newest
    return {
        "epoch_seconds": round(epoch_seconds, 1),
        "resumes_from": name,
        "work_lost_seconds": round(killed - saved_at, 2),
        "notice_to_checkpoint_seconds": round(saved_at - noticed, 2) if noticed else None,
    }


def work_lost(args: argparse.Namespace) -> dict[str, Any]:
    from imagedata.make_images import write_digits
    from tests.fakes.hosts import unavailable_reason
    from tests.fakes.node import PoolNodes
    from tests.fakes.scheduled_events import ScheduledEvents
    from tests.nodes_helpers import NODES, copy_scripts

    reason = unavailable_reason()
    if reason is not None:
        return {"skipped": reason}
    root = args.work / "pool"
    shutil.rmtree(root, ignore_errors=True)
    write_digits(root / "nfs" / "data", test_fraction=0.2, seed=0, per_class=None)
    found: dict[str, Any] = {}
    with (
        ScheduledEvents() as events,
        PoolNodes(root, NODES[:1], root / "nfs", copy_scripts) as pool,
    ):
        pool.node(pool.ids[0]).forward(events.port)
        for label, setting in _settings(args).items():
            trials = [_trial(pool, events, setting, args, n) for n in range(args.trials)]
            lost = [t["work_lost_seconds"] for t in trials]
            found[label] = {
                "epoch_seconds": statistics.median(t["epoch_seconds"] for t in trials),
                "checkpoint_minutes": setting["minutes"],
                "notice_seconds": setting["notice"],
                "trials": trials,
                "median_lost_seconds": round(statistics.median(lost), 2),
                "max_lost_seconds": round(max(lost), 2),
            }
            print(label, found[label], flush=True)
    return found


def emergency(args: argparse.Namespace) -> dict[str, Any]:
    """ResNet-50 in a trainer process, a Preempt event posted: seconds to the file on disk."""
    import torch

    from tests.fakes.scheduled_events import ScheduledEvents
    from training.preemption import URL_VARIABLE

    repeats = []
    for n in range(args.repeats):
        out = args.work / f"resnet50-{n}"
        shutil.rmtree(out, ignore_errors=True)
        with ScheduledEvents() as events:
            env = {**os.environ, URL_VARIABLE: events.url(), "PYTHONPATH": str(ROOT)}
            log = out.parent / f"resnet50-{n}.log"
            out.mkdir(parents=True)
            cmd = [sys.executable, "-m", "training.train", "--data-dir", "synthetic:2000"]
            cmd += ["--output-dir", str(out), "--model", "resnet50", "--image-size", "32"]
            cmd += ["--batch-size", "8", "--epochs", "1", "--log-every", "1"]
            with log.open("w") as sink:
                proc = subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    deadline = time.monotonic() + 900
                    while "epoch 1 batch 3:" not in log.read_text(errors="replace"):
                        if proc.poll() is not None or time.monotonic() > deadline:
                            raise SystemExit(f"no training:\n{log.read_text()[-3000:]}")
                        time.sleep(0.1)
                    posted = time.time()
                    events.preempt(["node-0"], notice_seconds=30)
                    while not (found := EMERGENCY.search(log.read_text(errors="replace"))):
                        if proc.poll() is not None or time.monotonic() > deadline:
                            raise SystemExit(f"no emergency checkpoint:\n{log.read_text()[-3000:]}")
                        time.sleep(0.05)
                finally:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            path = out / "checkpoints" / found.group(1)
            saved_at = float(torch.load(path, map_location="cpu", weights_only=True)["saved_at"])
            repeats.append(
                {
                    "posted_to_on_disk_seconds": round(path.stat().st_mtime - posted, 2),
                    "read_to_on_disk_seconds": float(found.group(2)),
                    # From the ranks' decision (the state taken) to the file renamed: the copy
                    # to host memory, serialising, the write, fsync and rename.
                    "decided_to_on_disk_seconds": round(path.stat().st_mtime - saved_at, 2),
                    "checkpoint_mb": round(path.stat().st_size / 1e6, 1),
                }
            )
            print("emergency", repeats[-1], flush=True)
    return {
        "model": "resnet50",
        "device": "cuda" if _cuda() else "cpu",
        "repeats": repeats,
        "median_posted_to_on_disk_seconds": statistics.median(
            r["posted_to_on_disk_seconds"] for r in repeats
        ),
        "median_read_to_on_disk_seconds": statistics.median(
            r["read_to_on_disk_seconds"] for r in repeats
        ),
        "median_decided_to_on_disk_seconds": statistics.median(
            r["decided_to_on_disk_seconds"] for r in repeats
        ),
    }


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="preemptions per setting")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=96, help="sets the epoch's length")
    parser.add_argument("--intervals", type=float, nargs="+", default=[0.1, 0.25])
    parser.add_argument("--notice", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3, help="ResNet-50 emergency checkpoints")
    parser.add_argument("--parts", nargs="+", default=["work_lost", "emergency"])
    parser.add_argument("--work", type=Path, default=ROOT / ".bench" / "preemption")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    from training.checkpoint_policy import AGREE_SECONDS
    from training.preemption import POLL_SECONDS

    report: dict[str, Any] = {
        "benchmark": "preemption",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "poll_seconds": POLL_SECONDS,
        "agree_seconds": AGREE_SECONDS,
    }
    if "work_lost" in args.parts:
        report["work_lost"] = work_lost(args)
    if "emergency" in args.parts:
        report["emergency"] = emergency(args)
    return emit(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
