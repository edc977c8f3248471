"""The first `make demo`: where its time goes, from the demo's own step timings.

A person's first demo builds the training image from nothing (docs/performance.md, the image's
section), while the local cluster trains on this machine's files. Each run here is
`scripts/demo.py` as `make demo` runs it, from an empty image cache of its own (buildah storage,
registry, base: only the Horovod wheel `make setup` built is reused, as on a new machine), its
own data folder and Prefect home, no MLflow, the registry on a free port. The figures are read
from the demo's own output: each step's log lines carry the time, so the end of training, of
scoring, of the promotion, of the image's build and of the flow run are placed against the
flow run's start.

``--baseline REV`` runs the demo of that git revision too (extracted with ``git archive``, on
this checkout's environment), before this checkout's, on the same machine: a change to the
critical path is read side by side. Each run builds the image from nothing (minutes); not part
of ``make bench`` (``python -m bench.demo``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.output import ROOT, emit
from bench.report import machine

LOG = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \| \w+\s*\| (Task|Flow) run '([^']+)' - (.*)$")
TOTAL = re.compile(r"^demo finished in (\d+)s")
# The steps placed on the run's time line: the step's task name without Prefect's suffix.
MARKS = {
    "training_end": "run-training",
    "scored": "collect-and-score",
    "promoted": "promote",
    "image_end": "build-image",
    "report_end": "report",
}


def timeline(output: str) -> dict[str, float]:
    """Seconds from the flow run's start to the end of each step of :data:`MARKS` and to the
    flow run's end, from the demo's log lines; ``total``: the demo's own 'finished in'."""
    found: dict[str, float] = {}
    start: float | None = None
    last = 0.0
    for line in output.splitlines():
        if total := TOTAL.match(line):
            found["total"] = float(total.group(1))
        match = LOG.match(line)
        if not match:
            continue
        h, m, s, ms, kind, name, message = match.groups()
        at = int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000
        while at < last:  # past midnight
            at += 86400
        last = at
        if kind == "Flow" and start is None and message.startswith("Beginning flow run"):
            start = at
        if start is None or not message.startswith("Finished in state Completed"):
            continue
        if kind == "Flow":
            found["flow_end"] = at - start
        step = name.rsplit("-", 1)[0]
        for mark, task in MARKS.items():
            if step == task:
                found[mark] = at - start
    return found


def _checkout(revision: str, work: Path) -> Path:
    """``revision``'s files in a folder of ``work``, on this checkout's environment."""
    target = work / f"checkout-{revision}"
    target.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", revision], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    for shared in (".venv", "node_modules"):
        (target / shared).symlink_to(ROOT / shared)
    return target


def run_demo(checkout: Path, work: Path) -> dict[str, Any]:
    """One first demo of ``checkout`` in ``work``: its time line and exit status."""
    from backends.local.buildah import horovod_wheel_cache
    from backends.local.ports import free_port

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(
        XDG_CACHE_HOME=str(work / "cache"),
        HOROVOD_WHEEL_CACHE=str(horovod_wheel_cache()),  # `make setup`'s, read before the change
        PREFECT_HOME=str(work / "prefect"),
        PATH=f"{checkout / '.venv' / 'bin'}:{env.get('PATH', '')}",
    )
    command = [
        str(checkout / ".venv" / "bin" / "python"),
        "scripts/demo.py",
        "--dir",
        str(work / "demo"),
        "--set",
        f"image.registry=127.0.0.1:{free_port()}",
        "--set",
        "tracking.mlflow_uri=null",
    ]
    started = time.perf_counter()
    done = subprocess.run(
        command,
        cwd=checkout,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream: the log lines in the order they were written
        text=True,
        timeout=3 * 3600,
    )
    return {
        "exit_code": done.returncode,
        "wall_seconds": time.perf_counter() - started,
        **timeline(done.stdout),
    }


def _clean(work: Path) -> None:
    """Everything a run stored: its buildah storage (layers of GBs), registry and data."""
    from backends.local.buildah import Buildah

    if (work / "cache" / "retrain-image" / "build").exists():
        Buildah(work / "cache" / "retrain-image" / "build").remove_all()
    shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from backends.local.buildah import unavailable_reason

    report: dict[str, Any] = {
        "benchmark": "demo",
        "machine": machine(),
        "date": f"{datetime.now(UTC):%Y-%m-%d}",
        "method": (
            "scripts/demo.py as `make demo` runs it, from an empty image cache of its own (the "
            "Horovod wheel of `make setup` reused), its own data folder and Prefect home, no "
            "MLflow; times from the demo's own log lines, against the flow run's start"
        ),
    }
    reason = unavailable_reason()
    if reason:
        report["skipped"] = reason
        return report
    runs: list[tuple[str, Path]] = []
    scratch = Path(tempfile.mkdtemp(prefix="bench-demo-", dir=args.work))
    try:
        if args.baseline:
            runs.append((f"baseline {args.baseline}", _checkout(args.baseline, scratch)))
        runs.append(("this checkout", ROOT))
        report["runs"] = {}
        for name, checkout in runs:
            work = scratch / name.replace(" ", "-")
            work.mkdir()
            print(f"== {name}: {checkout}", file=sys.stderr, flush=True)
            report["runs"][name] = run_demo(checkout, work)
            _clean(work)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report["load_average"] = os.getloadavg()[0]
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--baseline", help="a git revision whose demo runs first, side by side")
    p.add_argument(
        "--work",
        type=Path,
        default=None,
        help="where the scratch folders go (default: beside the machine's image cache)",
    )
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    if args.work is None:
        from backends.oci import cache_dir

        args.work = cache_dir()
    args.work.mkdir(parents=True, exist_ok=True)
    return emit(run(args), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
