"""Records kept before data roots had folders of their own, copied into their roots' folders once.

Until the champion was kept per data root, ``<output prefix>/models/`` held one champion for the
whole output prefix (``champion.json``, ``history/``) and one last run (``last-run.json``,
``trained/``), whichever data root the run had trained: a run over another dataset took the
champion. The first registry reader after the change (a run's up-to-date check or promotion,
``cli.models``, ``label-images``) copies each such record into the folder of the data root it
belongs to, says so in its log, and writes ``models/migrated.json`` listing every record and
where it went, so it happens once. The old blobs are left as they were: nothing stored is lost,
and an older version of the pipeline still reads them.

Which data root a record belongs to: the one its run's record (``runs/<id>/run.json``) names,
else the one the record itself names; a record that names none (written before either existed)
is taken as the data root of the config that reads it first, and the log says so. A record that
cannot be read (damaged) is left in place, named, and copied nowhere.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from core.data_versions import DataRoot
from registry.champion import MAX_RECORD_BYTES as CHAMPION_BYTES
from registry.champion import parse_record
from registry.last_run import MAX_RECORD_BYTES as LAST_RUN_BYTES
from registry.last_run import parse_last_run
from registry.layout import (
    LEGACY_CHAMPION,
    LEGACY_HISTORY,
    LEGACY_LAST_RUN,
    LEGACY_TRAINED,
    MIGRATED,
    champion_blob,
    history_blob,
    last_run_blob,
    migrated_blob,
    records_blob,
    run_folder,
    trained_blob,
)
from registry.record_blob import read_record
from registry.run_record import RunRecord, read_run_record


@dataclass(frozen=True)
class Moved:
    """One record of the old layout: where it was copied (None: nowhere) and why."""

    source: str
    target: str | None
    note: str


class _Roots:
    """The data root of each run, from its run record (read once per run)."""

    def __init__(self, container: Any, base: str, fallback: DataRoot) -> None:
        self.container, self.base, self.fallback = container, base, fallback
        self._runs: dict[str, DataRoot | None] = {}

    def of_run(self, run_id: str) -> DataRoot | None:
        if run_id not in self._runs:
            record = read_run_record(self.container, run_folder(self.base, run_id))
            data = record.data if isinstance(record, RunRecord) else {}
            container, prefix = data.get("container"), data.get("root")
            self._runs[run_id] = (
                DataRoot(container, prefix.strip("/"))
                if isinstance(container, str) and isinstance(prefix, str)
                else None
            )
        return self._runs[run_id]

    def choose(self, run_id: str, recorded: DataRoot | None) -> tuple[DataRoot, str]:
        """The root a record of ``run_id`` belongs to, and how that was known."""
        root = self.of_run(run_id)
        if root is not None:
            return root, f"data root {root.where}, from run {run_id}'s record"
        if recorded is not None:
            return recorded, f"data root {recorded.where}, from the record itself"
        return self.fallback, (
            f"no data root recorded for run {run_id}: taken as {self.fallback.where}, the data "
            "root of the config that read it first"
        )


def _copy(container: Any, data: bytes, target: str) -> bool:
    """Write ``data`` to ``target`` unless a record is there already (a newer one, or a copy
    another reader made at the same time); whether it wrote."""
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError

    try:
        container.upload_blob(
            target, data, overwrite=True, match_condition=MatchConditions.IfMissing
        )
    except (ResourceExistsError, ResourceModifiedError):
        return False
    return True


def _champion(container: Any, base: str, blob: str, roots: _Roots, current: bool) -> Moved:
    stored = read_record(container, blob, CHAMPION_BYTES)
    if stored is None:
        return Moved(blob, None, "gone while it was being read")
    parsed = (
        parse_record(stored.data)
        if stored.data and not stored.too_large
        else "empty or larger than a record"
    )
    if isinstance(parsed, str):
        return Moved(blob, None, f"left in place: damaged ({parsed})")
    root, how = roots.choose(parsed.run_id, parsed.root)
    target = champion_blob(base, root) if current else history_blob(base, root, blob_stem(blob))
    if not _copy(container, stored.data, target):
        return Moved(blob, None, f"{how}; {target} exists already: kept as it is")
    return Moved(blob, target, how)


def _last_run(container: Any, base: str, blob: str, roots: _Roots, digest: str | None) -> Moved:
    stored = read_record(container, blob, LAST_RUN_BYTES)
    if stored is None:
        return Moved(blob, None, "gone while it was being read")
    parsed = parse_last_run(stored.data)
    if isinstance(parsed, str):
        return Moved(blob, None, f"left in place: unusable ({parsed})")
    data = parsed.data or {}
    recorded = (
        DataRoot(data["container"], str(data.get("root") or "").strip("/"))
        if isinstance(data.get("container"), str)
        else None
    )
    root, how = roots.choose(parsed.run_id, recorded)
    target = last_run_blob(base, root) if digest is None else trained_blob(base, root, digest)
    if not _copy(container, stored.data, target):
        return Moved(blob, None, f"{how}; {target} exists already: kept as it is")
    return Moved(blob, target, how)


def blob_stem(name: str) -> str:
    return name.rsplit("/", 1)[-1].removesuffix(".json")


def migrate_legacy_records(
    container: Any, base: str, fallback: DataRoot, say: Callable[[str], None]
) -> list[Moved]:
    """Copy the records of the old layout below ``base`` into their data roots' folders, once
    (nothing when ``models/migrated.json`` exists or there is nothing to copy); each record is
    named through ``say``. ``fallback``: the data root of a record that names none."""
    models = records_blob(base, "models/")
    # One listing of the folder's first level: the marker, or nothing of the old layout, ends it.
    from azure.core.exceptions import ResourceNotFoundError

    try:
        top = {b.name for b in container.walk_blobs(name_starts_with=models, delimiter="/")}
    except ResourceNotFoundError:  # no output container yet: no records at all
        return []
    folders = [records_blob(base, f"{f}/") for f in (LEGACY_HISTORY, LEGACY_TRAINED)]
    files = [records_blob(base, f) for f in (LEGACY_CHAMPION, LEGACY_LAST_RUN)]
    if migrated_blob(base) in top or not top & {*folders, *files}:
        return []
    legacy = [name for name in files if name in top]
    for folder in (f for f in folders if f in top):
        legacy += sorted(b.name for b in container.list_blobs(name_starts_with=folder))
    say(
        f"registry: {len(legacy)} records below {models} were kept for the whole output prefix "
        "(before each data root had a champion of its own): copying each into its data root's "
        f"folder once; the originals stay where they are, and {MIGRATED} lists what went where"
    )
    roots = _Roots(container, base, fallback)
    moved: list[Moved] = []
    for name in legacy:
        if name == files[0]:
            moved.append(_champion(container, base, name, roots, current=True))
        elif name == files[1]:
            moved.append(_last_run(container, base, name, roots, None))
        elif name.startswith(folders[1]):
            moved.append(_last_run(container, base, name, roots, blob_stem(name)))
        elif blob_stem(name).startswith("damaged-"):
            moved.append(Moved(name, None, "left in place: a damaged record kept by a promotion"))
        else:
            moved.append(_champion(container, base, name, roots, current=False))
        last = moved[-1]
        say(f"registry: {last.source} -> {last.target or '(not copied)'}: {last.note}")
    record = {
        "migrated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "why": "one champion per data root: records of the whole output prefix copied into "
        "their data roots' folders; the originals are left in place",
        "records": [asdict(m) for m in moved],
    }
    _copy(container, json.dumps(record, indent=2).encode(), migrated_blob(base))
    return moved
