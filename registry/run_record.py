"""A run's record, ``<run outputs>/run.json``: which data it trained on and how it ended.

``python -m cli.models list`` reads it to say, for every run, the data version, the decision
(promoted, not promoted, up to date, or failed and at which step) and the accuracy. Without it a
run that ended up to date (no model, no promotion decision) and a run that failed looked alike.

Written when the run starts (``running``: the data root it was asked for), again once the gate
has chosen its data version, and once at its end. A run that crashed or was cancelled keeps
``running``, which ``list`` shows as "no outcome recorded". Nothing secret goes in: names of
containers and prefixes, numbers, and for a failure the error's type and first line with any
signature or account key taken out.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from backends.azure.access import redact
from registry.layout import run_record_blob
from registry.record_blob import fraction, json_object, read_record, shown

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

Outcome = Literal[
    "running", "promoted", "not promoted", "up to date", "failed", "stopped by budget"
]
OUTCOMES: tuple[Outcome, ...] = (
    "running",
    "promoted",
    "not promoted",
    "up to date",
    "failed",
    "stopped by budget",  # training stopped at a checkpoint, resumable (core/budget.py)
)
MAX_RECORD_BYTES = 64 << 10  # a record is well under 2 KB
MAX_ERROR_CHARS = 300
# Connection-string fields a message could quote (a SAS in a URL is ``redact``'s).
_CONNECTION_SECRET = re.compile(r"((?:AccountKey|SharedAccessSignature)=)[^;\s\"']+", re.I)


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    outcome: Outcome
    started_at: str  # ISO 8601, UTC
    data: dict[str, Any]  # the data version (core.data_versions.DataVersion), or what was asked
    accuracy: float | None = None  # this run's model; None when it trained none
    reason: str = ""  # the promotion decision's, the up-to-date check's, or the error
    failed_step: str | None = None
    matched_run: str | None = None  # up to date: the run whose model is the one to use
    finished_at: str | None = None
    # What the run paid and was estimated to (core/cost_estimate.py reads it back as history).
    cost: dict[str, Any] | None = None

    def but(self, **changes: Any) -> RunRecord:
        return replace(self, **changes)


def error_summary(exc: BaseException) -> str:
    """``Type: first line``, with signatures and account keys taken out, at most 300 chars."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    line = _CONNECTION_SECRET.sub(r"\1REDACTED", redact(f"{type(exc).__name__}: {text}"))
    return line if len(line) <= MAX_ERROR_CHARS else f"{line[: MAX_ERROR_CHARS - 3]}..."


def write_run_record(outputs: ContainerClient, run_prefix: str, record: RunRecord) -> None:
    """Replace the record (one upload: a reader sees the old record or the new one)."""
    outputs.upload_blob(
        run_record_blob(run_prefix), json.dumps(asdict(record), indent=2), overwrite=True
    )


def parse_run_record(data: bytes) -> RunRecord | str:
    """The record in ``data``, or why it is unusable (a damaged record is named, not a crash)."""
    doc = json_object(data, MAX_RECORD_BYTES)
    if isinstance(doc, str):
        return doc
    if not isinstance(doc.get("run_id"), str) or doc.get("outcome") not in OUTCOMES:
        return "no run_id, or an outcome that is none of " + ", ".join(OUTCOMES)
    accuracy = doc.get("accuracy")
    if accuracy is not None and fraction(accuracy) is None:
        return f"accuracy is {shown(accuracy)}, not a number in [0, 1]"
    version = doc.get("data")

    def text(name: str) -> str | None:
        value = doc.get(name)
        return value if isinstance(value, str) else None

    return RunRecord(
        run_id=doc["run_id"],
        outcome=doc["outcome"],
        started_at=text("started_at") or "",
        data=version if isinstance(version, dict) else {},
        accuracy=fraction(accuracy),
        reason=text("reason") or "",
        failed_step=text("failed_step"),
        matched_run=text("matched_run"),
        finished_at=text("finished_at"),
        cost=doc["cost"] if isinstance(doc.get("cost"), dict) else None,
    )


def read_run_record(outputs: ContainerClient, run_prefix: str) -> RunRecord | str | None:
    """The record, why it is unusable, or None for a run from before records were kept."""
    stored = read_record(outputs, run_record_blob(run_prefix), MAX_RECORD_BYTES)
    return None if stored is None else parse_run_record(stored.data)
