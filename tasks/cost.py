"""The run's cost report: node-minutes by phase times the VM size's hourly price.

The flow reads the pool right before releasing it (the nodes leave with the release) and once
more after; ``backends/cost.py`` does the arithmetic. A cost that cannot be measured is logged
and left out of the summary: it never fails a run that trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger

from backends.cost import cost_report
from backends.taskspec import Cluster
from flows.config import PipelineConfig


@dataclass
class PoolMeter:
    config: PipelineConfig
    cluster: Cluster
    run_id: str
    since: datetime = field(default_factory=lambda: datetime.now(UTC))
    allocations: list[datetime] | None = None
    problem: str | None = None

    def _batch(self) -> Any:
        """The Batch client of an Azure pool; None for the local pool, which rents nothing."""
        return getattr(self.cluster, "client", None) if self.config.target == "azure" else None

    def before_release(self) -> None:
        client = self._batch()
        if client is None:
            return
        from backends.azure.usage import node_allocations

        try:
            self.allocations = node_allocations(client, self.config.pool.id)
        except Exception as exc:  # a cost report is never worth failing or masking a run
            self.problem = f"the pool's nodes could not be read ({type(exc).__name__}: {exc})"

    def report(self) -> dict[str, Any]:
        """The cost section's data; on the local target, that nothing is rented."""
        pool = self.config.pool
        client = self._batch()
        if client is None:
            return {"vm_size": pool.vm_size, "rented": False}
        from backends.azure.usage import pool_usage, released_at, run_tasks

        try:
            if self.allocations is None:
                raise RuntimeError(self.problem or "the pool was not read before its release")
            until = released_at(client, pool.id)
            tasks = run_tasks(client, pool.id, self.run_id, until)
            usage = pool_usage(self.allocations, tasks, self.since, until)
            return {"rented": True, **cost_report(usage, pool.hourly_price, pool.vm_size)}
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
    ]
    return lines
