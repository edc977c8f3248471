"""The cost estimate against what runs measured, on the local target, for runs of different sizes.

One data root with two data versions of the digits (a small one and the whole set) and a
sequence of retrain runs of different data and epochs, each forced to train. Before each run,
the flow estimates its node-minutes from the config and the root's earlier runs
(``core/cost_estimate.py``); after it, the local node's own timestamps give what it used
(``backends/cost.py``, as Batch's would). The error is ``(estimate - measured) / measured``.

The peer it is compared with is what a person would guess without the estimator: the same
node-minutes as the root's previous run. Both are scored on the same runs (those with at least
one earlier run); the first run, estimated from the config alone, is shown apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any, cast

from bench.output import emit

ROOT = Path(__file__).resolve().parents[1]
# (data version, epochs) of each run, in order: sizes go up and down, so neither the estimate
# nor the previous run's figure can just follow a trend.
PLAN = [("v1", 2), ("v2", 1), ("v1", 4), ("v2", 3), ("v1", 1), ("v2", 2), ("v2", 4), ("v1", 3)]


def _error(estimate: float, measured: float) -> float:
    return (estimate - measured) / measured


def run_sequence(work: Path, plan: list[tuple[str, int]], small: int) -> list[dict[str, Any]]:
    from backends.blob import container_client, upload_directory
    from backends.local.azurite import running_azurite
    from bench.pipeline import local_config
    from flows.retrain import retrain
    from imagedata.make_images import write_digits

    sources = {"v1": work / "small", "v2": work / "whole"}
    write_digits(sources["v1"], test_fraction=0.25, seed=0, per_class=small)
    write_digits(sources["v2"], test_fraction=0.25, seed=0, per_class=None)
    base = local_config(work, "pool.processes_per_node=1", "image.builder=none")
    rows: list[dict[str, Any]] = []
    with running_azurite(work / "azurite") as conn:
        os.environ[base.data.connection_string_env or ""] = conn
        data = container_client(base.data, create=True)
        for version, source in sources.items():
            upload_directory(data, source, f"{base.data.prefix}/{version}")
            data.upload_blob(f"{base.data.prefix}/{version}/_SUCCESS", b"")
        for version, epochs in plan:
            config = base.model_copy(
                update={
                    "data": base.data.pinned(version),
                    "training": dataclasses.replace(base.training, epochs=epochs),
                }
            )
            state = retrain(config=config, force=True, return_state=True)
            if not state.is_completed():
                raise RuntimeError(f"{version} x {epochs}: the flow ended {state.message}")
            result = cast(dict[str, Any], state.result())
            cost = result["cost"]
            estimate = cost["estimate"]
            gate = {s["step"]: s for s in result["steps"]}["validate-data"]["details"]
            rows.append(
                {
                    "version": version,
                    "images": gate["images"],
                    "epochs": epochs,
                    "history_runs": estimate["history_runs"],
                    "estimate_node_minutes": estimate["total_node_minutes"],
                    "measured_node_minutes": cost["total_node_minutes"],
                    "estimate_by_phase": estimate["node_minutes"],
                    "measured_by_phase": cost["node_minutes"],
                    "training_basis": estimate["basis"].get("training"),
                    # Other work on the machine slows a run the estimate cannot foresee.
                    "load_average": round(os.getloadavg()[0], 1),
                }
            )
            print(
                f"{version} x {epochs}: estimate {estimate['total_node_minutes']:.3f}, "
                f"measured {cost['total_node_minutes']:.3f} node-minutes",
                flush=True,
            )
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Errors of the estimate and of the previous run's figure, on the runs with history."""
    scored = rows[1:]
    ours = [_error(r["estimate_node_minutes"], r["measured_node_minutes"]) for r in scored]
    naive = [
        _error(before["measured_node_minutes"], r["measured_node_minutes"])
        for before, r in zip(rows, scored, strict=False)
    ]
    for r, e, n in zip(scored, ours, naive, strict=True):
        r["error"], r["previous_run_error"] = round(e, 4), round(n, 4)
    rows[0]["error"] = round(
        _error(rows[0]["estimate_node_minutes"], rows[0]["measured_node_minutes"]), 4
    )
    ours_median = statistics.median(abs(e) for e in ours)
    naive_median = statistics.median(abs(e) for e in naive)
    return {
        "runs_scored": len(scored),
        "median_abs_error": round(ours_median, 4),
        "max_abs_error": round(max(abs(e) for e in ours), 4),
        "within_25_percent": sum(abs(e) <= 0.25 for e in ours),
        "previous_run_median_abs_error": round(naive_median, 4),
        "previous_run_max_abs_error": round(max(abs(e) for e in naive), 4),
        "previous_run_within_25_percent": sum(abs(e) <= 0.25 for e in naive),
        "error_ratio_previous_over_estimate": round(naive_median / ours_median, 2)
        if ours_median
        else None,
        "first_run_error": rows[0]["error"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.cost_estimate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--runs", type=int, default=len(PLAN), help=f"the first N of {PLAN}")
    p.add_argument("--small", type=int, default=40, help="images per class of version v1")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    plan = PLAN[: max(args.runs, 2)]
    with tempfile.TemporaryDirectory(prefix="bench-cost-") as tmp:
        work = Path(tmp)
        os.environ["PREFECT_HOME"] = str(work / "prefect-home")
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "true"
        os.environ.pop("PREFECT_API_URL", None)
        from flows.temporary_server import temporary_server_settings

        with temporary_server_settings(say=lambda line: print(line, flush=True)):
            rows = run_sequence(work, plan, args.small)
    report = {
        "benchmark": "cost_estimate",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "method": f"{len(plan)} runs of flows.retrain on the local target, one data root with "
        f"versions v1 ({args.small} digits per class) and v2 (all 1,797), the cnn on one "
        "process, each run forced to train; estimate before the run, node-minutes measured "
        "from the local node's timestamps",
        "summary": summarize(rows),
        "runs": rows,
    }
    return emit(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
