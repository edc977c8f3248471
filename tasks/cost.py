"""The run's cost: its estimate and the budget's answer before anything is provisioned, the stop
when its spend passes the budget while training, and what it paid.

``estimate-cost`` reads the data root's past runs and this month's spend from the run records
(``registry/cost_history.py``), prices the pool (``core/pricing.py``) and asks ``core/budget.py``;
a run over budget is refused there, before any node is rented. While training, a timer set to
the moment the pool's hourly price would take the run past what it may spend writes the
trainer's stop request (a file of the scripts share: ``backends/taskspec.stop_request``); the
trainer stops at its next checkpoint and the run ends as stopped by budget, resumable.

What was paid: the flow reads the pool right before releasing it (the nodes leave with the
release) and once more after; ``backends/cost.py`` does the arithmetic. A cost that cannot be
measured is logged and left out of the summary: it never fails a run that trained.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from backends.blob import container_client
from backends.cluster import Cluster
from backends.cost import cost_report, spot_comparison
from backends.taskspec import stop_request
from core.budget import CostPlan, plan_cost, seconds_until_cap
from core.config import PipelineConfig
from core.cost_estimate import DataCounts, Estimate, Work, history_record, provisional_record
from core.pricing import PriceError, node_prices
from core.run import Run
from core.text import markdown_text
from registry.cost_history import read_history, read_month_spend
from tasks.fit_to_data import DataFacts
from tasks.steps import Done, step
from tasks.validate import drop_tracebacks


class OverBudgetError(RuntimeError):
    """The run's estimate is over its budget (or cannot be checked against it): refused before
    anything is provisioned; the message gives the figures."""


drop_tracebacks(OverBudgetError)


def data_counts(facts: DataFacts | None) -> DataCounts:
    """The gate's counts as the estimate reads them (None: the gate read none)."""
    images = facts.images if facts is not None else {}
    return DataCounts(
        sum(images.values()) or None,
        images.get("train"),
        images.get("test"),
        images.get("val"),
        facts.train_classes if facts is not None else (),
    )


@step("estimate-cost")
def estimate_cost(config: PipelineConfig, run: Run, counts: DataCounts) -> Done[CostPlan]:
    """The estimate of this run, from the data root's past runs, and the budget's answer."""
    logger = get_run_logger()
    now = datetime.now(UTC)
    outputs = container_client(config.output, config.retries.storage_retries, create=True)
    base, root = config.output.prefix, config.data.root
    history = read_history(outputs, base, root, exclude=run.id)
    month_spent = read_month_spend(outputs, base, root, now, exclude=run.id)
    budgeted = config.budget.max_run_cost is not None or config.budget.monthly_cap is not None
    try:
        prices = node_prices(config)
    except PriceError as exc:
        if budgeted:
            raise OverBudgetError(f"the budget cannot be checked: {exc}") from None
        logger.warning("the estimate has no price: %s", exc)
        prices = None
    plan = plan_cost(config, history, counts, prices, month_spent, now)
    logger.info(plan.estimate.line())
    create_markdown_artifact(
        "\n".join(["# Cost estimate", "", *estimate_markdown(plan)]),
        key="cost-estimate",
        description=f"estimate of {run.id}, before anything is provisioned",
    )
    if not plan.verdict.allowed:
        raise OverBudgetError(f"refused before provisioning: {plan.verdict.reason}")
    logger.info("budget: %s", plan.verdict.reason)
    return Done(
        True,
        plan,
        {
            "node_hours": round(plan.estimate.total_node_minutes / 60, 3),
            "cost": plan.estimate.cost,
            "history_runs": plan.estimate.history_runs,
            "month_spent": round(plan.month_spent, 4),
            "budget": plan.verdict.reason,
        },
    )


class BudgetWatch:
    """While training: once the pool's price per hour has taken the run to what it may spend,
    ask the trainer to stop at its next checkpoint (once). A request that cannot be written is
    tried again, then logged and kept for the run's summary and record: the run goes on."""

    TRIES = 4  # each after twice the wait of the one before
    BACKOFF_SECONDS = 2.0

    def __init__(
        self,
        plan: CostPlan,
        share: Any,
        task_id: str,
        spent_so_far: float,
        logger: logging.Logger | logging.LoggerAdapter[Any] | None = None,
    ) -> None:
        self.plan, self.share, self.task_id = plan, share, task_id
        # The timer's thread has no run context: the flow's logger is taken along.
        self.logger = logger or logging.getLogger(__name__)
        self.fired = False
        self.problem: str | None = None
        self._timer: threading.Timer | None = None
        wait = seconds_until_cap(plan.verdict.allowance, plan.watch_rate_per_hour, spent_so_far)
        self.seconds = wait
        if wait is not None:
            self._timer = threading.Timer(wait, self._fire)
            self._timer.daemon = True

    def start(self) -> BudgetWatch:
        if self._timer is not None:
            self._timer.start()
        return self

    def _fire(self) -> None:
        text = f"budget: the run reached {self.plan.verdict.allowance:.2f}, what it may spend\n"
        for attempt in range(self.TRIES):
            if attempt:
                time.sleep(self.BACKOFF_SECONDS * 2 ** (attempt - 1))
            try:
                self.share.put_text(stop_request(self.task_id), text)
            except Exception as exc:  # the run goes on; the overrun shows in its cost
                self.problem = f"{type(exc).__name__}: {exc}"
                continue
            self.fired, self.problem = True, None
            return
        self.problem = (
            f"the budget's stop request could not be written ({self.TRIES} tries; last: "
            f"{self.problem}): training went on past what the run may spend"
        )
        self.logger.warning("%s", self.problem)

    def note(self, cost: dict[str, Any]) -> dict[str, Any]:
        """The run's cost section, with the stop request that could not be written, if any."""
        return {**cost, "budget_stop_failed": self.problem} if self.problem else cost

    def stop(self) -> None:
        """Training ended: no request any more, and none left for a later attempt to find."""
        if self._timer is not None:
            self._timer.cancel()
        if self.fired:
            try:
                self.share.delete(stop_request(self.task_id))
            except Exception as exc:  # a leftover request names this run's task only
                get_run_logger().warning("stop request not removed: %s", exc)


def provisional_cost(plan: CostPlan) -> dict[str, Any] | None:
    """What the run's record keeps from the start of its spend until it is measured: its
    estimate's bound, so the monthly cap counts a run that crashes (None: not priced)."""
    bound = plan.bound
    return None if bound is None else provisional_record(plan.estimate, round(bound, 4))


def work_of(config: PipelineConfig, epochs: list[dict[str, Any]], test: int | None) -> Work | None:
    """What training did, from the epoch records its trainer printed this run: a resumed run
    trained fewer epochs than it reached (``resumed_from``, the checkpoint's epochs)."""
    trained = [
        e
        for e in epochs
        if isinstance(e.get("images"), int | float) and isinstance(e.get("seconds"), int | float)
    ]
    if not trained:
        return None
    seconds = sum(float(e["seconds"]) for e in trained)
    numbered = [int(e["epoch"]) for e in trained if isinstance(e.get("epoch"), int)]
    resumed = trained[0].get("resumed_from")
    reached = (
        max(numbered)  # the trainer numbers epochs from the run's start, resumed ones included
        if numbered
        else (resumed if isinstance(resumed, int) else 0) + len(trained)
    )
    return Work(
        config.training.model,
        config.pool.processes_per_node,
        config.training.batch_size,
        len(trained),
        round(trained[-1]["images"]),  # summed over the ranks as a float
        sum(e["images"] for e in trained) / seconds if seconds > 0 else None,
        test,
        config.training.epoch_cap(),
        reached,
    )


@dataclass
class PoolMeter:
    config: PipelineConfig
    cluster: Cluster
    run_id: str
    since: datetime | None = None  # when the run began to provision, by the cluster's clock
    allocations: list[datetime] | None = None
    rents: bool = True
    problem: str | None = None
    plan: CostPlan | None = None  # the run's estimate: its prices price what was paid
    started: float = field(default_factory=time.monotonic)

    def start(self, plan: CostPlan | None = None) -> None:
        """Before provisioning: from here on the run holds the pool. The moment is read from
        the cluster's clock, as every timestamp it is compared with is."""
        self.plan, self.started = plan, time.monotonic()
        try:
            self.since = self.cluster.clock()
        except Exception as exc:  # a cost report is never worth failing or masking a run
            self.problem = f"the cluster's clock could not be read ({type(exc).__name__}: {exc})"

    def spent_so_far(self) -> float:
        """What the pool has cost since the run began to provision, at its price per hour."""
        rate = self.plan.rate_per_hour if self.plan else 0.0
        return rate * (time.monotonic() - self.started) / 3600

    def before_release(self) -> None:
        try:
            self.allocations = self.cluster.node_allocations()
            self.rents = self.allocations is not None
        except Exception as exc:  # a cost report is never worth failing or masking a run
            self.problem = f"the pool's nodes could not be read ({type(exc).__name__}: {exc})"

    def _node_price(self) -> float:
        pool = self.config.pool
        if self.plan is None or self.plan.rate_per_hour <= 0:
            return pool.hourly_price
        return self.plan.rate_per_hour / self.plan.estimate.nodes.total

    def _kind_prices(self) -> tuple[float, float]:
        """A dedicated and a Spot node's price per hour: the pool's overrides where set, else
        the price table's (0: not known)."""
        pool = self.config.pool
        prices = self.plan.estimate.prices if self.plan else None
        dedicated = pool.hourly_price or (prices.dedicated if prices else 0.0)
        spot = pool.spot_hourly_price or (prices.spot if prices and prices.spot else 0.0)
        return dedicated, spot

    def report(self) -> dict[str, Any]:
        """The cost section's data; for a pool that rents nothing, that it does not."""
        pool = self.config.pool
        estimate = {"estimate": self.plan.estimate.as_record()} if self.plan else {}
        if not self.rents:
            return {"vm_size": pool.vm_size, "rented": False, **estimate}
        try:
            if self.allocations is None or self.since is None:
                raise RuntimeError(self.problem or "the pool was not read before its release")
            usage = self.cluster.usage(self.run_id, self.since, self.allocations)
            report = {
                "rented": True,
                **cost_report(usage, self._node_price(), pool.vm_size),
                **estimate,
            }
            spot = self.cluster.spot_record()
            if spot is not None:
                report["spot"] = spot_comparison(usage, spot, *self._kind_prices())
            return report
        except Exception as exc:
            get_run_logger().warning("cost not measured: %s", exc)
            return {"vm_size": pool.vm_size, "rented": True, "error": str(exc), **estimate}


def run_cost_record(
    cost: dict[str, Any], plan: CostPlan | None, images: int | None, work: Work | None
) -> dict[str, Any] | None:
    """What the run's record keeps of its cost, for the estimates and the budget of later runs
    (None: nothing was measured)."""
    if not cost.get("rented") or "error" in cost or not cost.get("nodes"):
        return None
    paid = cost["estimated_cost"] if cost.get("hourly_price") else None
    spot = cost.get("spot")
    if isinstance(spot, dict) and isinstance(spot.get("paid"), int | float):
        paid = spot["paid"]  # Spot and dedicated node-minutes each at their own price
    record = history_record(
        cost["vm_size"],
        cost["nodes"],
        cost["node_minutes"],
        paid,
        images,
        work,
        plan.estimate if plan else None,
        plan.bound if plan else None,
    )
    if cost.get("budget_stop_failed"):
        record["budget_stop_failed"] = cost["budget_stop_failed"]
    return record


def _money(value: float | None, estimate: Estimate) -> str:
    if value is None:
        return "not priced"
    currency = estimate.prices.currency if estimate.prices else ""
    return f"{value:.2f}{f' {currency}' if currency else ''}"


def estimate_markdown(plan: CostPlan) -> list[str]:
    """The estimate's table: each phase's node-minutes and how it was predicted."""
    e = plan.estimate
    minutes = e.node_minutes
    lines = [
        f"{markdown_text(e.line())}.",
        "",
        "| phase | node-minutes | from |",
        "|---|---:|---|",
        *(
            f"| {name} | {minutes[name]:.2f} | {markdown_text(p.basis)} |"
            for name, p in e.phases.items()
        ),
        "",
        f"Prices: {markdown_text(e.prices.source) if e.prices else 'none known'}. "
        f"All dedicated: {_money(e.cost_with(type(e.nodes)(e.nodes.total, 0)), e)}; "
        f"all Spot: {_money(e.cost_with(type(e.nodes)(0, e.nodes.total)), e)}.",
        "",
        f"Budget: {markdown_text(plan.verdict.reason)}.",
        "",
    ]
    return [*lines, *(f"Note: {markdown_text(n)}." for n in e.notes), *([""] if e.notes else [])]


def _estimated(cost: dict[str, Any]) -> list[str]:
    estimate = cost.get("estimate")
    if not isinstance(estimate, dict):
        return []
    money = estimate.get("cost")
    unit = f" {estimate['currency']}" if estimate.get("currency") else ""
    priced = f", about {money:.2f}{unit}" if isinstance(money, int | float) else ""
    error = ""
    measured = cost.get("total_node_minutes")
    if isinstance(measured, int | float) and measured > 0:
        off = (estimate["total_node_minutes"] - measured) / measured
        error = f" ({off:+.0%} against what was measured)"
    return [
        f"Estimated before the run: {estimate['total_node_minutes']:.2f} node-minutes{priced}"
        f"{error}, from {estimate['history_runs']} past run(s) of this data root.",
        "",
    ]


def cost_markdown(cost: dict[str, Any] | None) -> list[str]:
    """The summary's cost section: what was paid, beside what was estimated before the run."""
    if not cost:
        return []
    lines = ["## Cost", ""]
    if cost.get("budget_stop_failed"):
        lines += [f"Over budget: {markdown_text(str(cost['budget_stop_failed']))}.", ""]
    if not cost.get("rented"):
        return [*lines, "The pool rents no nodes: 0 node-minutes billed.", "", *_estimated(cost)]
    if "error" in cost:
        return [*lines, f"Not measured: {cost['error']}.", "", *_estimated(cost)]
    price = cost["hourly_price"]
    lines += [
        f"{cost['nodes']} node(s) of {markdown_text(cost['vm_size'])}, "
        f"{cost['total_node_minutes']:.2f} node-minutes in all"
        + (
            f": about {cost['estimated_cost']:.2f} at {price:g} per node-hour."
            if price
            else " (not priced: the local target, or set pool.hourly_price)."
        ),
        "",
        *_estimated(cost),
        "| phase | node-minutes |",
        "|---|---:|",
        *(f"| {phase} | {m:.2f} |" for phase, m in cost["node_minutes"].items()),
        "",
        "From the pool's own timestamps: nodes from allocation to release, each phase from its "
        "task's creation to its end.",
        "",
        *spot_markdown(cost.get("spot")),
    ]
    return lines


def stopped_markdown(run_id: str, why: str, cost: dict[str, Any]) -> None:
    """The summary of a run whose training was stopped at a checkpoint: why, and its cost."""
    create_markdown_artifact(
        "\n".join(
            [
                f"# Run {markdown_text(run_id)}: stopped",
                "",
                f"{markdown_text(why)}.",
                "",
                *cost_markdown(cost),
            ]
        ),
        key="retrain-summary",
        description=f"retrain {run_id}: stopped",
    )


def spot_markdown(spot: dict[str, Any] | None) -> list[str]:
    """The cost section's lines on Spot nodes: minutes by kind, preemptions, the comparison."""
    if not spot:
        return []
    lines = [
        f"On Spot: {spot['spot_node_minutes']:.2f} node-minutes, on dedicated nodes "
        f"{spot['dedicated_node_minutes']:.2f}; {spot['preemptions']} preemption(s)"
        + (f"; moved to dedicated nodes: {spot['fallback']}." if spot["fallback"] else "."),
    ]
    if "paid" in spot:
        lines.append(
            f"Paid about {spot['paid']:.2f} (Spot at {spot['spot_hourly_price']:g} per "
            f"node-hour); the same node-minutes on dedicated nodes: {spot['all_dedicated']:.2f} "
            f"(saved {spot['saved']:.2f})."
        )
    else:
        lines.append("Set pool.hourly_price and pool.spot_hourly_price to compare their cost.")
    return [*lines, ""]
