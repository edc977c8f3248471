"""The champion record: which model serves, and the history of promotions beside it.

``<output prefix>/models/champion.json`` is one flat record (run, metric value, model blob, data
version and where it is, time), replaced with an ETag condition so two runs finishing together
cannot both win. It never embeds earlier records: each promotion also writes its own record
under ``models/history/``, so the champion stays a few hundred bytes after any number of
promotions and the history is one listing away.

A stored record that cannot be used (empty, not JSON, not an object, ``{}``, wrong types, a
metric that is not a finite number in [0, 1], nested too deep to read) is reported as damaged with
the reason, never taken for "no champion" and never a crash; when a promotion replaces it, its
bytes are first kept under ``models/history/`` so nothing stored is lost.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from registry.layout import champion_blob, damaged_blob, is_model_blob
from registry.layout import history_blob as _history_blob
from registry.record_blob import fraction, json_object, read_record, shown

# A flat record is well under 1 KB. A record from before the history folder nested every
# earlier champion (about 5 KB per promotion): up to this size it is still read.
MAX_RECORD_BYTES = 8 << 20


@dataclass(frozen=True)
class Champion:
    """A valid champion record."""

    run_id: str
    metric: str
    value: float
    model: str  # blob in the output container
    data_version: str | None  # of the data it was scored on; None in records from before
    promoted_at: str
    data: str | None = None  # the data version it was trained on (container/prefix)

    def as_record(self) -> dict[str, Any]:
        """The stored form: the metric under its own name, as the run's score has it."""
        record = asdict(self)
        record[record.pop("metric")] = record.pop("value")
        return record


@dataclass(frozen=True)
class ChampionRead:
    """What ``models/champion.json`` holds now: a champion, nothing, or a damaged record."""

    champion: Champion | None
    etag: str | None  # of the stored blob, for the conditional replace; None when absent
    damaged: str | None = None  # why the stored record cannot be used
    raw: bytes | None = None  # the stored bytes, kept when a damaged record is replaced

    @property
    def state(self) -> str:
        if self.damaged:
            return "damaged"
        return "valid" if self.champion else "absent"


def parse_record(data: bytes, metric: str) -> Champion | str:
    """The champion in ``data``, or a sentence saying why it is not one."""
    record = json_object(data, MAX_RECORD_BYTES)
    if isinstance(record, str):
        return record
    missing = [k for k in ("run_id", metric, "model") if k not in record]
    if missing:
        return f"lacks {', '.join(missing)}"
    value = record[metric]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{metric} is {shown(value)}, not a number"
    number = fraction(value)
    if number is None:
        return f"{metric} is {shown(value)}, not a finite number in [0, 1]"
    run_id, model, version = record["run_id"], record["model"], record.get("data_version")
    if not isinstance(run_id, str) or not run_id:
        return f"run_id is {shown(run_id)}, not a run id"
    if not is_model_blob(model):
        return f"model is {shown(model)}, not a model blob name"
    if version is not None and not isinstance(version, str):
        return f"data_version is {shown(version)}, not a version"
    promoted_at, trained_on = record.get("promoted_at"), record.get("data")
    return Champion(
        run_id,
        metric,
        number,
        model,
        version,
        promoted_at if isinstance(promoted_at, str) else "",
        trained_on if isinstance(trained_on, str) else None,
    )


def read_champion(container: Any, base: str, metric: str) -> ChampionRead:
    stored = read_record(container, champion_blob(base), MAX_RECORD_BYTES)
    if stored is None:
        return ChampionRead(None, None)
    if stored.too_large:
        return ChampionRead(
            None, stored.etag, f"more than a record holds ({MAX_RECORD_BYTES} bytes)"
        )
    parsed = parse_record(stored.data, metric) if stored.data else "empty (0 bytes)"
    if isinstance(parsed, str):
        return ChampionRead(None, stored.etag, parsed, stored.data)
    return ChampionRead(parsed, stored.etag)


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y%m%dT%H%M%S%fZ")


def replace_champion(container: Any, base: str, new: Champion, before: ChampionRead) -> str | None:
    """Make ``new`` the champion if the stored record is still ``before``; returns the blob
    a damaged record was kept as (None if there was none), or raises ``ChampionMovedError``
    when another run replaced it meanwhile."""
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError

    kept = None
    if before.damaged:
        kept = damaged_blob(base, _stamp(datetime.now(UTC)))
        container.upload_blob(kept, before.raw or b"", overwrite=True)
    condition = (
        {"etag": before.etag, "match_condition": MatchConditions.IfNotModified}
        if before.etag
        else {"match_condition": MatchConditions.IfMissing}
    )
    record = json.dumps(new.as_record(), indent=2)
    try:
        container.upload_blob(champion_blob(base), record, overwrite=True, **condition)
    except (ResourceModifiedError, ResourceExistsError):
        if kept:
            container.delete_blob(kept)  # the record it keeps is still the champion
        raise ChampionMovedError(champion_blob(base)) from None
    container.upload_blob(history_blob(base, new), record, overwrite=True)
    return kept


def history_blob(base: str, champion: Champion) -> str:
    """One record per promotion; run ids start with their UTC time, so the names sort in
    the order of the promotions."""
    return _history_blob(base, champion.run_id)


class ChampionMovedError(RuntimeError):
    """Another run replaced the champion between this run's read and its replace."""
