"""The cluster the flow runs task specs on: an Azure Batch pool, or the local stand-in.

The flow and its tasks see only this protocol; what differs between the two is said by the
attributes below, never by asking which target the config names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from backends.taskspec import TaskSpec

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

    from backends.cost import PoolUsage
    from backends.progress_deadline import ProgressDeadline
    from backends.spot_fallback import SpotRecord


@dataclass
class TaskResult:
    exit_code: int
    task_dir: Path | None  # local clusters only
    uploaded: list[str]
    seconds: float
    attempts: int = 1
    # Why attempts were ended as hung (backends/progress_deadline.py), in order.
    stalls: list[str] = field(default_factory=list)
    # Spot nodes of the run preempted so far, and why it moved to dedicated nodes, if it did
    # (backends/spot_fallback.py).
    preemptions: int = 0
    spot_fallback: str | None = None


class Cluster(Protocol):
    """Azure Batch or the local stand-in; the flow sees only this."""

    outputs: ContainerClient
    retries_in_service: bool  # True when the service itself retries a failed task
    # True when orchestrators on other machines can use the same pool (a Batch pool): runs
    # then take turns through the Prefect server, not only through a lock on this machine.
    shared: bool

    def ensure_pool(self) -> dict[str, Any]: ...

    # ``deadline``: an attempt it finds overdue is ended, and retried where attempts are left.
    def run_task(
        self,
        spec: TaskSpec,
        on_line: Callable[[str], None] = ...,
        deadline: ProgressDeadline | None = ...,
    ) -> TaskResult: ...

    def release(self) -> dict[str, Any]: ...

    # What the run rented (backends/cost.py prices it); a cluster that rents nothing returns
    # None from the first, and is never asked the second.
    def node_allocations(self) -> list[datetime] | None: ...

    # Now, by the clock the cluster's own timestamps are on (the service's, not this machine's).
    def clock(self) -> datetime: ...

    def usage(self, run_id: str, since: datetime, allocations: list[datetime]) -> PoolUsage: ...

    # The node kinds the run used, its Spot preemptions and fallback; None for a cluster that
    # has no Spot nodes (backends/spot_fallback.py).
    def spot_record(self) -> SpotRecord | None: ...
