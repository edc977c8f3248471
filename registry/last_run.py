"""The last trained run: what the next run compares itself with to know it has nothing to do.

``<output prefix>/models/datasets/<data root>/last-run.json`` in the output container (beside
that data root's champion record) holds the fingerprint of the last run that trained and scored
a model on that data root: the data version the gate saw, the code and image versions, the
training settings and the number of processes, with the run's id, model blob and accuracy. It
is written last, once the run's outcome is known (its model scored, the promotion decided, its
report written), so a run that failed half-way never makes the next one skip its training; the
run holds its pool until then (flows/pool_lock.py), so a run of the same inputs waiting for that
pool decides after the record is there.

Each trained fingerprint also keeps a record of its own, ``trained/<digest>.json``: a
data version trained once is not trained again when a run for it comes later, after another
version was trained (the sensor reporting a version a manual run already trained, a run named
for an older version).

A stored record that cannot be used (empty, not JSON, another shape, an accuracy that is not a
number in [0, 1], a model that names no model blob) is reported with the reason and counts as
no record: the next run trains, and says why, instead of crashing or skipping.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from core.data_versions import DataRoot
from registry.layout import is_model_blob, last_run_blob, trained_blob
from registry.record_blob import fraction, json_object, read_record, shown

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

MAX_RECORD_BYTES = 64 << 10  # a record is well under 2 KB


@dataclass(frozen=True)
class LastRun:
    """A valid last-run record."""

    run_id: str
    fingerprint: dict[str, Any]
    model: str  # blob in the output container
    outputs: str  # the run's output prefix
    accuracy: float
    finished_at: str  # ISO 8601, UTC
    data: dict[str, Any] | None = None  # the data version's record; None in older records


def parse_last_run(data: bytes) -> LastRun | str:
    """The record in ``data``, or why it is unusable."""
    doc = json_object(data, MAX_RECORD_BYTES)
    if isinstance(doc, str):
        return doc
    wanted: dict[str, type | tuple[type, ...]] = {
        "run_id": str,
        "fingerprint": dict,
        "model": str,
        "outputs": str,
        "accuracy": (int, float),
        "finished_at": str,
    }
    for name, kind in wanted.items():
        if not isinstance(doc.get(name), kind) or isinstance(doc.get(name), bool):
            return f"field {name} is missing or not a {getattr(kind, '__name__', 'number')}"
    accuracy = fraction(doc["accuracy"])
    if accuracy is None:
        return f"accuracy is {shown(doc['accuracy'])}, not a finite number in [0, 1]"
    if not is_model_blob(doc["model"]):
        return f"model is {shown(doc['model'])}, not a model blob name"
    version = doc.get("data")
    return LastRun(
        **{name: doc[name] for name in wanted if name != "accuracy"},
        accuracy=accuracy,
        data=version if isinstance(version, dict) else None,
    )


def read_last_run(
    outputs: ContainerClient, base: str, root: DataRoot
) -> tuple[LastRun | None, str | None]:
    """The last run that trained on ``root``: (the record, None), (None, None) when there is
    none, or (None, why it is unusable)."""
    return _read(outputs, last_run_blob(base, root))


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:32]


def _read(outputs: ContainerClient, name: str) -> tuple[LastRun | None, str | None]:
    stored = read_record(outputs, name, MAX_RECORD_BYTES)
    if stored is None:
        return None, None
    parsed = parse_last_run(stored.data)
    if isinstance(parsed, str):
        return None, f"{name} is unusable ({parsed})"
    return parsed, None


def read_trained(
    outputs: ContainerClient, base: str, root: DataRoot, fingerprint: dict[str, Any]
) -> LastRun | None:
    """The run that trained exactly ``fingerprint`` on ``root``, if one did (an unusable
    record: none)."""
    record, _ = _read(outputs, trained_blob(base, root, fingerprint_digest(fingerprint)))
    return record if record is not None and record.fingerprint == fingerprint else None


def write_last_run(outputs: ContainerClient, base: str, root: DataRoot, record: LastRun) -> None:
    """Replace ``root``'s record (one blob upload: a reader sees the old record or the new
    one), and keep it as the record of its fingerprint."""
    body = json.dumps(asdict(record), indent=2)
    outputs.upload_blob(
        trained_blob(base, root, fingerprint_digest(record.fingerprint)), body, overwrite=True
    )
    outputs.upload_blob(last_run_blob(base, root), body, overwrite=True)


def blob_exists(outputs: ContainerClient, name: str) -> bool:
    return bool(outputs.get_blob_client(name).exists())
