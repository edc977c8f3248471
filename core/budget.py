"""The budget's decisions: whether a run may start, and how long it may then spend.

Pure functions of the effective config, the estimate and what the data root's runs spent this
month (their run records), so the flow calls them in one place before provisioning, and a run
plan resolved ahead of the flow can hold their answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from core.config import BudgetConfig, PipelineConfig
from core.cost_estimate import DataCounts, Estimate, NodeMix, PastRun, estimate_run
from core.pricing import NodePrices


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str  # with the figures: what was compared with what
    allowance: float | None  # the most the run may spend (None: no limit applies)


def _money(value: float, currency: str) -> str:
    return f"{value:.2f}{f' {currency}' if currency else ''}"


def _unit(currency: str) -> str:
    return currency or "pool.hourly_price's unit (no currency)"


@dataclass(frozen=True)
class MonthSpend:
    """What a data root's runs spent in a month, by currency ("": ``pool.hourly_price``'s unit,
    which says none): runs priced in different currencies are not added up."""

    by_currency: dict[str, float]

    def total_in(self, currency: str) -> float:
        return self.by_currency.get(currency, 0.0)

    def others(self, currency: str) -> str:
        """The spend in other currencies than ``currency``, in words ("": none)."""
        return ", ".join(
            f"{v:.2f} {_unit(c)}"
            for c, v in sorted(self.by_currency.items())
            if c != currency and v > 0
        )


def run_bound(estimate: Estimate, spot_fallback: bool) -> float | None:
    """The most the run is expected to cost: its estimate, or, with Spot nodes that may move to
    dedicated ones, the same time on dedicated nodes only when that is more."""
    cost = estimate.cost
    bound = estimate.cost_with(NodeMix(estimate.nodes.total, 0))
    if cost is not None and spot_fallback and estimate.nodes.spot and bound is not None:
        return max(cost, bound)
    return cost


def check_budget(
    budget: BudgetConfig,
    estimate: Estimate,
    month_spent: float | MonthSpend,
    month: str,
    spot_fallback: bool = False,
) -> Verdict:
    """Whether the run may start: its estimate against ``budget.max_run_cost``, and this
    month's spend of the data root plus the estimate against ``budget.monthly_cap``. With
    ``spot_fallback`` (Spot nodes that may move to dedicated ones), the estimate checked is the
    worst the run can reach: the same time on dedicated nodes only. A month's spend in other
    currencies than the estimate's cannot be added to it: the cap refuses the run, naming them
    (a float ``month_spent`` is in the estimate's currency)."""
    limits = [v for v in (budget.max_run_cost, budget.monthly_cap) if v is not None]
    if not limits:
        return Verdict(True, "no budget set", None)
    cost = estimate.cost
    currency = estimate.prices.currency if estimate.prices else ""
    if cost is None and estimate.prices is None:  # a pool that rents nothing never is over
        return Verdict(True, "the pool is not priced: nothing counts against the budget", None)
    if cost is None:
        return Verdict(
            False,
            f"the budget cannot be checked: no Spot price is known ({estimate.prices.source})"
            if estimate.prices
            else "the budget cannot be checked",
            None,
        )
    if isinstance(month_spent, MonthSpend):
        others = month_spent.others(currency)
        if others and budget.monthly_cap is not None:
            return Verdict(
                False,
                f"budget.monthly_cap cannot be checked: this data root's runs in {month} were "
                f"priced in other currencies than this run's "
                f"{_unit(currency)} ({others}); price every run the "
                "same way (the price table, or pool.hourly_price) or unset budget.monthly_cap",
                None,
            )
        month_spent = month_spent.total_in(currency)
    left = [budget.max_run_cost] if budget.max_run_cost is not None else []
    if budget.monthly_cap is not None:
        left.append(budget.monthly_cap - month_spent)
    allowance = max(min(left), 0.0)
    what = f"the estimate {_money(cost, currency)} ({estimate.node_time} of {estimate.vm_size})"
    bound = run_bound(estimate, spot_fallback)
    if bound is not None and bound > cost:
        cost = bound
        what += (
            f", up to {_money(bound, currency)} should every node move to dedicated ones "
            "(pool.spot_fallback),"
        )
    if budget.max_run_cost is not None and cost > budget.max_run_cost:
        return Verdict(
            False,
            f"{what} is over budget.max_run_cost {_money(budget.max_run_cost, currency)}",
            allowance,
        )
    if budget.monthly_cap is not None and month_spent + cost > budget.monthly_cap:
        return Verdict(
            False,
            f"this data root's runs spent {_money(month_spent, currency)} in {month}; with "
            f"{what} that is {_money(month_spent + cost, currency)}, over budget.monthly_cap "
            f"{_money(budget.monthly_cap, currency)}",
            allowance,
        )
    return Verdict(
        True,
        f"{what} is within the budget: the run may spend {_money(allowance, currency)}",
        allowance,
    )


def seconds_until_cap(allowance: float | None, rate_per_hour: float, spent: float) -> float | None:
    """How long a pool costing ``rate_per_hour`` may go on once ``spent`` is paid before the run
    passes ``allowance`` (0: it has); None when nothing limits it."""
    if allowance is None or rate_per_hour <= 0:
        return None
    return max(allowance - spent, 0.0) / rate_per_hour * 3600


@dataclass(frozen=True)
class CostPlan:
    """The run's estimate and the budget's answer: what the flow decides on before it rents."""

    estimate: Estimate
    verdict: Verdict
    month_spent: float
    month: str
    spot_fallback: bool = False  # Spot nodes the run may move to dedicated ones

    @property
    def watch_rate_per_hour(self) -> float:
        """The rate the budget's timer runs at: the pool's, or, when its Spot nodes may move to
        dedicated ones, the dedicated rate (the timer may stop a run early, never late)."""
        nodes, prices = self.estimate.nodes, self.estimate.prices
        if self.spot_fallback and nodes.spot and prices is not None:
            return max(self.rate_per_hour, prices.for_nodes(nodes.total, 0))
        return self.rate_per_hour

    @property
    def bound(self) -> float | None:
        """The most the run is expected to cost (None: not priced): what the monthly cap counts
        for it until it has measured what it paid."""
        return run_bound(self.estimate, self.spot_fallback)

    @property
    def rate_per_hour(self) -> float:
        """What the pool costs per hour while it holds the run's nodes (0: not priced)."""
        prices = self.estimate.prices
        nodes = self.estimate.nodes
        if prices is None or (nodes.spot and prices.spot is None):
            return 0.0
        return prices.for_nodes(nodes.dedicated, nodes.spot)


def plan_cost(
    config: PipelineConfig,
    history: list[PastRun],
    counts: DataCounts | None,
    prices: NodePrices | None,
    month_spent: float | MonthSpend,
    now: datetime,
    nodes: NodeMix | None = None,
) -> CostPlan:
    """The estimate of a run of the effective ``config`` and whether the budget lets it start."""
    estimate = estimate_run(config, history, counts, prices, nodes)
    month = f"{now:%Y-%m}"
    fallback = config.pool.spot_fallback.enabled and estimate.nodes.spot > 0
    verdict = check_budget(config.budget, estimate, month_spent, month, fallback)
    if isinstance(month_spent, MonthSpend):
        month_spent = month_spent.total_in(estimate.prices.currency if estimate.prices else "")
    return CostPlan(estimate, verdict, month_spent, month, fallback)
