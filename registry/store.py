"""The trained models in the output container, as a person asks for them: which runs there
were, how each scored and what was decided, and a model copied out to a file.

Read from what the flow writes: each run's record (``<output prefix>/runs/<run id>/run.json``:
its data root and version and how it ended, ``registry/run_record.py``), its promotion decision
(``promotion.json``, all runs from before run records have) and the champion record of each data
root (``registry.champion``), so a listing is always the flow's own account. Every run is
listed: promoted, not promoted, up to date (nothing trained: the run it matched had trained the
same inputs), failed (at which step, and why), or with no outcome recorded (still running, or
stopped by a crash or a cancellation); a person looking for a run should find it and see why it
has no model.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.atomic import atomic_write
from core.data_versions import DataRoot
from core.text import printable
from registry.champion import Champion, champion_for
from registry.layout import RUN_RECORD, decision_blob, run_folder, runs_root
from registry.record_blob import fraction, json_object, read_record
from registry.run_record import RunRecord, read_run_record

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

MAX_DECISION_BYTES = 1 << 20  # a promotion record is a few KB
MAX_METRICS_BYTES = 64 << 20  # metrics.json lists the skipped images, at most a few MB
# Characters of stored text a listing shows: far more than any decision the pipeline writes (a
# few hundred), so a decision is always shown whole; only a record edited to megabytes is cut,
# and the listing then says how much it left out.
MAX_TEXT = 4000


class ModelStoreError(RuntimeError):
    """What was asked for is not there or cannot be trusted; the message names the blob."""


@dataclass(frozen=True)
class RunEntry:
    run_id: str
    accuracy: float | None  # None: the run trained no model it was scored on
    promoted: bool | None
    reason: str
    champion: bool  # the model serving its data root now
    outcome: str = "unfinished"  # promoted, not promoted, up to date, failed, unfinished
    data: str = "-"  # the data version it trained (or was asked for), as a person reads it
    failed_step: str | None = None
    root: str = "-"  # the data root (container/prefix) it trained, as a person reads it

    @property
    def decision(self) -> str:
        """The outcome and why, in one phrase for a table."""
        if self.outcome == "failed":
            where = f" at {self.failed_step}" if self.failed_step else ""
            return f"failed{where}: {self.reason}"
        return f"{self.outcome}: {self.reason}" if self.reason else self.outcome


def _decision(container: ContainerClient, blob: str) -> dict[str, Any] | None:
    stored = read_record(container, blob, MAX_DECISION_BYTES)
    if stored is None:
        return None
    doc = json_object(stored.data, stored.limit)
    return {"reason": f"{blob} is unusable ({doc})"} if isinstance(doc, str) else doc


def _text(value: Any) -> str:
    """Stored text as a terminal line shows it: control characters escaped (an escape sequence
    in a record would move the cursor and forge other lines), at most ``MAX_TEXT``
    characters."""
    line = printable(str(value))
    if len(line) <= MAX_TEXT:
        return line
    return f"{line[:MAX_TEXT]} [{len(line) - MAX_TEXT} more characters not shown]"


def data_label(data: dict[str, Any]) -> str:
    """A run's data version in a word: its name, a root without versions, or, when the run
    stopped before choosing, the version it asked for ("newest" when it asked for none)."""
    version, root = data.get("version"), data.get("root")
    if "chosen" in data:  # the data version the run trained on
        return str(version) if version else f"{root or '(container)'} (no versions)"
    return str(version) if version else "newest (not chosen)" if data else "-"


def record_root(data: dict[str, Any]) -> DataRoot | None:
    """The data root a run record names (None: a record that names none)."""
    container, prefix = data.get("container"), data.get("root")
    if isinstance(container, str) and isinstance(prefix, str):
        return DataRoot(container, prefix.strip("/"))
    return None


def _entry(run_id: str, record: RunRecord, champion: bool) -> RunEntry:
    outcome: str = record.outcome
    reason = record.reason
    if outcome == "up to date":
        reason = f"nothing trained: the data, code and settings of run {record.matched_run}"
    elif outcome == "running":
        outcome = "unfinished"
        reason = "no outcome recorded (still running, or stopped by a crash or a cancellation)"
    promoted = {"promoted": True, "not promoted": False}.get(record.outcome)
    root = record_root(record.data)
    return RunEntry(
        _text(run_id),
        record.accuracy,
        promoted,
        _text(reason),
        champion,
        outcome,
        _text(data_label(record.data)),
        _text(record.failed_step) if record.failed_step else None,
        _text(root.where) if root else "-",
    )


def _from_decision(container: ContainerClient, run_id: str, base: str, champion: bool) -> RunEntry:
    """A run from before run records: what its promotion decision says, if it has one."""
    doc = _decision(container, decision_blob(run_folder(base, run_id)))
    accuracy = fraction(doc.get("accuracy")) if doc else None
    promoted = doc.get("promoted") if doc else None
    decided = promoted if isinstance(promoted, bool) else None
    return RunEntry(
        _text(run_id),
        accuracy,
        decided,
        _text(doc.get("reason", "")) if doc else "did not reach its promotion decision",
        champion,
        "unfinished" if decided is None else "promoted" if decided else "not promoted",
    )


class _Champions:
    """The champion of each data root, read once per root."""

    def __init__(self, container: ContainerClient, base: str) -> None:
        self.container, self.base = container, base
        self._read: dict[DataRoot, Champion | None] = {}

    def __call__(self, root: DataRoot | None) -> Champion | None:
        if root is None:
            return None
        if root not in self._read:
            self._read[root] = champion_for(self.container, self.base, root).champion
        return self._read[root]

    def serving(self) -> set[str]:
        return {c.run_id for c in self._read.values() if c is not None}


def list_runs(
    container: ContainerClient, base: str, roots: list[DataRoot] | None = None
) -> list[RunEntry]:
    """Every run under ``<base>/runs/``, oldest first (run ids sort by start time), each with
    its data root; a run is marked as the champion when it serves its own data root. The
    champions of ``roots`` (the config's) are marked even for runs that do not name a root
    (runs from before run records)."""
    champions = _Champions(container, base)
    for root in roots or []:
        champions(root)
    root_folder = runs_root(base)
    found: list[tuple[str, RunRecord | str | None]] = []
    for item in container.walk_blobs(name_starts_with=root_folder, delimiter="/"):
        run_id = item.name[len(root_folder) :].rstrip("/")
        if not run_id or not item.name.endswith("/"):
            continue  # a blob directly under runs/, not a run's folder
        record = read_run_record(container, run_folder(base, run_id))
        if isinstance(record, RunRecord):
            champions(record_root(record.data))
        found.append((run_id, record))
    serving = champions.serving()
    entries = []
    for run_id, record in found:
        if isinstance(record, RunRecord):
            champion = champions(record_root(record.data))
            entries.append(
                _entry(run_id, record, champion is not None and champion.run_id == run_id)
            )
        elif isinstance(record, str):
            blob = f"{run_folder(base, run_id)}/{RUN_RECORD}"
            reason = _text(f"{blob} is unusable ({record})")
            entries.append(RunEntry(_text(run_id), None, None, reason, run_id in serving))
        else:
            entries.append(_from_decision(container, run_id, base, run_id in serving))
    return sorted(entries, key=lambda e: e.run_id)


def run_file(base: str, run_id: str, name: str) -> str:
    """A file of a run's outputs (``model.pt``, ``metrics.json``, ``logs/stdout.txt``, ...)."""
    if (
        not run_id
        or run_id in (".", "..")
        or any(c in run_id for c in "/\\")
        or not (run_id.isprintable())
    ):
        raise ModelStoreError(
            f"{printable(run_id)!r} is not a run id (one folder name under runs/, as `list` "
            "shows them)"
        )
    parts = name.strip("/").split("/")
    if not name.strip("/") or any(p in ("", ".", "..") for p in parts):
        raise ModelStoreError(f"{name!r} is not a file name inside a run's outputs")
    return f"{run_folder(base, run_id)}/{'/'.join(parts)}"


def champion_of(container: ContainerClient, base: str, root: DataRoot) -> Champion:
    """The champion of the data root ``root``; ModelStoreError names the root when there is
    none to use."""
    read = champion_for(container, base, root)
    if read.damaged:
        raise ModelStoreError(
            f"the champion record of data root {root.where} ({read.blob}) is damaged "
            f"({read.damaged}): name a run"
        )
    if read.champion is None:
        raise ModelStoreError(
            f"there is no champion of data root {root.where} yet: no run that trained it has "
            "been promoted (data.container and data.prefix name the dataset)"
        )
    return read.champion


def model_blob(container: ContainerClient, base: str, root: DataRoot, run_id: str | None) -> str:
    """The model blob of ``run_id``, or of the champion of ``root`` when None."""
    if run_id is not None:
        return run_file(base, run_id, "model.pt")
    return champion_of(container, base, root).model


# The model files whose MD5 the trainer records in metrics.json, and under which key.
RECORDED_MD5 = {"model.pt": "model_md5", "model.onnx": "onnx_md5"}


def recorded_model_md5(container: ContainerClient, blob: str) -> str | None:
    """The MD5 (base64) the trainer recorded for the model ``blob`` (``model.pt`` or
    ``model.onnx``) in the ``metrics.json`` beside it, or None (not a run's model, or a run
    from before the trainer recorded it).

    Blob storage stores an MD5 only for a blob uploaded in one request (64 MB and less with the
    SDK's defaults; Batch's output files never): a ResNet-50 model is uploaded in blocks, so
    without this nothing would check it. ``metrics.json`` is small enough to carry the
    service's own MD5, which the download of it checks."""
    folder, _, name = blob.rpartition("/")
    key = RECORDED_MD5.get(name)
    if not folder or key is None:
        return None
    stored = read_record(container, f"{folder}/metrics.json", MAX_METRICS_BYTES)
    doc = None if stored is None else json_object(stored.data, stored.limit)
    value = doc.get(key) if isinstance(doc, dict) else None
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True)
class Downloaded:
    path: Path
    checked: str  # what the bytes were compared with, in words


def download(
    container: ContainerClient, blob: str, dest: Path | str, expected_md5: str | None = None
) -> Downloaded:
    """Copy ``blob`` to ``dest`` whole and checked: written under a temporary name and renamed,
    and compared with the MD5 the service stored and with ``expected_md5`` (base64; the
    trainer's, for a model), so a cut or replaced download never leaves a file that looks like
    a model. ``dest`` is a file, or a folder that gets the blob's name: an existing one, or one
    written with a trailing ``/`` (created)."""
    from azure.core.exceptions import ResourceNotFoundError

    folder = str(dest).endswith(("/", os.sep)) or Path(dest).is_dir()
    target = Path(dest) / Path(blob).name if folder else Path(dest)
    try:
        stream = container.download_blob(blob)
    except ResourceNotFoundError:
        raise ModelStoreError(f"{blob} does not exist in {container.container_name}") from None
    stored = stream.properties.content_settings.content_md5
    wanted = {
        "the stored MD5": base64.b64encode(bytes(stored)).decode() if stored else None,
        "the MD5 the trainer recorded": expected_md5,
    }
    checks = {what: value for what, value in wanted.items() if value}
    digest = hashlib.md5(usedforsecurity=False)

    def write(fh: Any) -> None:
        for chunk in stream.chunks():
            digest.update(chunk)
            fh.write(chunk)
        got = base64.b64encode(digest.digest()).decode()
        for what, value in checks.items():
            if got != value:
                raise ModelStoreError(f"{blob}: the downloaded bytes do not match {what} {value}")

    atomic_write(target, write)
    checked = " and ".join(checks) or "nothing: no MD5 was stored or recorded for it"
    return Downloaded(target, checked)
