"""The whole retrain flow on the local target with tiny training: where the wall time goes.

Two runs on the digits dataset (1,797 real images) against Azurite and a Prefect API: a first
run that does everything, and a re-run with nothing changed (the nightly retrain on the same
data). For each, from the task runs the Prefect API recorded:

* wall: the flow run's start to end;
* the sum of the step times (what a strictly sequential flow would spend in steps);
* the critical path: the longest chain through the flow's DAG, with the measured durations;
* orchestration overhead: wall minus critical path (task submission, state round trips to the
  API, gaps between steps);
* the speed-up from running the four concurrent steps (scripts, data, image, pool) side by
  side: their summed time over the span they took together.

Also the start-up cost of ``python -m flows.retrain --help`` against ``import prefect`` alone,
and which heavy libraries loading the flow module pulls in (it should pull in none).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from bench.output import emit
from flows.steps import ALWAYS, CONCURRENT, NAMES, graph

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "great_expectations", "azure.batch", "azure.storage.blob", "horovod", "numpy")


def critical_path(durations: dict[str, float]) -> tuple[float, list[str]]:
    """Length and steps of the longest chain through the flow's graph (flows/steps.py) of the
    steps in ``durations`` (those a run ran), listed in dependency order."""
    dag = graph(set(durations))
    finish: dict[str, tuple[float, list[str]]] = {}
    for step, waits in dag.items():  # the graph is in the steps' order
        before = max((finish[d] for d in waits), default=(0.0, []), key=lambda f: f[0])
        finish[step] = (before[0] + durations[step], [*before[1], step])
    return max(finish.values(), key=lambda f: f[0])


async def _task_runs(flow_run_id: UUID) -> tuple[Any, list[Any]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
        runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return flow_run, runs


def _seconds(start: datetime, end: datetime) -> float:
    return (end - start).total_seconds()


def analyse(flow_run_id: UUID) -> dict[str, Any]:
    flow_run, runs = asyncio.run(_task_runs(flow_run_id))
    spans: dict[str, tuple[datetime, datetime]] = {}
    for run in runs:
        step = run.name.rsplit("-", 1)[0]
        if step not in NAMES:
            raise RuntimeError(f"task {run.name!r} is not a step of flows/steps.py")
        spans[step] = (run.start_time, run.end_time)  # the last attempt's, if retried
    wall = _seconds(flow_run.start_time, flow_run.end_time)
    ran = [s for s in NAMES if s in spans]
    durations = {s: _seconds(*spans[s]) for s in ran}
    if not set(ran) & set(CONCURRENT):  # up to date: it ended before provisioning
        return {
            "up_to_date": True,
            "wall_seconds": round(wall, 3),
            "sum_of_steps_seconds": round(sum(durations.values()), 3),
            "steps": {s: round(d, 3) for s, d in durations.items()},
        }
    missing = [s for s in ALWAYS if s not in spans]
    if missing:
        raise RuntimeError(f"the flow run has no task run for {missing}")
    path_seconds, path = critical_path(durations)
    block = [spans[s] for s in CONCURRENT]
    block_span = _seconds(min(s for s, _ in block), max(e for _, e in block))
    block_sum = sum(durations[s] for s in CONCURRENT)
    return {
        "wall_seconds": round(wall, 3),
        "sum_of_steps_seconds": round(sum(durations.values()), 3),
        "critical_path_seconds": round(path_seconds, 3),
        "critical_path": path,
        "orchestration_overhead_seconds": round(wall - path_seconds, 3),
        "overhead_fraction_of_wall": round((wall - path_seconds) / wall, 3),
        "concurrent_steps": {
            "sum_seconds": round(block_sum, 3),
            "span_seconds": round(block_span, 3),
            "speedup": round(block_sum / block_span, 2) if block_span else None,
        },
        "steps": {s: round(d, 3) for s, d in durations.items()},
    }


def startup_cost(repeats: int) -> dict[str, Any]:
    """Median seconds of the CLI's --help against the import of Prefect alone."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def median(cmd: list[str]) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    help_s = median([sys.executable, "-m", "flows.retrain", "--help"])
    prefect_s = median([sys.executable, "-c", "import prefect"])
    python_s = median([sys.executable, "-c", "pass"])
    probe = f"import sys, flows.retrain; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()
    return {
        "help_seconds": round(help_s, 3),
        "import_prefect_seconds": round(prefect_s, 3),
        "bare_python_seconds": round(python_s, 3),
        "help_over_import_prefect": round(help_s / prefect_s, 2),
        "heavy_modules_loaded_by_flow_module": loaded.split(",") if loaded else [],
    }


def run_flows(work: Path, epochs: int) -> dict[str, Any]:
    from backends.blob import container_client, upload_directory
    from backends.local.azurite import running_azurite
    from core.config import load_config
    from flows.retrain import retrain
    from imagedata.make_images import write_digits

    source = work / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=None)
    suffix = uuid.uuid4().hex[:8]
    config = load_config(
        ROOT / "configs" / "local.yaml",
        [
            f"data.container=bench-data-{suffix}",
            f"output.container=bench-out-{suffix}",
            f"share.local_dir={work / 'share'}",
            f"nfs.local_dir={work / 'nfs'}",
            f"work_dir={work / 'work'}",
            f"pool.id=bench-{suffix}",
            f"training.epochs={epochs}",
            "tracking.mlflow_uri=null",  # bench/tracking.py measures what tracking costs
        ],
    )
    results: dict[str, Any] = {}
    with running_azurite(work / "azurite") as conn:
        os.environ[config.data.connection_string_env or ""] = conn
        upload_directory(container_client(config.data, create=True), source, config.data.prefix)
        for label in ("first_run", "rerun_unchanged"):
            started = time.perf_counter()
            state = retrain(config=config, return_state=True)
            caller_wall = time.perf_counter() - started
            if not state.is_completed():
                raise RuntimeError(f"{label}: the flow ended {state.type}: {state.message}")
            flow_run_id = state.state_details.flow_run_id
            assert flow_run_id is not None
            analysed = analyse(flow_run_id)
            # Before the flow run starts: the temporary Prefect API (first run only) and the
            # flow's own set-up; after it ends: the final state's round trip.
            results[label] = {
                **analysed,
                "caller_wall_seconds": round(caller_wall, 3),
                "outside_flow_run_seconds": round(caller_wall - analysed["wall_seconds"], 3),
            }
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.pipeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=1, help="tiny training")
    p.add_argument("--repeats", type=int, default=5, help="start-up timings")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        work = Path(tmp)
        # A Prefect API of the bench's own (a temporary server on a fresh database).
        os.environ["PREFECT_HOME"] = str(work / "prefect-home")
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "true"
        os.environ.pop("PREFECT_API_URL", None)
        runs = run_flows(work, args.epochs)
    report = {
        "benchmark": "pipeline",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "method": f"flows.retrain on the local target, digits (1,797 images), {args.epochs} "
        "epoch(s) of the cnn on 2 Horovod processes; times from the Prefect API's task runs",
        **runs,
        "startup": startup_cost(args.repeats),
    }
    return emit(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
