"""Spot nodes a run follows: their preemptions, and when it gives up on them for dedicated ones.

A preempted Spot node requeues the whole multi-node task (Batch keeps ``retryCount``; the new
attempt resumes from the last checkpoint), and while Azure has no Spot capacity the task waits,
up to its whole lifetime. ``pool.spot_fallback`` bounds both: after ``after_preemptions``
preemptions of the run's nodes, or once the task has waited ``after_minutes_without_capacity``
for Spot nodes that do not come back, the pool is resized to as many dedicated nodes as it had
nodes, and no Spot node (``backends/azure/batch.py``); the run says so.

What the run used is kept as :class:`NodeKinds` entries, the node counts and kinds from each
moment on (the service's clock): the seam the cost estimate and the summary read to price Spot
and dedicated node-minutes apart. Every moment here is the service's, so a test moves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.config import PoolConfig

# Node states in which a Spot node is capacity the task has or will have soon.
HELD = {"idle", "running", "starting", "waitingforstarttask", "creating", "rebooting", "reimaging"}


@dataclass(frozen=True)
class NodeKinds:
    """From ``since`` on, the pool was asked for ``dedicated`` and ``spot`` nodes (``why``)."""

    since: datetime
    dedicated: int
    spot: int
    why: str


@dataclass
class SpotRecord:
    """What a run did with Spot nodes: the node kinds in order, each preemption (node id,
    service time), and why it moved to dedicated nodes, if it did."""

    kinds: list[NodeKinds] = field(default_factory=list)
    preemptions: list[tuple[str, datetime]] = field(default_factory=list)
    fallback: str | None = None

    def as_record(self) -> dict[str, Any]:
        return {
            "preemptions": len(self.preemptions),
            "spot_fallback": self.fallback,
            "node_kinds": [
                {
                    "since": k.since.isoformat(),
                    "dedicated": k.dedicated,
                    "spot": k.spot,
                    "why": k.why,
                }
                for k in self.kinds
            ],
        }


class SpotWatch:
    """Follows a run's pool through the node listings the cluster reads while its task runs;
    :meth:`observe` says when to fall back (once)."""

    def __init__(self, pool: PoolConfig, since: datetime) -> None:
        self.policy = pool.spot_fallback
        self.wanted = pool.low_priority_nodes
        self.record = SpotRecord(
            [NodeKinds(since, pool.dedicated_nodes, pool.low_priority_nodes, "pool settings")]
        )
        self._counted: set[tuple[str, str]] = set()
        self._short_since: datetime | None = None
        self._this_attempt = 0  # preemptions seen since the task's attempt started

    @property
    def on_spot(self) -> bool:
        return self.record.kinds[-1].spot > 0

    def observe(self, nodes: list[Any], task_running: bool, now: datetime) -> str | None:
        """One listing of the pool's nodes (``id``, ``state``, ``is_dedicated``,
        ``state_transition_time``) and whether the task runs; the reason to move to dedicated
        nodes now, or None."""
        if not self.on_spot:
            return None
        for node in nodes:
            if node.state == "preempted" and not node.is_dedicated:
                key = (str(node.id), str(node.state_transition_time))
                if key not in self._counted:
                    self._counted.add(key)
                    self.record.preemptions.append((str(node.id), now))
                    self._this_attempt += 1
        held = sum(1 for n in nodes if not n.is_dedicated and n.state in HELD)
        if task_running or held >= self.wanted:
            self._short_since = None
        elif self._short_since is None:
            self._short_since = now
        if self.record.fallback is not None:
            return None
        limit = self.policy.after_preemptions
        if limit is not None and len(self.record.preemptions) >= limit:
            return f"{len(self.record.preemptions)} preemptions of Spot nodes (limit {limit})"
        minutes = self.policy.after_minutes_without_capacity
        if (
            minutes is not None
            and self._short_since is not None
            and now - self._short_since >= timedelta(minutes=minutes)
        ):
            return (
                f"no Spot capacity for {(now - self._short_since).total_seconds() / 60:.1f} "
                f"minutes ({held} of {self.wanted} Spot nodes; limit {minutes:g})"
            )
        return None

    def requeued(self, now: datetime) -> None:
        """The task started again without a retry: on a pool with Spot nodes, a preemption,
        counted here when no listing caught the node preempted (it may be back by the next
        poll)."""
        if self.on_spot and self._this_attempt == 0:
            self.record.preemptions.append(("a node of the task", now))
        self._this_attempt = 0

    def moved(self, now: datetime, dedicated: int, why: str) -> None:
        """The pool was resized to ``dedicated`` dedicated nodes and no Spot node."""
        self.record.fallback = why
        self.record.kinds.append(NodeKinds(now, dedicated, 0, f"spot fallback: {why}"))
