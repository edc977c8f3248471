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
