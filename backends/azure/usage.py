"""A run's pool usage as Azure Batch itself recorded it (``backends/cost.py`` prices it).

Two readings, because the nodes leave the pool with the release: before it, each node's
``allocationTime``; after it, the moment the pool was steady at zero nodes
(``allocationStateTransitionTime``), and the run's tasks (their ``creationTime`` and
``executionInfo.endTime``; jobs and tasks outlive the nodes). The service's clock is used
throughout, so the orchestrator's clock skew does not enter the figures: where a moment is not
a stored timestamp (the run's start, "now" for a pool already deleted), it is the Date header
of the service's answer.
"""

from __future__ import annotations

from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any

from backends.cost import PoolUsage, Span, phase_of_task


def node_allocations(client: Any, pool_id: str) -> list[datetime]:
    """When each node now in the pool was allocated (none when the pool does not exist)."""
    from azure.core.exceptions import ResourceNotFoundError

    try:
        nodes = list(client.list_nodes(pool_id))
    except ResourceNotFoundError:
        return []
    return [n.allocation_time for n in nodes if n.allocation_time is not None]


def _service_date(headers: Any) -> datetime:
    """The service's clock at a response: its Date header (this machine's clock may differ)."""
    header = headers.get("Date") if headers is not None else None
    if not header:
        raise RuntimeError("Batch answered without a Date header: its clock is unknown")
    return parsedate_to_datetime(header)


def _pool_and_now(client: Any, pool_id: str) -> tuple[Any | None, datetime]:
    """The pool (None when it does not exist) and the service's clock when it answered."""
    from azure.core.exceptions import ResourceNotFoundError

    def with_date(response: Any, pool: Any, _headers: Any) -> tuple[Any, datetime]:
        return pool, _service_date(response.http_response.headers)

    try:
        found: tuple[Any, datetime] = client.get_pool(pool_id, cls=with_date)
        return found
    except ResourceNotFoundError as exc:
        response: Any = exc.response
        return None, _service_date(response.headers if response is not None else None)


def service_now(client: Any, pool_id: str) -> datetime:
    """Now, by the clock of the service whose timestamps a run's usage is made of."""
    return _pool_and_now(client, pool_id)[1]


def released_at(client: Any, pool_id: str) -> datetime:
    """When the pool reached zero nodes; the service's now, when it is gone (deleted) or still
    shrinking."""
    pool, now = _pool_and_now(client, pool_id)
    if pool is None:
        return now
    nodes = (pool.current_dedicated_nodes or 0) + (pool.current_low_priority_nodes or 0)
    moment = pool.allocation_state_transition_time
    if pool.allocation_state == "steady" and nodes == 0 and moment is not None:
        return moment
    return now


def run_tasks(client: Any, pool_id: str, run_id: str, until: datetime) -> dict[str, list[Span]]:
    """The run's task spans by phase: from creation (the nodes are committed to the task from
    then, also across Batch's own retries) to the end (``until`` for one still running)."""
    from azure.core.exceptions import ResourceNotFoundError

    spans: dict[str, list[Span]] = {}
    for job in client.list_jobs():
        job_id = str(job.id or "")
        pool = job.pool_info.pool_id if job.pool_info else None
        if pool != pool_id or not job_id.startswith(f"{pool_id}-") or run_id not in job_id:
            continue
        task_id = job_id[len(pool_id) + 1 :]  # one task per job, named as the job's suffix
        phase = phase_of_task(task_id)
        if phase is None:
            continue
        try:
            task = client.get_task(job_id, task_id)
        except ResourceNotFoundError:
            continue
        info = task.execution_info
        end = info.end_time if info is not None and info.end_time is not None else until
        spans.setdefault(phase, []).append(Span(task.creation_time, end))
    return spans


def pool_usage(
    allocations: list[datetime],
    tasks: dict[str, list[Span]],
    since: datetime,
    until: datetime,
) -> PoolUsage:
    """Nodes counted from their allocation, or from ``since`` (the run's start) for a node that
    was already in the pool, until the release."""
    return PoolUsage([Span(max(a, since), until) for a in allocations], tasks)
