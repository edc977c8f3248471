"""What a model started from, back to a run from scratch: a model's lineage.

Each run's ``metrics.json`` records what its training started from (``init_from``: the run
whose model it was, for a model of this pipeline; the file and its MD5 otherwise). Following
those records from a run gives the chain of models it descends from, so the champion's lineage
can be followed back to the run that trained from random weights, or to the outside weights
(torchvision's ImageNet weights) it began with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from registry.layout import run_folder
from registry.record_blob import json_object, read_record
from registry.store import MAX_METRICS_BYTES

MAX_DEPTH = 1000  # nightly retrains of one champion for almost three years


@dataclass(frozen=True)
class Ancestor:
    """One model of a lineage: its run, and what that run started from."""

    run_id: str
    started_from: str  # "scratch", "run <id>", a file (with its MD5), or why it is not known
    parent: str | None  # the run whose model it started from


def _metrics(container: Any, base: str, run_id: str) -> dict[str, Any] | str:
    blob = f"{run_folder(base, run_id)}/metrics.json"
    stored = read_record(container, blob, MAX_METRICS_BYTES)
    if stored is None:
        return f"unknown: {blob} does not exist"
    doc = json_object(stored.data, stored.limit)
    return doc if isinstance(doc, dict) else f"unknown: {blob} is unusable ({doc})"


def started_from(metrics: dict[str, Any]) -> tuple[str, str | None]:
    """What one run's metrics say it started from, in words, and the parent run (if any)."""
    if "init_from" not in metrics:
        return "scratch (before runs recorded init_from)", None
    start = metrics["init_from"]
    if start is None:
        return "scratch", None
    if not isinstance(start, dict):
        return f"unknown: init_from is {type(start).__name__}", None
    parent = start.get("run_id")
    if isinstance(parent, str) and parent:
        return f"run {parent}", parent
    return f"{start.get('source')} (MD5 {start.get('md5')})", None


def lineage(container: Any, base: str, run_id: str) -> list[Ancestor]:
    """``run_id`` and every model it descends from, newest first; the last one started from
    scratch, from a file, or cannot be followed further (said why)."""
    chain: list[Ancestor] = []
    seen: set[str] = set()
    current: str | None = run_id
    while current is not None and len(chain) < MAX_DEPTH:
        if current in seen:
            chain.append(Ancestor(current, "unknown: the records form a cycle", None))
            break
        seen.add(current)
        metrics = _metrics(container, base, current)
        if isinstance(metrics, str):
            chain.append(Ancestor(current, metrics, None))
            break
        words, parent = started_from(metrics)
        chain.append(Ancestor(current, words, parent))
        current = parent
    return chain
