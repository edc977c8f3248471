"""What every step reports: whether it ran or found its work already done, and how long it took.

The report artifact and the benchmarks read these records, so they have one shape everywhere.
"""

from __future__ import annotations

import time
from typing import Any

STEP_KEYS = ("step", "status", "seconds", "details")


def record_only(result: dict[str, Any]) -> dict[str, Any]:
    """The step record out of a task result that also carries a payload (metrics, decision)."""
    return {k: result[k] for k in STEP_KEYS}


def step_record(name: str, started: float, ran: bool, **details: Any) -> dict[str, Any]:
    return {
        "step": name,
        "status": "ran" if ran else "skipped",
        "seconds": round(time.perf_counter() - started, 3),
        "details": details,
    }
