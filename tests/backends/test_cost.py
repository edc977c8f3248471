"""Node-minutes by phase from pool and task timestamps (backends/cost.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from backends.cost import PHASES, PoolUsage, Span, cost_report, node_minutes

T0 = datetime(2026, 11, 23, 2, 0, tzinfo=UTC)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def test_two_nodes_through_every_phase() -> None:
    # Node 0 from minute 0, node 1 from minute 2; both released at minute 40.
    usage = PoolUsage(
        nodes=[Span(at(0), at(40)), Span(at(2), at(40))],
        tasks={
            "staging": [Span(at(5), at(10))],
            "training": [Span(at(11), at(31))],
            "scoring": [Span(at(33), at(35))],
        },
    )
    minutes = node_minutes(usage)
    assert list(minutes) == list(PHASES)
    assert minutes["allocating"] == pytest.approx(5 + 3)
    assert minutes["staging"] == pytest.approx(2 * 5)
    assert minutes["training"] == pytest.approx(2 * 20)
    assert minutes["scoring"] == pytest.approx(2 * 2)
    assert minutes["idle between steps"] == pytest.approx(2 * (1 + 2))
    assert minutes["idle before release"] == pytest.approx(2 * 5)
    report = cost_report(usage, 3.6, "Standard_NC24ads_A100_v4")
    assert report["total_node_minutes"] == pytest.approx(78)
    assert report["idle_node_minutes"] == pytest.approx(16)
    assert report["estimated_cost"] == pytest.approx(78 / 60 * 3.6)


def test_no_nodes_cost_nothing_and_a_pool_without_tasks_is_allocating() -> None:
    assert cost_report(PoolUsage([], {}), 3.6, "x")["total_node_minutes"] == 0
    minutes = node_minutes(PoolUsage([Span(at(0), at(7))], {}))
    assert minutes["allocating"] == pytest.approx(7)
    assert sum(minutes.values()) == pytest.approx(7)
