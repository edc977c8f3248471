"""The champion of a data root: which model serves it, and the history of promotions beside it.

**The one reader of champion records** is ``champion_for(container, base, root)``: every part
of the pipeline that asks "which model serves this data root" (a promotion, the up-to-date
summary, ``cli.models list`` and ``download``, ``label-images``) asks it, so a field added to
the record is read in one place.

``<output prefix>/models/datasets/<data root>/champion.json`` (``registry.layout``) is one flat
record (run, the scores it was promoted on, model blob, the data root and version, time),
replaced with an ETag condition so two runs finishing together cannot both win. A champion
belongs to one data root (``data.container`` + ``data.prefix``): a run over another root never
reads or replaces it, whatever output prefix the two share. It never embeds earlier records:
each promotion also writes its own record under the root's ``history/``, so the champion stays
small after any number of promotions and the history is one listing away.

A stored record that cannot be used (empty, not JSON, not an object, ``{}``, wrong types, a
metric that is not a finite number in [0, 1], nested too deep to read, another root's record)
is reported as damaged with the reason, never taken for "no champion" and never a crash; when a
promotion replaces it, its bytes are first kept under ``history/`` so nothing stored is lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from core.data_versions import DataRoot
from registry.layout import champion_blob, damaged_blob, history_blob, is_model_blob
from registry.metrics import METRICS
from registry.record_blob import fraction, json_object, read_record, shown

# A flat record is a few hundred bytes, and a few KB with the recall of many classes. A record
# from before the history folder nested every earlier champion (about 5 KB per promotion): up to
# this size it is still read.
MAX_RECORD_BYTES = 8 << 20


@dataclass(frozen=True)
class Champion:
    """A valid champion record."""

    run_id: str
    metric: str  # what the promotion decided on (promotion.metric)
    value: float  # its value on the test split of ``data_version``
    model: str  # blob in the output container
    data_version: str | None  # of the data it was scored on; None in records from before
    promoted_at: str
    data: str | None = None  # the data version it was trained on (container/prefix)
    root: DataRoot | None = None  # whose champion it is; None in records from before
    scores: dict[str, float] = field(default_factory=dict)  # every metric it was scored on
    classes: tuple[str, ...] | None = None  # the model's classes; None in records from before
    recall: dict[str, float] | None = None  # each class's recall on that test split

    def score(self, metric: str) -> float | None:
        """Its recorded value of ``metric`` (None when the record has none)."""
        return self.value if metric == self.metric else self.scores.get(metric)

    def as_record(self) -> dict[str, Any]:
        """The stored form: each metric under its own name, as the scorer's report has it."""
        return {
            "run_id": self.run_id,
            "model": self.model,
            "data_root": (
                {"container": self.root.container, "prefix": self.root.prefix}
                if self.root
                else None
            ),
            "data": self.data,
            "data_version": self.data_version,
            "promoted_at": self.promoted_at,
            "metric": self.metric,
            **self.scores,
            self.metric: self.value,
            "classes": list(self.classes) if self.classes is not None else None,
            "recall": self.recall,
        }


@dataclass(frozen=True)
class ChampionRead:
    """What a data root's ``champion.json`` holds now: a champion, nothing, or a damaged record."""

    champion: Champion | None
    etag: str | None  # of the stored blob, for the conditional replace; None when absent
    damaged: str | None = None  # why the stored record cannot be used
    raw: bytes | None = None  # the stored bytes, kept when a damaged record is replaced
    blob: str = ""  # where it is
    root: DataRoot | None = None  # whose champion it is

    @property
    def state(self) -> str:
        if self.damaged:
            return "damaged"
        return "valid" if self.champion else "absent"


def _number(record: dict[str, Any], name: str) -> float | str:
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{name} is {shown(value)}, not a number"
    number = fraction(value)
    if number is None:
        return f"{name} is {shown(value)}, not a finite number in [0, 1]"
    return number


def _root(value: Any) -> DataRoot | str | None:
    if value is None:
        return None
    if (
        isinstance(value, dict)
        and isinstance(value.get("container"), str)
        and isinstance(value.get("prefix"), str)
    ):
        return DataRoot(value["container"], value["prefix"].strip("/"))
    return f"data_root is {shown(value)}, not a container and a prefix"


def _classes(
    record: dict[str, Any],
) -> tuple[tuple[str, ...] | None, dict[str, float] | None] | str:
    classes, recall = record.get("classes"), record.get("recall")
    if classes is not None and not (
        isinstance(classes, list) and all(isinstance(c, str) for c in classes)
    ):
        return f"classes is {shown(classes)}, not a list of class names"
    if recall is not None and not (
        isinstance(recall, dict)
        and all(isinstance(k, str) and fraction(v) is not None for k, v in recall.items())
    ):
        return f"recall is {shown(recall)}, not each class's recall in [0, 1]"
    return (
        tuple(classes) if classes is not None else None,
        {k: float(v) for k, v in recall.items()} if recall is not None else None,
    )


def parse_record(data: bytes) -> Champion | str:
    """The champion in ``data``, or a sentence saying why it is not one. Every record ever
    written holds the test accuracy (the scorer always reports it), whatever metric decided."""
    record = json_object(data, MAX_RECORD_BYTES)
    if isinstance(record, str):
        return record
    missing = [k for k in ("run_id", "accuracy", "model") if k not in record]
    if missing:
        return f"lacks {', '.join(missing)}"
    metric = record.get("metric", "accuracy")
    if metric not in METRICS:
        return f"metric is {shown(metric)}, not one of {', '.join(METRICS)}"
    if metric not in record:
        return f"lacks {metric}, the metric it names"
    scores: dict[str, float] = {}
    for name in (n for n in METRICS if n in record):
        number = _number(record, name)
        if isinstance(number, str):
            return number
        scores[name] = number
    run_id, model, version = record["run_id"], record["model"], record.get("data_version")
    if not isinstance(run_id, str) or not run_id:
        return f"run_id is {shown(run_id)}, not a run id"
    if not is_model_blob(model):
        return f"model is {shown(model)}, not a model blob name"
    if version is not None and not isinstance(version, str):
        return f"data_version is {shown(version)}, not a version"
    root = _root(record.get("data_root"))
    if isinstance(root, str):
        return root
    classes = _classes(record)
    if isinstance(classes, str):
        return classes
    promoted_at, trained_on = record.get("promoted_at"), record.get("data")
    value = scores.pop(metric)
    return Champion(
        run_id,
        metric,
        value,
        model,
        version,
        promoted_at if isinstance(promoted_at, str) else "",
        trained_on if isinstance(trained_on, str) else None,
        root,
        scores,
        *classes,
    )


def read_champion_blob(container: Any, blob: str, root: DataRoot | None = None) -> ChampionRead:
    """The champion record stored at ``blob``; a record naming another data root than ``root``
    is damaged (it was copied there by hand: serving it would label one dataset with another's
    classes)."""
    stored = read_record(container, blob, MAX_RECORD_BYTES)
    if stored is None:
        return ChampionRead(None, None, blob=blob, root=root)
    if stored.too_large:
        why = f"more than a record holds ({MAX_RECORD_BYTES} bytes)"
        return ChampionRead(None, stored.etag, why, blob=blob, root=root)
    parsed = parse_record(stored.data) if stored.data else "empty (0 bytes)"
    if isinstance(parsed, Champion) and root and parsed.root and parsed.root != root:
        parsed = f"it is the champion of data root {parsed.root.where}, not of {root.where}"
    if isinstance(parsed, str):
        return ChampionRead(None, stored.etag, parsed, stored.data, blob, root)
    return ChampionRead(parsed, stored.etag, blob=blob, root=root)


def champion_for(container: Any, base: str, root: DataRoot) -> ChampionRead:
    """The champion of the data root ``root`` (``data.container`` + ``data.prefix``) among the
    records below the output prefix ``base``: the model that serves that dataset."""
    return read_champion_blob(container, champion_blob(base, root), root)


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y%m%dT%H%M%S%fZ")


def replace_champion(
    container: Any, base: str, root: DataRoot, new: Champion, before: ChampionRead
) -> str | None:
    """Make ``new`` the champion of ``root`` if the stored record is still ``before``; returns
    the blob a damaged record was kept as (None if there was none), or raises
    ``ChampionMovedError`` when another run replaced it meanwhile."""
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError

    kept = None
    if before.damaged:
        kept = damaged_blob(base, root, _stamp(datetime.now(UTC)))
        container.upload_blob(kept, before.raw or b"", overwrite=True)
    condition = (
        {"etag": before.etag, "match_condition": MatchConditions.IfNotModified}
        if before.etag
        else {"match_condition": MatchConditions.IfMissing}
    )
    record = json.dumps(new.as_record(), indent=2)
    blob = champion_blob(base, root)
    try:
        container.upload_blob(blob, record, overwrite=True, **condition)
    except (ResourceModifiedError, ResourceExistsError):
        if kept:
            container.delete_blob(kept)  # the record it keeps is still the champion
        raise ChampionMovedError(blob) from None
    # One record per promotion; run ids start with their UTC time, so the names sort in the
    # order of the promotions.
    container.upload_blob(history_blob(base, root, new.run_id), record, overwrite=True)
    return kept


class ChampionMovedError(RuntimeError):
    """Another run replaced the champion between this run's read and its replace."""
