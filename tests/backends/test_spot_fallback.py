"""When a run gives up on Spot nodes (backends/spot_fallback.py), on the service's clock moved by
the test, and what its cost section makes of the node kinds it used (backends/cost.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from backends.cost import PoolUsage, Span, spot_comparison
from backends.spot_fallback import SpotWatch
from core.config import ConfigError, PipelineConfig, load_config
from tests.conftest import ROOT

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)


@dataclass
class Node:
    id: str
    state: str
    is_dedicated: bool = False
    state_transition_time: datetime = T0


def config(*overrides: str) -> PipelineConfig:
    return load_config(
        ROOT / "configs" / "local.yaml",
        ["pool.dedicated_nodes=0", "pool.low_priority_nodes=2", *overrides],
    )


def test_after_n_preemptions_each_counted_once() -> None:
    watch = SpotWatch(config("pool.spot_fallback.after_preemptions=2").pool, T0)
    up = [Node("a", "running"), Node("b", "running")]
    assert watch.observe(up, True, T0) is None
    first = [Node("a", "preempted", state_transition_time=T0), Node("b", "idle")]
    for minute in (1, 2, 3):  # the same preemption, seen at every poll
        assert watch.observe(first, False, T0 + timedelta(minutes=minute)) is None
    assert len(watch.record.preemptions) == 1
    back = [Node("a", "running"), Node("b", "running")]
    assert watch.observe(back, True, T0 + timedelta(minutes=4)) is None
    later = T0 + timedelta(minutes=30)
    second = [Node("a", "running"), Node("b", "preempted", state_transition_time=later)]
    assert watch.observe(second, False, later) == "2 preemptions of Spot nodes (limit 2)"
    watch.moved(later, 2, "2 preemptions of Spot nodes (limit 2)")
    assert not watch.on_spot and watch.observe(second, False, later) is None
    kinds = [(k.dedicated, k.spot) for k in watch.record.kinds]
    assert kinds == [(0, 2), (2, 0)]


def test_after_m_minutes_without_spot_capacity() -> None:
    watch = SpotWatch(config("pool.spot_fallback.after_minutes_without_capacity=10").pool, T0)
    gone = [Node("a", "preempted"), Node("b", "idle")]
    assert watch.observe(gone, False, T0) is None
    assert watch.observe(gone, False, T0 + timedelta(minutes=9)) is None
    # Capacity back for a moment: the wait starts again.
    assert (
        watch.observe(
            [Node("a", "starting"), Node("b", "idle")], False, T0 + timedelta(minutes=9.5)
        )
        is None
    )
    assert watch.observe(gone, False, T0 + timedelta(minutes=10)) is None
    why = watch.observe(gone, False, T0 + timedelta(minutes=20))
    assert why == "no Spot capacity for 10.0 minutes (1 of 2 Spot nodes; limit 10)"


def test_without_a_fallback_preemptions_are_still_counted() -> None:
    watch = SpotWatch(config().pool, T0)
    for minute in range(0, 600, 10):
        assert (
            watch.observe(
                [Node("a", "preempted"), Node("b", "idle")], False, T0 + timedelta(minutes=minute)
            )
            is None
        )
    assert len(watch.record.preemptions) == 1 and watch.record.fallback is None


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (
            [
                "pool.low_priority_nodes=0",
                "pool.dedicated_nodes=1",
                "pool.spot_fallback.after_preemptions=1",
            ],
            "no Spot nodes",
        ),
        (["pool.spot_fallback.after_preemptions=0"], "after_preemptions"),
        (
            ["pool.spot_fallback.after_minutes_without_capacity=-1"],
            "after_minutes_without_capacity",
        ),
        (
            [
                "pool.spot_fallback.after_preemptions=1",
                "pool.autoscale_formula=$TargetLowPriorityNodes=1",
            ],
            "autoscale_formula",
        ),
        (
            ["pool.scheduled_events_url=http://169.254.169.254/metadata/scheduledevents"],
            "api-version",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_by_name(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        config(*overrides)


def test_the_cost_of_spot_against_dedicated() -> None:
    """Two Spot nodes for an hour, then two dedicated ones for half an hour."""
    fallback = T0 + timedelta(hours=1)
    watch = SpotWatch(config("pool.spot_fallback.after_preemptions=1").pool, T0)
    watch.record.preemptions.append(("a", fallback))
    watch.moved(fallback, 2, "1 preemptions of Spot nodes (limit 1)")
    end = fallback + timedelta(minutes=30)
    usage = PoolUsage(
        [Span(T0, fallback), Span(T0, fallback), Span(fallback, end), Span(fallback, end)], {}
    )
    report = spot_comparison(usage, watch.record, dedicated_price=3.0, spot_price=0.5)
    assert report["spot_node_minutes"] == 120 and report["dedicated_node_minutes"] == 60
    assert report["preemptions"] == 1 and report["fallback"].startswith("1 preemptions")
    assert report["paid"] == pytest.approx(2 * 0.5 + 1 * 3.0)  # node-hours x price
    assert report["all_dedicated"] == pytest.approx(3 * 3.0)
    assert report["saved"] == pytest.approx(9.0 - 4.0)
    assert "paid" not in spot_comparison(usage, watch.record, 3.0, 0.0)


def test_a_requeue_no_listing_caught_is_a_preemption_counted_once() -> None:
    watch = SpotWatch(config("pool.spot_fallback.after_preemptions=2").pool, T0)
    watch.observe([Node("a", "preempted"), Node("b", "idle")], False, T0)
    watch.requeued(T0 + timedelta(minutes=1))  # the same preemption: not counted again
    assert len(watch.record.preemptions) == 1
    watch.requeued(T0 + timedelta(minutes=9))  # the node was back before any listing saw it
    assert [node for node, _ in watch.record.preemptions] == ["a", "a node of the task"]
