"""A data root's past spending, from its runs' records: what estimates and the budget read.

Run ids start with their UTC start time (``core/run.py``), so the newest runs are the last
names under ``runs/`` and a month's runs are those whose names start with it: an estimate reads
at most a few dozen records, and the monthly cap lists one month's folders.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING

from core.budget import MonthSpend
from core.cost_estimate import HISTORY_RUNS, PastRun, record_spend
from core.data_versions import DataRoot
from registry.layout import run_folder, runs_root
from registry.run_record import RunRecord, read_run_record
from registry.store import record_root

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

MAX_RECORDS_READ = 60  # records read for an estimate, other data roots' included
TRAINED = ("promoted", "not promoted")


def past_run(record: RunRecord) -> PastRun | None:
    """The run's cost history entry (None: it kept no cost, e.g. it rented nothing)."""
    return PastRun.from_record(record.run_id, record.cost, record.outcome in TRAINED)


def history_of(
    records: Iterable[RunRecord], root: DataRoot, limit: int = HISTORY_RUNS
) -> list[PastRun]:
    """The root's past runs with a cost record, in the order given (newest first)."""
    found: list[PastRun] = []
    for record in records:
        if record_root(record.data) != root:
            continue
        run = past_run(record)
        if run is not None:
            found.append(run)
        if len(found) >= limit:
            break
    return found


def spent(records: Iterable[RunRecord], root: DataRoot) -> MonthSpend:
    """What the root's runs among ``records`` spent together, by currency: each run's measured
    ``paid``, else the provisional spend it recorded before it was measured (a run that crashed
    counts for its estimate); runs without a price: nothing."""
    totals: dict[str, float] = {}
    for record in records:
        found = record_spend(record.cost) if record_root(record.data) == root else None
        if found is not None:
            amount, currency = found
            totals[currency] = totals.get(currency, 0.0) + amount
    return MonthSpend(totals)


def _run_ids(outputs: ContainerClient, base: str, starting: str = "") -> list[str]:
    folder = runs_root(base)
    ids = []
    for item in outputs.walk_blobs(name_starts_with=folder + starting, delimiter="/"):
        run_id = item.name[len(folder) :].rstrip("/")
        if run_id and item.name.endswith("/"):
            ids.append(run_id)
    return sorted(ids, reverse=True)


def _records(outputs: ContainerClient, base: str, run_ids: list[str]) -> Iterable[RunRecord]:
    for run_id in run_ids:
        record = read_run_record(outputs, run_folder(base, run_id))
        if isinstance(record, RunRecord):  # a damaged record tells nothing about cost
            yield record


def read_history(
    outputs: ContainerClient, base: str, root: DataRoot, exclude: str = ""
) -> list[PastRun]:
    """The root's newest past runs (``exclude``: the run asking), newest first."""
    ids = [r for r in _run_ids(outputs, base) if r != exclude][:MAX_RECORDS_READ]
    return history_of(_records(outputs, base, ids), root)


def read_month_spend(
    outputs: ContainerClient, base: str, root: DataRoot, now: datetime, exclude: str = ""
) -> MonthSpend:
    """What the root's runs that started in ``now``'s month (UTC) paid."""
    ids = [r for r in _run_ids(outputs, base, f"{now:%Y%m}") if r != exclude]
    return spent(_records(outputs, base, ids), root)
