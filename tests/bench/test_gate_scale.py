"""The gate-at-scale bench's synthetic container is what the real lister reads.

``bench.gate_scale`` times the gate on a 1.28 M-blob listing served by its own List Blobs
server; these checks pin that its pages, read by the real ``list_pinned`` through a real
``ContainerClient``, give every blob once, in the service's order, with the sizes and MD5s the
server generated. 12,000 blobs: three pages.
"""

from __future__ import annotations

import pytest
from azure.storage.blob import ContainerClient

from bench.gate_scale import CONTAINER, PREFIX, SyntheticContainer, synthetic_container
from staging.blob import list_pinned


@pytest.mark.processes
def test_real_lister_reads_every_synthetic_blob_once_in_order() -> None:
    train, test, classes = 10_000, 1_999, 10
    expected = SyntheticContainer(train, test, classes)
    with synthetic_container(train, test, classes) as conn:
        container = ContainerClient.from_connection_string(conn, CONTAINER)
        listed = list_pinned(container, PREFIX)
        elsewhere = list_pinned(container, "other")
    assert expected.size == 12_000
    assert [b.name for b in listed] == [expected.name(i) for i in range(expected.size)]
    names = [b.name for b in listed]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert [(b.size, b.md5, b.etag) for b in listed] == [
        (expected.bytes_of(i), expected.md5_of(i), expected.etag_of(i))
        for i in range(expected.size)
    ]
    assert listed[0].name == f"{PREFIX}/_SUCCESS"
    assert listed[1].name == f"{PREFIX}/test/n01440764/n01440764_0.JPEG"
    assert sum(1 for b in listed if "/train/" in b.name) == train
    assert sum(1 for b in listed if "/test/" in b.name) == test
    assert elsewhere == []


def test_report_section_shows_each_measured_step_and_what_was_not_run() -> None:
    from bench.report import gate_scale

    timing = {"wall_s": 12.5, "cpu_s": 9.0, "load_average": 3.1, "peak_rss_mib_so_far": 2048}
    text = "\n".join(
        gate_scale(
            {
                "method": "synthetic",
                "listing": {"blobs": 1_331_168, "blobs_per_s": 7_000, **timing},
                "cached_manifest": {"rows": 1_331_167, "reused": 1_331_167, **timing},
                "expectations": [
                    {
                        "rows": 100_000,
                        "classes": 1_000,
                        "run_expectations": timing,
                        "class_counts": {**timing, "wall_s": 40.0},
                    },
                    {"rows": 1_331_167, "skipped_predicted_s": 1_234},
                ],
                "header_reads": {
                    "images": 2_000,
                    "bytes_each": 12_288,
                    "reads_per_s": 150.0,
                    **timing,
                },
                "first_gate_estimate_s": 8_874,
            }
        )
    )
    assert "| listing (`list_dataset`) | 1,331,168 | 12.5 s (7,000 blobs/s) | 9.0 s | 3.1 |" in text
    assert "(1,331,167 from the cache)" in text
    assert "`class_counts` alone: 40.0 s" in text
    assert "not run: 1,234 s predicted" in text
    assert "(150 reads/s)" in text and "| 8,874 s (148 min) |" in text
    assert (
        "| listing and the cached manifest, against the 5-minute goal | 25 s (0.08x the goal) |"
        in text
    )
    assert "at the full 1,331,167 rows, linearly from 100,000 | 166 s |" in text
    # 25 s of listing and manifest plus 166 s of expectations, against 300 s.
    assert "| the nightly gate as a whole | 191 s (0.64x the goal) |" in text


@pytest.mark.processes
def test_the_listings_choices_are_measured_against_their_alternatives() -> None:
    """Every way lists the same blobs from the same server; the report states each one's time."""
    import argparse

    from bench.gate_scale import _listing_ahead
    from bench.report import _listing_ahead as paragraph

    args = argparse.Namespace(ahead_blobs=12_000, page_delay_ms=5, ahead_rounds=2, classes=10)
    measured = _listing_ahead(args)
    assert measured["pages"] == 3 and measured["rounds"] == 2
    ways = ("ahead", "one_after_another", "collector_running")
    assert [measured[way]["blobs"] for way in ways] == [12_001] * 3
    assert all(measured[way]["wall_s"] > 0 for way in ways)
    assert measured["tracked_objects"] > 100_000  # Prefect's modules and more
    text = "\n".join(paragraph(measured))
    assert "12,001 blobs (3 pages) answered 5 ms after each request" in text
    assert "| the collector running while a page is read (" in text
    assert paragraph(None) == []
