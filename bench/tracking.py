"""What MLflow tracking costs a run: the retrain flow with and without it, in pairs.

After a first run that is not compared (it pays for what later runs reuse: the data gate's
verdict, staged files, the image), each pair runs the flow twice on the same data with tiny
training (``--force``, so both train):
once with ``tracking.mlflow_uri`` on a real ``mlflow server`` (started here as `make service`
starts it, on a SQLite store) and once with tracking off, in turn first. Each run is a fresh
interpreter, as a worker's flow run is, so the tracked one pays for importing MLflow as well
as its calls; both talk to one Prefect API started here. Measured per run: the wall time of
the flow, and the CPU time of the orchestrator's process (every thread; the trainer's processes
are not in it, and are not what tracking changes). The figures: each pair's difference, their
estimate with the order of the pair cancelled out, and the overhead as a share of an untracked
run; also what ``import mlflow`` alone costs a fresh interpreter.
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
import uuid
from pathlib import Path
from typing import Any

from bench.output import emit

ROOT = Path(__file__).resolve().parents[1]


def one_run(config_path: str, uri: str | None) -> dict[str, Any]:
    """One forced flow run in this process, tracked to ``uri`` (None: off): its wall and the
    CPU of this process."""
    from core.config import load_config
    from flows.retrain import retrain

    config = load_config(config_path, [f"tracking.mlflow_uri={uri or 'null'}"])
    cpu, wall = time.process_time(), time.perf_counter()
    state = retrain(config=config, force=True, return_state=True)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if not state.is_completed():
        raise RuntimeError(f"the flow ended {state.type}: {state.message}")
    return {"wall_seconds": round(wall, 3), "cpu_seconds": round(cpu, 3)}


def _child(config_path: Path, uri: str | None, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.tracking", "--one-run", str(config_path)]
    proc = subprocess.run(
        [*cmd, *(["--uri", uri] if uri else [])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"a run failed: {proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def measure(work: Path, pairs: int, epochs: int) -> dict[str, Any]:
    import yaml
    from prefect.server.api.server import SubprocessASGIServer

    from backends.blob import container_client, upload_directory
    from backends.local.azurite import running_azurite
    from backends.local.ports import free_port
    from core.config import load_config
    from deployments.tracking_server import running_mlflow
    from imagedata.make_images import write_digits

    source = work / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=None)
    suffix = uuid.uuid4().hex[:8]
    tree = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    tree["data"].update(container=f"bench-data-{suffix}")
    tree["output"].update(container=f"bench-out-{suffix}")
    tree.update(work_dir=str(work / "work"))
    tree["share"] = {"local_dir": str(work / "share")}
    tree["nfs"] = {"local_dir": str(work / "nfs")}
    tree["pool"].update(id=f"bench-{suffix}")
    tree["training"].update(epochs=epochs)
    config_path = work / "config.yaml"
    config_path.write_text(yaml.safe_dump(tree))
    config = load_config(config_path)
    # One Prefect API for every run (a temporary server on a fresh database), as a worker's
    # runs share their server.
    os.environ["PREFECT_HOME"] = str(work / "prefect-home")
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    prefect = SubprocessASGIServer(port=free_port())
    runs: list[dict[str, Any]] = []
    with running_azurite(work / "azurite") as conn, running_mlflow(work / "mlflow") as uri:
        os.environ[config.data.connection_string_env or ""] = conn
        upload_directory(container_client(config.data, create=True), source, config.data.prefix)
        prefect.start(timeout=300)
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PREFECT_API_URL": prefect.api_url,
            "PREFECT_LOGGING_LEVEL": "WARNING",
        }
        try:
            # The first run of a data version pays for what later runs reuse (the data gate's
            # verdict, staging, the image): measured, not compared.
            warm_up = _child(config_path, None, env)
            for pair in range(pairs):
                order = [uri, None] if pair % 2 == 0 else [None, uri]
                measured = {
                    ("tracked" if u else "untracked"): _child(config_path, u, env) for u in order
                }
                runs.append({"first": "tracked" if order[0] else "untracked", **measured})
                print(f"pair {pair + 1}: {runs[-1]}", file=sys.stderr, flush=True)
        finally:
            prefect.stop()
    return {"warm_up": warm_up, "runs": runs, **summary(runs), "import_mlflow": import_cost()}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each pair's difference (tracked minus untracked), for wall and CPU. The second run of a
    pair may be slower or faster whatever it is (what the first left behind): the estimate is
    the mean of the median difference of the pairs run tracked first and of those run
    untracked first, which cancels that order effect, and the effect itself is reported."""
    found: dict[str, Any] = {}
    for key in ("wall_seconds", "cpu_seconds"):
        deltas = [r["tracked"][key] - r["untracked"][key] for r in runs]
        groups = [
            [d for d, r in zip(deltas, runs, strict=True) if r["first"] == first]
            for first in ("tracked", "untracked")
        ]
        medians = [statistics.median(g) for g in groups if g]
        estimate = statistics.mean(medians)
        base = statistics.median(r["untracked"][key] for r in runs)
        found[key] = {
            "pair_differences": [round(d, 3) for d in deltas],
            "first_in_pair": [r["first"] for r in runs],
            "difference": round(estimate, 3),
            # Half the gap between the two orders: what running second adds or takes away.
            "order_effect": round((medians[1] - medians[0]) / 2, 3) if len(medians) == 2 else None,
            "median_untracked": round(base, 3),
            "share": round(estimate / base, 3) if base else None,
        }
    return found


def import_cost(repeats: int = 3) -> dict[str, float]:
    """CPU and wall of ``import mlflow`` in a fresh interpreter (median): the part of the
    overhead a run pays before its first call."""
    probe = (
        "import time, json; c, w = time.process_time(), time.perf_counter(); import mlflow; "
        "print(json.dumps([time.process_time() - c, time.perf_counter() - w]))"
    )
    found = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        found.append(json.loads(out.strip().splitlines()[-1]))
    return {
        "cpu_seconds": round(statistics.median(c for c, _ in found), 3),
        "wall_seconds": round(statistics.median(w for _, w in found), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.tracking",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=4,
        help="tracked and untracked runs, in pairs (even: "
        "as many run tracked first as untracked first)",
    )
    p.add_argument("--epochs", type=int, default=2, help="tiny training")
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("--one-run", metavar="CONFIG", help=argparse.SUPPRESS)
    p.add_argument("--uri", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one_run:
        print(json.dumps(one_run(args.one_run, args.uri)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-tracking-", dir="/tmp") as tmp:
        measured = measure(Path(tmp), args.pairs, args.epochs)
    report = {
        "benchmark": "tracking",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "method": f"flows.retrain on the local target, digits (1,797 images), {args.epochs} "
        "epoch(s) of the cnn on 2 Horovod processes, forced; tracked to a local mlflow server "
        f"(SQLite store) and untracked, {args.pairs} pair(s), each run a fresh interpreter",
        **measured,
    }
    return emit(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
