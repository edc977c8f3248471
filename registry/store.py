"""The trained models in the output container, as a person asks for them: which runs there
were, how each scored and what was decided, and a model copied out to a file.

Read from what the flow writes: each run's record (``<output prefix>/runs/<run id>/run.json``:
its data version and how it ended, ``registry/run_record.py``), its promotion decision
(``promotion.json``, all runs from before run records have) and the champion record, so a
listing is always the flow's own account. Every run is listed: promoted, not promoted, up to date
(nothing trained: another run's model is the one to use), failed (at which step, and why), or
with no outcome recorded (still running, or stopped by a crash or a cancellation); a person
looking for a run should find it and see why it has no model.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.champion import read_champion
from registry.layout import RUN_RECORD, decision_blob, run_folder, runs_root
from registry.run_record import RunRecord, read_run_record
from training.atomic import atomic_write

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

MAX_DECISION_BYTES = 1 << 20  # a promotion record is a few KB


class ModelStoreError(RuntimeError):
    """What was asked for is not there or cannot be trusted; the message names the blob."""


@dataclass(frozen=True)
class RunEntry:
    run_id: str
    accuracy: float | None  # None: the run trained no model it was scored on
    promoted: bool | None
    reason: str
    champion: bool  # the model serving now
    outcome: str = "unfinished"  # promoted, not promoted, up to date, failed, unfinished
    data: str = "-"  # the data version it trained (or was asked for), as a person reads it
    failed_step: str | None = None

    @property
    def decision(self) -> str:
        """The outcome and why, in one phrase for a table."""
        if self.outcome == "failed":
            where = f" at {self.failed_step}" if self.failed_step else ""
            return f"failed{where}: {self.reason}"
        return f"{self.outcome}: {self.reason}" if self.reason else self.outcome


def _decision(container: ContainerClient, blob: str) -> dict[str, Any] | None:
    from azure.core.exceptions import ResourceNotFoundError

    try:
        data = container.download_blob(blob).readall()
    except ResourceNotFoundError:
        return None
    if len(data) > MAX_DECISION_BYTES:
        return {"reason": f"{blob} is unusable (larger than {MAX_DECISION_BYTES} bytes)"}
    try:
        doc = json.loads(data)
    except ValueError:
        return {"reason": f"{blob} is unusable (not JSON)"}
    return doc if isinstance(doc, dict) else {"reason": f"{blob} is unusable (not an object)"}


def data_label(data: dict[str, Any]) -> str:
    """A run's data version in a word: its name, a root without versions, or, when the run
    stopped before choosing, the version it asked for ("newest" when it asked for none)."""
    version, root = data.get("version"), data.get("root")
    if "chosen" in data:  # the data version the run trained on
        return str(version) if version else f"{root or '(container)'} (no versions)"
    return str(version) if version else "newest (not chosen)" if data else "-"


def _entry(run_id: str, record: RunRecord, champion: bool) -> RunEntry:
    outcome: str = record.outcome
    reason = record.reason
    if outcome == "up to date":
        reason = f"nothing trained, run {record.matched_run}'s model is the one to use"
    elif outcome == "running":
        outcome = "unfinished"
        reason = "no outcome recorded (still running, or stopped by a crash or a cancellation)"
    promoted = {"promoted": True, "not promoted": False}.get(record.outcome)
    return RunEntry(
        run_id,
        record.accuracy,
        promoted,
        reason,
        champion,
        outcome,
        data_label(record.data),
        record.failed_step,
    )


def _from_decision(container: ContainerClient, run_id: str, base: str, champion: bool) -> RunEntry:
    """A run from before run records: what its promotion decision says, if it has one."""
    doc = _decision(container, decision_blob(run_folder(base, run_id)))
    value = doc.get("accuracy") if doc else None
    accuracy = float(value) if isinstance(value, int | float) else None
    promoted = doc.get("promoted") if doc else None
    decided = promoted if isinstance(promoted, bool) else None
    return RunEntry(
        run_id,
        accuracy,
        decided,
        str(doc.get("reason", "")) if doc else "did not reach its promotion decision",
        champion,
        "unfinished" if decided is None else "promoted" if decided else "not promoted",
    )


def list_runs(container: ContainerClient, base: str, metric: str) -> list[RunEntry]:
    """Every run under ``<base>/runs/``, oldest first (run ids sort by start time)."""
    champion = read_champion(container, base, metric).champion
    root = runs_root(base)
    entries = []
    for item in container.walk_blobs(name_starts_with=root, delimiter="/"):
        run_id = item.name[len(root) :].rstrip("/")
        if not run_id or not item.name.endswith("/"):
            continue  # a blob directly under runs/, not a run's folder
        serving = champion is not None and champion.run_id == run_id
        record = read_run_record(container, run_folder(base, run_id))
        if isinstance(record, RunRecord):
            entries.append(_entry(run_id, record, serving))
        elif isinstance(record, str):
            blob = f"{run_folder(base, run_id)}/{RUN_RECORD}"
            entries.append(RunEntry(run_id, None, None, f"{blob} is unusable ({record})", serving))
        else:
            entries.append(_from_decision(container, run_id, base, serving))
    return sorted(entries, key=lambda e: e.run_id)


def run_file(base: str, run_id: str, name: str) -> str:
    """A file of a run's outputs (``model.pt``, ``metrics.json``, ``logs/stdout.txt``, ...)."""
    parts = name.strip("/").split("/")
    if not name.strip("/") or any(p in ("", ".", "..") for p in parts):
        raise ModelStoreError(f"{name!r} is not a file name inside a run's outputs")
    return f"{run_folder(base, run_id)}/{'/'.join(parts)}"


def model_blob(container: ContainerClient, base: str, metric: str, run_id: str | None) -> str:
    """The model blob of ``run_id``, or of the champion when None."""
    if run_id is not None:
        return run_file(base, run_id, "model.pt")
    read = read_champion(container, base, metric)
    if read.damaged:
        raise ModelStoreError(f"the champion record is damaged ({read.damaged}): name a run")
    if read.champion is None:
        raise ModelStoreError("there is no champion yet: no run has been promoted")
    return read.champion.model


def download(container: ContainerClient, blob: str, dest: Path) -> Path:
    """Copy ``blob`` to ``dest`` (a file, or a folder that gets the blob's name) whole and
    checked: written under a temporary name and renamed, and compared with the MD5 the service
    stored when there is one, so a cut download never leaves a file that looks like a model."""
    from azure.core.exceptions import ResourceNotFoundError

    target = dest / Path(blob).name if dest.is_dir() else dest
    try:
        stream = container.download_blob(blob)
    except ResourceNotFoundError:
        raise ModelStoreError(f"{blob} does not exist in {container.container_name}") from None
    stored = stream.properties.content_settings.content_md5
    digest = hashlib.md5(usedforsecurity=False)

    def write(fh: Any) -> None:
        for chunk in stream.chunks():
            digest.update(chunk)
            fh.write(chunk)
        if stored and digest.digest() != bytes(stored):
            raise ModelStoreError(
                f"{blob}: the downloaded bytes do not match the stored MD5 "
                f"{base64.b64encode(bytes(stored)).decode()}"
            )

    atomic_write(target, write)
    return target
