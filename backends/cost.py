"""What a run paid for: node-minutes by phase, from the pool's own timestamps, and their price.

Each node is counted from the moment the pool allocated it (or the run started, for a node
already there) until the pool released it. Each moment of a node's time is given the phase the
*pool* was in then: the run's staging, training or scoring task existed (from its creation, when
the nodes are committed to it, to its end), or no task did yet (``allocating``: nodes booting,
mounting, pulling the image), or no task did between two (``idle between steps``: the
orchestrator collecting outputs, deciding, submitting), or none would any more (``idle before
release``). A node waiting while another one stages counts as staging: the pool is rented for it.

Idle minutes are what the orchestration itself costs; a pool held for a report, a retry delay or
a forgotten release shows there first.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.spot_fallback import SpotRecord

TASK_PHASES = ("staging", "training", "scoring")
# The pipeline's task ids start with their step (backends/taskspec.py, tasks/*.py).
PHASE_OF_TASK = (("stage-", "staging"), ("train-", "training"), ("score-", "scoring"))
PHASES = ("allocating", *TASK_PHASES, "idle between steps", "idle before release")
IDLE_PHASES = ("idle between steps", "idle before release")


@dataclass(frozen=True)
class Span:
    start: datetime
    end: datetime


@dataclass(frozen=True)
class PoolUsage:
    """A run's pool as the service recorded it."""

    nodes: list[Span]  # each node's time in the pool during the run
    tasks: dict[str, list[Span]]  # phase (TASK_PHASES) -> the run's task spans


def phase_of_task(task_id: str) -> str | None:
    """The phase a task of the pipeline belongs to, by its id."""
    return next((phase for prefix, phase in PHASE_OF_TASK if task_id.startswith(prefix)), None)


def _phase(
    moment: datetime, usage: PoolUsage, first: datetime | None, last: datetime | None
) -> str:
    for phase in TASK_PHASES:  # tasks of one run never overlap; the order breaks ties
        if any(s.start <= moment < s.end for s in usage.tasks.get(phase, [])):
            return phase
    if first is None or moment < first:
        return "allocating"
    if last is not None and moment >= last:
        return "idle before release"
    return "idle between steps"


def node_minutes(usage: PoolUsage) -> dict[str, float]:
    """Node-minutes per phase (every phase listed, zeros included)."""
    spans = [s for spans in usage.tasks.values() for s in spans]
    first = min((s.start for s in spans), default=None)
    last = max((s.end for s in spans), default=None)
    cuts = sorted(
        {t for s in [*usage.nodes, *spans] for t in (s.start, s.end)}
    )  # the phase and the number of nodes are constant between two cuts
    minutes = dict.fromkeys(PHASES, 0.0)
    for a, b in itertools.pairwise(cuts):
        alive = sum(1 for n in usage.nodes if n.start <= a and b <= n.end)
        if alive:
            minutes[_phase(a + (b - a) / 2, usage, first, last)] += (
                alive * (b - a).total_seconds() / 60
            )
    return minutes


def _minutes_between(usage: PoolUsage, start: datetime, end: datetime | None) -> float:
    """Node-minutes of ``usage`` from ``start`` to ``end`` (None: to the end)."""
    total = 0.0
    for node in usage.nodes:
        a, b = max(node.start, start), node.end if end is None else min(node.end, end)
        total += max(0.0, (b - a).total_seconds() / 60)
    return total


def spot_comparison(
    usage: PoolUsage, record: SpotRecord, dedicated_price: float, spot_price: float
) -> dict[str, object]:
    """A run with Spot nodes: its node-minutes on Spot and on dedicated nodes (each stretch of
    its node kinds split by their counts), its preemptions, and, with both prices, what it paid
    against the same node-minutes all on dedicated nodes."""
    spot = dedicated = 0.0
    for i, kinds in enumerate(record.kinds):
        end = record.kinds[i + 1].since if i + 1 < len(record.kinds) else None
        start = kinds.since if i else min((n.start for n in usage.nodes), default=kinds.since)
        minutes = _minutes_between(usage, start, end)
        share = kinds.spot / max(1, kinds.spot + kinds.dedicated)
        spot += minutes * share
        dedicated += minutes * (1 - share)
    report: dict[str, object] = {
        "spot_node_minutes": round(spot, 3),
        "dedicated_node_minutes": round(dedicated, 3),
        "preemptions": len(record.preemptions),
        "fallback": record.fallback,
    }
    if dedicated_price and spot_price:
        paid = (spot * spot_price + dedicated * dedicated_price) / 60
        on_dedicated = (spot + dedicated) * dedicated_price / 60
        report.update(
            {
                "spot_hourly_price": spot_price,
                "paid": round(paid, 4),
                "all_dedicated": round(on_dedicated, 4),
                "saved": round(on_dedicated - paid, 4),
            }
        )
    return report


def cost_report(usage: PoolUsage, hourly_price: float, vm_size: str) -> dict[str, object]:
    """The summary's cost section as data: node-minutes by phase, idle ones, estimated cost."""
    by_phase = node_minutes(usage)
    total = sum(by_phase.values())
    return {
        "vm_size": vm_size,
        "nodes": len(usage.nodes),
        "node_minutes": {k: round(v, 3) for k, v in by_phase.items()},
        "total_node_minutes": round(total, 3),
        "idle_node_minutes": round(sum(by_phase[p] for p in IDLE_PHASES), 3),
        "hourly_price": hourly_price,
        "estimated_cost": round(total / 60 * hourly_price, 4),
    }
