"""A data root's spending as its run records tell it: the history estimates read, the month's
spend the cap counts."""

from __future__ import annotations

import json
from typing import Any

from core.cost_estimate import history_record, record_spend
from core.data_versions import DataRoot
from registry.cost_history import history_of, spent
from registry.run_record import RunRecord, parse_run_record

ROOT = DataRoot("training-data", "pets")


def _record(run_id: str, paid: float | None, outcome: str = "promoted", **data: Any) -> RunRecord:
    cost = history_record("Standard_NC24ads_A100_v4", 2, {"training": 10.0}, paid, 100, None, None)
    where = data or {"container": "training-data", "root": "pets", "version": "v1", "chosen": "x"}
    parsed = parse_run_record(
        json.dumps(
            {"run_id": run_id, "outcome": outcome, "started_at": "", "data": where, "cost": cost}
        ).encode()
    )
    assert isinstance(parsed, RunRecord)
    return parsed


def test_the_roots_runs_that_paid_are_its_history_and_its_spend() -> None:
    records = [
        _record("r5", 4.0),
        _record("r4", 2.5, outcome="failed"),  # a failed run paid too
        _record("r3", 1.0, container="training-data", root="other"),  # another root
        _record("r2", None, outcome="stopped by budget"),  # rented, not priced
        _record("r1", 3.0, outcome="up to date").but(cost={"nodes": "?"}),  # no usable cost
    ]
    history = history_of(records, ROOT)
    assert [r.run_id for r in history] == ["r5", "r4", "r2"]
    assert [r.complete for r in history] == [True, False, False]
    assert spent(records, ROOT).by_currency == {"": 6.5}
    assert history_of(records, ROOT, limit=1)[0].run_id == "r5"
    assert spent(records, DataRoot("training-data", "other")).total_in("") == 1.0


def test_a_run_counts_its_provisional_spend_until_it_is_measured_and_by_currency() -> None:
    """A run that crashed after estimate-cost kept only its provisional spend: the month counts
    it. A measured run counts what it paid, not its provisional figure; currencies stay apart."""
    crashed = _record("r3", None, outcome="failed").but(
        cost={"provisional": 7.0, "currency": "USD", "estimate": {"currency": "USD"}}
    )
    measured = _record("r2", 2.0).but(
        cost={
            **history_record("x", 2, {"training": 10.0}, 2.0, 100, None, None, provisional=9.0),
            "currency": "USD",
        }
    )
    unmeasured = _record("r1", None).but(  # rented, its cost not measured: the provisional
        cost={**history_record("x", 2, {"training": 1.0}, None, 1, None, None, 3.0)}
    )
    month = spent([crashed, measured, unmeasured], ROOT)
    assert month.by_currency == {"USD": 9.0, "": 3.0}
    assert month.others("USD") == "3.00 pool.hourly_price's unit (no currency)"
    assert crashed.cost is not None and record_spend(crashed.cost) == (7.0, "USD")
    older = {"node_minutes": {}, "paid": 1.5, "estimate": {"currency": "USD"}}
    assert record_spend(older) == (1.5, "USD")  # a record from before currencies were kept


def test_a_record_keeps_its_cost_and_a_stopped_outcome() -> None:
    record = _record("r1", 4.0, outcome="stopped by budget")
    assert record.outcome == "stopped by budget" and record.cost is not None
    assert record.cost["paid"] == 4.0
