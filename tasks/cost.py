"""The run's cost report: node-minutes by phase times the VM size's hourly price.

The flow reads the pool right before releasing it (the nodes leave with the release) and once
more after; ``backends/cost.py`` does the arithmetic. A cost that cannot be measured is logged
and left out of the summary: it never fails a run that trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prefect import get_run_logger

from backends.cluster import Cluster
from backends.cost import cost_report, spot_comparison
from core.config import PipelineConfig


@dataclass
class PoolMeter:
    config: PipelineConfig
    cluster: Cluster
    run_id: str
    since: datetime | None = None  # when the run began to provision, by the cluster's clock
    allocations: list[datetime] | None = None
    rents: bool = True
    problem: str | None = None

    def start(self) -> None:
        """Before provisioning: from here on the run holds the pool. The moment is read from
        the cluster's clock, as every timestamp it is compared with is."""
        try:
            self.since = self.cluster.clock()
        except Exception as exc:  # a cost report is never worth failing or masking a run
            self.problem = f"the cluster's clock could not be read ({type(exc).__name__}: {exc})"

    def before_release(self) -> None:
        try:
            self.allocations = self.cluster.node_allocations()
            self.rents = self.allocations is not None
        except Exception as exc:  # a cost report is never worth failing or masking a run
            self.problem = f"the pool's nodes could not be read ({type(exc).__name__}: {exc})"

    def report(self) -> dict[str, Any]:
        """The cost section's data; for a pool that rents nothing (local), that it does not."""
        pool = self.config.pool
        if not self.rents:
            return {"vm_size": pool.vm_size, "rented": False}
        try:
            if self.allocations is None or self.since is None:
                raise RuntimeError(self.problem or "the pool was not read before its release")
            usage = self.cluster.usage(self.run_id, self.since, self.allocations)
            report = {"rented": True, **cost_report(usage, pool.hourly_price, pool.vm_size)}
            spot = self.cluster.spot_record()
            if spot is not None:
                prices = (pool.hourly_price, pool.spot_hourly_price)
                report["spot"] = spot_comparison(usage, spot, *prices)
            return report
        except Exception as exc:
            get_run_logger().warning("cost not measured: %s", exc)
            return {"vm_size": pool.vm_size, "rented": True, "error": str(exc)}


def cost_markdown(cost: dict[str, Any] | None) -> list[str]:
    """The summary's cost section."""
    if not cost:
        return []
    lines = ["## Cost", ""]
    if not cost.get("rented"):
        return [*lines, "The local target rents no nodes: 0 node-minutes billed.", ""]
    if "error" in cost:
        return [*lines, f"Not measured: {cost['error']}.", ""]
    price = cost["hourly_price"]
    lines += [
        f"{cost['nodes']} node(s) of {cost['vm_size']}, {cost['total_node_minutes']:.2f} "
        "node-minutes in all"
        + (
            f": about {cost['estimated_cost']:.2f} at {price:g} per node-hour."
            if price
            else " (set pool.hourly_price for an estimated cost)."
        ),
        "",
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
