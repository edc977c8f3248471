"""docs/performance.md re-rendered after some benchmarks only (``python -m bench --only``, or a
fresh clone whose results folder is empty) keeps the sections of those it did not run."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report import render

EARLIER = """# Performance

Written by `make bench` on 2026-11-22 23:02 UTC.

Machine: AMD EPYC, 2 cores, 24 GiB.

## Staging: Blob to the data folder (`bench/staging.py`)

| step | rclone |
|---|---|
| 1.2x | 1.0 |

## The training image, cpu variant (`bench/image.py`)

Image size: 1 GB.

## On a GPU

### Something kept in docs/bench-gpu
"""


def test_a_section_with_no_result_is_kept_with_its_date(tmp_path: Path) -> None:
    page = render(tmp_path, EARLIER)

    staging = page[page.index("## Staging") : page.index("## The training image")]
    assert "| 1.2x | 1.0 |" in staging
    assert "kept as the one of 2026-11-22 23:02 UTC wrote it, on AMD EPYC, 2 cores" in staging
    assert "Image size: 1 GB." in page
    # Kept again by a later page: still the date it was measured, said once.
    again = render(tmp_path, page)
    assert again.count("2026-11-22 23:02 UTC") == 2
    assert (
        again.split("Written by")[1].split("\n", 1)[1]
        == page.split("Written by")[1].split("\n", 1)[1]
    )


def test_a_result_replaces_its_section_and_the_rest_stay(tmp_path: Path) -> None:
    (tmp_path / "image.json").write_text(
        json.dumps({"benchmark": "image", "skipped": "buildah is missing"})
    )
    page = render(tmp_path, EARLIER)

    assert "Not measured on this machine: buildah is missing." in page
    assert "Image size: 1 GB." not in page
    assert "| 1.2x | 1.0 |" in page
    assert page.count("## The training image, cpu variant") == 1


def test_sections_not_of_a_benchmark_are_not_carried(tmp_path: Path) -> None:
    """The GPU part is rendered from docs/bench-gpu each time, never copied from the page."""
    page = render(tmp_path, EARLIER)
    assert "Something kept in docs/bench-gpu" not in page


def test_the_cost_estimates_errors_are_scored_against_the_previous_runs_figure(
    tmp_path: Path,
) -> None:
    from bench.cost_estimate import summarize

    def run(measured: float, estimate: float, history: int) -> dict[str, object]:
        return {
            "version": "v1",
            "images": 300,
            "epochs": 1,
            "history_runs": history,
            "estimate_node_minutes": estimate,
            "measured_node_minutes": measured,
        }

    rows = [run(1.0, 2.0, 0), run(2.0, 1.8, 1), run(1.0, 1.1, 2), run(4.0, 4.4, 3)]
    summary = summarize(rows)
    assert summary["runs_scored"] == 3 and summary["first_run_error"] == 1.0
    assert summary["median_abs_error"] == 0.1 and summary["within_25_percent"] == 3
    # The previous run's node-minutes: 1.0 for 2.0 (-50%), 2.0 for 1.0 (+100%), 1.0 for 4.0.
    assert summary["previous_run_median_abs_error"] == 0.75
    assert summary["error_ratio_previous_over_estimate"] == 7.5
    results = tmp_path / "results"
    results.mkdir()
    report = {"method": "m", "summary": summary, "runs": rows}
    (results / "cost_estimate.json").write_text(json.dumps(report))
    page = render(results)
    assert "## The cost estimate against what runs used (`bench/cost_estimate.py`)" in page
    assert "| 4 | v1 (300 images) | 1 | 3 | 4.40 | 4.00 | +10% | -75% |" in page
