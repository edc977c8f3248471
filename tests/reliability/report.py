"""Figures the reliability tests record, written as docs/reliability.md by ``make reliability``.

Each test adds rows (what was tried, what happened, with figures; the test that checked it is
added from pytest's PYTEST_CURRENT_TEST); at the end of the session the conftest writes them,
grouped by section, to ``$RETRAIN_RELIABILITY_REPORT`` (``make reliability`` points it at
docs/reliability.md; otherwise .work/reliability.md).
"""

from __future__ import annotations

import json
import os
import platform
import threading
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

_rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
_lock = threading.Lock()

SECTIONS = {
    "storage": "Storage faults (fault-injecting proxy in front of Azurite)",
    "training": "Training faults (a Horovod rank killed mid-training, a node that cannot prepare)",
    "orchestrator": "Orchestrator faults",
    "inputs": "Bad input corpus",
    "secrets": "Secrets",
    "adversarial": "Adversarial inputs (hostile values and misuse on documented paths)",
    "cost": "What a run's pool paid for (node-minutes by phase, Azure flow on the fakes)",
}


def _current_test() -> str:
    """The running test as ``file::name[params]`` (pytest sets it for each test's phases)."""
    node = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    path, _, name = node.partition("::")
    return f"{path.rsplit('/', 1)[-1]}::{name}" if name else path


def record(section: str, case: str, result: str, **figures: Any) -> None:
    with _lock:
        _rows[section].append({"case": case, "result": result, "test": _current_test(), **figures})


def has_rows() -> bool:
    return any(_rows.values())


def dump(path: Path) -> None:
    """Save this process's rows (a test worker's) for the process that writes the report."""
    with _lock:
        path.write_text(json.dumps(_rows, default=str))


def load(path: Path) -> None:
    """Add the rows another process saved with :func:`dump`."""
    saved = json.loads(path.read_text())
    with _lock:
        for section, rows in saved.items():
            _rows[section].extend(rows)


def write(path: Path, tests_passed: bool) -> None:
    lines = [
        "# Reliability",
        "",
        "Written by the reliability suite (`make reliability`; `make test` runs the same tests",
        "with fewer trials and writes .work/reliability.md). Every row is a check that ran and",
        "passed unless its result says otherwise.",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.machine()}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}",
        f"- suite outcome: {'all passed' if tests_passed else 'FAILURES (see the test log)'}",
        "",
    ]
    for section, title in SECTIONS.items():
        rows = _rows.get(section)
        if not rows:
            continue
        first = ["case", "result", "test"]
        keys = [*first, *sorted({k for r in rows for k in r} - set(first))]
        lines += [f"## {title}", "", "| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
        for row in rows:
            cells = [str(row.get(k, "")).replace("|", "\\|").replace("\n", " ") for k in keys]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
