"""The run's cost on the orchestrator: the stop request once the budget is spent, what the run's
record keeps for later estimates, and the summary's estimate beside what was paid."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from backends.share import LocalShare
from backends.taskspec import stop_request
from core.budget import plan_cost
from core.config import PipelineConfig, load_config
from core.cost_estimate import DataCounts, PastRun, record_spend
from core.pricing import NodePrices
from tasks.cost import (
    BudgetWatch,
    cost_markdown,
    data_counts,
    provisional_cost,
    run_cost_record,
    work_of,
)
from tasks.fit_to_data import DataFacts
from tests.conftest import ROOT

PRICES = NodePrices(3600.0, None, "USD", "test prices")  # a dollar a second per node


def _config(*overrides: str) -> PipelineConfig:
    return load_config(ROOT / "configs" / "local.yaml", list(overrides))


def _plan(config: PipelineConfig, spent: float = 0.0) -> object:
    counts = DataCounts(1000, 800, 200)
    return plan_cost(config, [], counts, PRICES, spent, datetime.now(UTC))


def test_the_watch_asks_training_to_stop_once_the_budget_is_spent(tmp_path: Path) -> None:
    config = _config("budget.monthly_cap=100000")
    share = LocalShare(tmp_path / "share")
    plan = _plan(config, spent=100000 - 0.2)  # 0.2 left at 1 per second: 0.2 s
    watch = BudgetWatch(plan, share, "train-r1", spent_so_far=0.0).start()  # type: ignore[arg-type]
    request = tmp_path / "share" / stop_request("train-r1")
    deadline = time.monotonic() + 10
    while not request.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watch.fired and "budget" in request.read_text()
    assert watch.seconds == pytest.approx(0.2)
    watch.stop()
    assert not request.exists()  # no request left for a later attempt to find
    unlimited = BudgetWatch(_plan(_config()), share, "train-r2", 0.0).start()  # type: ignore[arg-type]
    assert unlimited.seconds is None
    unlimited.stop()
    assert not unlimited.fired


def test_the_record_keeps_what_was_paid_and_what_training_did() -> None:
    config = _config("training.epochs=3")
    epochs = [
        {"epoch": e, "epochs": 3, "images": 800.0, "seconds": 2.0, "train_loss": 0.1}
        for e in (2, 3)
    ]
    work = work_of(config, epochs, 200)
    assert work is not None
    assert (work.epochs_trained, work.train_images, work.images_per_sec) == (2, 800, 400.0)
    assert work.epoch_cap == 3  # what the share of the cap later estimates price comes from
    assert work.epochs_reached == 3
    assert work_of(config, [], None) is None
    measured = {
        "rented": True,
        "vm_size": "local",
        "nodes": 1,
        "node_minutes": {"allocating": 0.1, "training": 1.0},
        "total_node_minutes": 1.1,
        "hourly_price": 0.0,
        "estimated_cost": 0.0,
    }
    record = run_cost_record(measured, None, 1000, work)
    past = PastRun.from_record("r1", record, complete=True)
    assert past is not None and past.paid is None  # not priced: nothing spent
    assert past.work == work and past.images == 1000
    assert run_cost_record({**measured, "error": "x"}, None, 1000, work) is None
    assert run_cost_record({"rented": False}, None, 1000, work) is None


def test_the_summary_shows_the_estimate_beside_what_was_measured() -> None:
    plan = _plan(_config())
    estimate = plan.estimate.as_record()  # type: ignore[attr-defined]
    measured = estimate["total_node_minutes"] * 1.25
    lines = "\n".join(
        cost_markdown(
            {
                "rented": True,
                "vm_size": "local",
                "nodes": 1,
                "node_minutes": {"training": measured},
                "total_node_minutes": measured,
                "hourly_price": 0.0,
                "estimated_cost": 0.0,
                "estimate": estimate,
            }
        )
    )
    assert f"Estimated before the run: {estimate['total_node_minutes']:.2f} node-minutes" in lines
    assert "(-20% against what was measured)" in lines


def test_the_gates_counts_say_whether_a_slice_of_train_is_held_out() -> None:
    rows = [
        {"split": "train", "label": label, "width": 8, "height": 8, "readable": True}
        for label, n in (("a", 200), ("b", 150), ("c", 85))
        for _ in range(n)
    ]
    rows += [{"split": "test", "label": "a", "width": 8, "height": 8, "readable": True}] * 50
    counts = data_counts(DataFacts.from_rows(rows))
    assert counts == DataCounts(485, 435, 50, None, (200, 150, 85))
    assert counts.trained_per_epoch() == 392  # 20 + 15 + 8 held out
    assert data_counts(None) == DataCounts()


def test_a_resumed_run_reached_the_epochs_of_its_checkpoint_and_those_it_trained() -> None:
    config = _config("training.epochs=20")
    epochs = [
        {"epoch": e, "epochs": 20, "images": 800.0, "seconds": 2.0, "resumed_from": 6}
        for e in (7, 8)
    ]
    work = work_of(config, epochs, None)
    assert work is not None and (work.epochs_trained, work.epochs_reached) == (2, 8)
    assert work.share_of_cap == pytest.approx(8 / 20)
    unnumbered = [{k: v for k, v in e.items() if k != "epoch"} for e in epochs]
    again = work_of(config, unnumbered, None)
    assert again is not None and again.epochs_reached == 8  # resumed_from + epochs trained


def test_a_spot_run_records_its_paid_at_each_kinds_price_and_is_watched_at_dedicated() -> None:
    measured = {
        "rented": True,
        "vm_size": "Standard_NC24ads_A100_v4",
        "nodes": 2,
        "node_minutes": {"training": 120.0},
        "total_node_minutes": 120.0,
        "hourly_price": 2.0,  # the pool's mean price per node at the start: Spot's, mostly
        "estimated_cost": 4.0,
        "spot": {"spot_node_minutes": 60.0, "dedicated_node_minutes": 60.0, "paid": 4.5},
    }
    record = run_cost_record(measured, None, 1000, None)
    assert record is not None and record["paid"] == 4.5  # after the move to dedicated nodes
    prices = NodePrices(4.0, 0.5, "USD", "test prices")
    config = _config(
        "pool.dedicated_nodes=0",
        "pool.low_priority_nodes=2",
        "pool.spot_fallback.after_preemptions=2",
        "budget.max_run_cost=1000",
    )
    plan = plan_cost(config, [], DataCounts(1000, 800, 200), prices, 0.0, datetime.now(UTC))
    watch = BudgetWatch(plan, None, "train-r1", spent_so_far=0.0)
    assert watch.seconds == pytest.approx(1000 / (2 * 4.0) * 3600)  # not at 2 x 0.5 an hour


class _FlakyShare(LocalShare):
    """A share whose first ``failures`` writes fail, as a storage outage would."""

    def __init__(self, root: Path, failures: int) -> None:
        super().__init__(root)
        self.failures, self.tries = failures, 0

    def put_text(self, rel: str, text: str) -> None:
        self.tries += 1
        if self.tries <= self.failures:
            raise OSError("the share is not reachable")
        super().put_text(rel, text)


def test_a_stop_request_that_fails_is_retried_then_logged_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plan = _plan(_config("budget.monthly_cap=100000"), spent=100000 - 1.0)
    flaky = _FlakyShare(tmp_path / "a", failures=BudgetWatch.TRIES - 1)
    watch = BudgetWatch(plan, flaky, "train-r1", 0.0)  # type: ignore[arg-type]
    watch.BACKOFF_SECONDS = 0.0
    watch._fire()
    assert watch.fired and watch.problem is None and flaky.tries == BudgetWatch.TRIES
    assert (tmp_path / "a" / stop_request("train-r1")).exists()
    assert watch.note({"rented": True}) == {"rented": True}
    down = _FlakyShare(tmp_path / "b", failures=BudgetWatch.TRIES)
    lost = BudgetWatch(plan, down, "train-r2", 0.0)  # type: ignore[arg-type]
    lost.BACKOFF_SECONDS = 0.0
    with caplog.at_level("WARNING"):
        lost._fire()
    assert not lost.fired and down.tries == BudgetWatch.TRIES
    assert "stop request could not be written (4 tries; last: OSError" in caplog.text
    measured = {
        "rented": True,
        "vm_size": "local",
        "nodes": 1,
        "node_minutes": {"training": 1.0},
        "total_node_minutes": 1.0,
        "hourly_price": 0.0,
        "estimated_cost": 0.0,
    }
    cost = lost.note(measured)
    assert "the share is not reachable" in "\n".join(cost_markdown(cost))
    record = run_cost_record(cost, None, 10, None)
    assert record is not None and "went on past" in record["budget_stop_failed"]


def test_a_run_is_counted_for_its_bound_until_it_has_measured_what_it_paid() -> None:
    config = _config(
        "pool.dedicated_nodes=0",
        "pool.low_priority_nodes=2",
        "pool.spot_fallback.after_preemptions=2",
    )
    prices = NodePrices(4.0, 0.5, "EUR", "test prices")
    plan = plan_cost(config, [], DataCounts(1000, 800, 200), prices, 0.0, datetime.now(UTC))
    early = provisional_cost(plan)
    assert plan.bound is not None and plan.estimate.cost is not None
    assert plan.bound > plan.estimate.cost  # the all-dedicated cost it can reach
    assert early is not None and record_spend(early) == (round(plan.bound, 4), "EUR")
    assert PastRun.from_record("r1", early, complete=False) is None  # no history: no phases
    measured = {
        "rented": True,
        "vm_size": "x",
        "nodes": 2,
        "node_minutes": {"training": 60.0},
        "total_node_minutes": 60.0,
        "hourly_price": 1.0,
        "estimated_cost": 1.0,
    }
    record = run_cost_record(measured, plan, 1000, None)
    assert record is not None and record_spend(record) == (1.0, "EUR")
    unpriced = replace(plan, estimate=replace(plan.estimate, prices=None))
    assert provisional_cost(unpriced) is None  # nothing counts against the budget
