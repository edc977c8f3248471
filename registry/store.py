"""The trained models in the output container, as a person asks for them: which runs there
were, how each scored and what was decided, and a model copied out to a file.

Read from what the flow already writes (``<output prefix>/runs/<run id>/promotion.json``, the
champion record), so nothing new is stored and a listing is always the flow's own account. A run
that stopped before its promotion decision is listed too, as unfinished: a person looking for a
run should find it and see why it has no model.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.champion import read_champion
from registry.layout import decision_blob, run_folder, runs_root
from training.atomic import atomic_write

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

MAX_DECISION_BYTES = 1 << 20  # a promotion record is a few KB


class ModelStoreError(RuntimeError):
    """What was asked for is not there or cannot be trusted; the message names the blob."""


@dataclass(frozen=True)
class RunEntry:
    run_id: str
    accuracy: float | None  # None: the run did not reach its promotion decision
    promoted: bool | None
    reason: str
    champion: bool  # the model serving now


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


def list_runs(container: ContainerClient, base: str, metric: str) -> list[RunEntry]:
    """Every run under ``<base>/runs/``, oldest first (run ids sort by start time)."""
    champion = read_champion(container, base, metric).champion
    root = runs_root(base)
    entries = []
    for item in container.walk_blobs(name_starts_with=root, delimiter="/"):
        run_id = item.name[len(root) :].rstrip("/")
        if not run_id or not item.name.endswith("/"):
            continue  # a blob directly under runs/, not a run's folder
        doc = _decision(container, decision_blob(run_folder(base, run_id)))
        value = doc.get("accuracy") if doc else None
        accuracy = float(value) if isinstance(value, int | float) else None
        promoted = doc.get("promoted") if doc else None
        entries.append(
            RunEntry(
                run_id,
                accuracy,
                promoted if isinstance(promoted, bool) else None,
                str(doc.get("reason", "")) if doc else "did not reach its promotion decision",
                champion is not None and champion.run_id == run_id,
            )
        )
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
