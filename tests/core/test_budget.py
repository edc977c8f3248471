"""The budget's decisions: a run over it refused with the figures, the time it may spend, and
budgets that are none."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from core.budget import MonthSpend, check_budget, plan_cost, seconds_until_cap
from core.config import ConfigError, PipelineConfig, load_config
from core.cost_estimate import DataCounts, NodeMix, estimate_run
from core.pricing import NodePrices
from tests.conftest import ROOT

PRICES = NodePrices(4.0, 0.5, "USD", "test prices")
COUNTS = DataCounts(images=80_000, train=60_000, test=10_000)
NOW = datetime(2026, 12, 7, tzinfo=UTC)


def _config(*overrides: str) -> PipelineConfig:
    return load_config(
        ROOT / "configs" / "azure.example.yaml",
        ["azure.batch_account_url=https://acct.eastus.batch.azure.com", *overrides],
    )


def test_a_run_over_its_cost_or_the_months_cap_is_refused_with_the_figures() -> None:
    config = _config("training.epochs=30")
    estimate = estimate_run(config, [], COUNTS, PRICES)
    cost = estimate.cost
    assert cost is not None and cost > 1
    over = check_budget(
        config.budget.model_copy(update={"max_run_cost": cost / 2}), estimate, 0, "x"
    )
    assert not over.allowed
    minutes = estimate.total_node_minutes
    assert f"the estimate {cost:.2f} USD ({minutes:.1f} node-minutes of Standard_NC24ads" in (
        over.reason
    )
    assert f"over budget.max_run_cost {cost / 2:.2f} USD" in over.reason
    cap = config.budget.model_copy(update={"monthly_cap": 100.0})
    month = check_budget(cap, estimate, 100.0 - cost / 2, "2026-12")
    assert not month.allowed
    assert f"spent {100 - cost / 2:.2f} USD in 2026-12" in month.reason
    assert "over budget.monthly_cap 100.00 USD" in month.reason
    fits = check_budget(
        config.budget.model_copy(update={"max_run_cost": 1000.0, "monthly_cap": 100.0}),
        estimate,
        100.0 - 2 * cost,
        "2026-12",
    )
    assert fits.allowed and fits.allowance == pytest.approx(2 * cost)  # the cap's rest binds


def test_no_budget_or_an_unpriced_pool_lets_every_run_start() -> None:
    config = _config("budget.max_run_cost=0.01")
    priced = estimate_run(config, [], COUNTS, PRICES)
    assert check_budget(_config().budget, priced, 1e9, "x").allowed
    unpriced = estimate_run(config, [], COUNTS, None)
    verdict = check_budget(config.budget, unpriced, 0, "x")
    assert verdict.allowed and verdict.allowance is None and "not priced" in verdict.reason
    # Spot nodes of a size the table has no Spot price for: the budget cannot be checked.
    no_spot = NodePrices(98.32, None, "USD", "Standard_ND96isr_H100_v5 in eastus")
    spot = estimate_run(_config("pool.low_priority_nodes=2"), [], COUNTS, no_spot)
    refused = check_budget(config.budget, spot, 0, "x")
    assert not refused.allowed and "no Spot price is known" in refused.reason


def test_the_plan_prices_the_pool_per_hour_and_knows_how_long_it_may_spend() -> None:
    config = _config("budget.monthly_cap=50", "pool.low_priority_nodes=2")
    plan = plan_cost(config, [], COUNTS, PRICES, month_spent=10.0, now=NOW)
    assert plan.month == "2026-12" and plan.rate_per_hour == pytest.approx(2 * 4.0 + 2 * 0.5)
    assert plan.verdict.allowed and plan.verdict.allowance == pytest.approx(40.0)
    # 40 to spend at 9 an hour, 4 already spent: 4 hours left.
    assert seconds_until_cap(40.0, 9.0, 4.0) == pytest.approx(4 * 3600)
    assert seconds_until_cap(40.0, 9.0, 41.0) == 0  # already past: stop at once
    assert seconds_until_cap(None, 9.0, 0) is None and seconds_until_cap(40.0, 0.0, 0) is None


def test_spot_that_may_fall_back_is_checked_and_watched_at_the_dedicated_price() -> None:
    """A pool of 2 dedicated and 2 Spot nodes that moves to 4 dedicated ones after preemptions
    can reach the all-dedicated cost: that is what the budget checks and the timer runs at."""
    spot = ("pool.low_priority_nodes=2", "pool.spot_fallback.after_preemptions=3")
    estimate = estimate_run(_config(*spot), [], COUNTS, PRICES)
    cost, bound = estimate.cost, estimate.cost_with(NodeMix(4, 0))
    assert cost is not None and bound is not None and bound > cost
    config = _config(*spot, f"budget.max_run_cost={(cost + bound) / 2}")
    plan = plan_cost(config, [], COUNTS, PRICES, month_spent=0.0, now=NOW)
    assert not plan.verdict.allowed
    assert f"up to {bound:.2f} USD should every node move to dedicated ones" in (
        plan.verdict.reason
    )
    assert plan.rate_per_hour == pytest.approx(2 * 4.0 + 2 * 0.5)
    assert plan.watch_rate_per_hour == pytest.approx(4 * 4.0)
    # Without the fallback, Spot's price is the run's: it fits, and the timer runs at it.
    alone = plan_cost(
        _config(spot[0], f"budget.max_run_cost={(cost + bound) / 2}"),
        [],
        COUNTS,
        PRICES,
        month_spent=0.0,
        now=NOW,
    )
    assert alone.verdict.allowed and alone.watch_rate_per_hour == alone.rate_per_hour


def test_a_monthly_cap_over_runs_in_other_currencies_is_refused_by_name() -> None:
    config = _config("budget.monthly_cap=100")
    mixed = MonthSpend({"USD": 10.0, "": 4.0})
    plan = plan_cost(config, [], COUNTS, PRICES, month_spent=mixed, now=NOW)
    assert not plan.verdict.allowed
    assert "budget.monthly_cap cannot be checked" in plan.verdict.reason
    assert "other currencies than this run's USD (4.00 pool.hourly_price's unit" in (
        plan.verdict.reason
    )
    same = plan_cost(config, [], COUNTS, PRICES, MonthSpend({"USD": 10.0}), NOW)
    assert same.verdict.allowed and same.month_spent == 10.0
    assert same.verdict.allowance == pytest.approx(90.0)
    # Without a monthly cap, the month's spend is not read: the run's own limit holds.
    alone = plan_cost(_config("budget.max_run_cost=1000"), [], COUNTS, PRICES, mixed, NOW)
    assert alone.verdict.allowed


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
@pytest.mark.parametrize("field", ["max_run_cost", "monthly_cap"])
def test_a_budget_of_zero_or_less_is_refused_at_load_naming_the_field(
    field: str, value: str
) -> None:
    with pytest.raises(ConfigError, match=rf"budget\.{field}: .*it must be more than 0"):
        _config(f"budget.{field}={value}")
