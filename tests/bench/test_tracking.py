"""bench/tracking.py's figures: the order of a pair cancelled out, and its section of the page."""

from __future__ import annotations

from typing import Any

from bench.report import tracking
from bench.tracking import summary


def _pair(first: str, tracked: float, untracked: float) -> dict[str, Any]:
    return {
        "first": first,
        "tracked": {"wall_seconds": tracked, "cpu_seconds": 4.0},
        "untracked": {"wall_seconds": untracked, "cpu_seconds": 3.0},
    }


def test_running_second_is_not_counted_as_tracking() -> None:
    """Tracking adds 1 s and whichever run is second takes 3 s more: the estimate is 1 s."""
    runs = [
        _pair("tracked", 20.0 + 1, 20.0 + 3),
        _pair("untracked", 20.0 + 1 + 3, 20.0),
        _pair("tracked", 22.0 + 1, 22.0 + 3),
        _pair("untracked", 22.0 + 1 + 3, 22.0),
    ]
    found = summary(runs)
    assert found["wall_seconds"]["difference"] == 1.0
    assert found["wall_seconds"]["order_effect"] == 3.0
    assert found["cpu_seconds"]["difference"] == 1.0
    assert found["cpu_seconds"]["order_effect"] == 0.0
    page = "\n".join(
        tracking(
            {
                "method": "m",
                **found,
                "import_mlflow": {"cpu_seconds": 0.9, "wall_seconds": 1.5},
            }
        )
    )
    assert page.startswith("## MLflow tracking's cost per run (`bench/tracking.py`)")
    assert "| wall | 22.50 s | +1.00 s (+4.4%) | ±3.00 s |" in page
    assert "-2.00 (tracked), +4.00 (untracked)" in page
    assert "| `import mlflow` alone, a fresh interpreter | 0.90 s of CPU (1.50 s wall) |" in page
