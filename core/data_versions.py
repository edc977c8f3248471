"""Data versions: what a run trains on, the one definition every way a run starts shares.

A **data root** is a container and a prefix (``data.container``, ``data.prefix``). Below it, either

- **versions**: each a folder directly below the root (``<root>/v2/train/<class>/...``), complete
  once its marker ``<root>/<version>/_SUCCESS`` exists. The uploader writes the marker last, so a
  folder without one is still arriving and nothing reads it. Or
- **one dataset** (no marker in any folder below it): the root itself holds the splits
  (``<root>/train/...``, ``<root>/test/...``), as every config did before versions existed. Its
  own ``<root>/_SUCCESS``, when there is one, is not data.

A root never holds both: loose files (a split folder or a file directly below the root) beside
complete versions would leave "which data" without one answer, so it is an error that names both.

A run that names no version trains the newest complete version (the one whose marker was written
last); a run may name one (``data.version``, the ``data_version`` parameter). The manual run and
the nightly choose here; the relay and the sensor report a version when its marker appears and
the run they start names it. The gate validates exactly that version's folder, and staging,
checkpoints, the up-to-date check, the champion comparison and the run's record name it.

This module holds the rules only (no storage client): the listing that feeds them is
``backends.data_root``, below which every layer (gate, tasks, deployments) reaches them.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import Any

from imagedata.images import SPLITS

MARKER = "_SUCCESS"
MAX_VERSION_NAME = 255  # a blob name segment Azure keeps as one folder name


class DataVersionError(ValueError):
    """The data root does not say which data to train: the message names the root, the
    versions and files concerned, and what to do."""


def check_version_name(name: str) -> str:
    """A version is one folder name: no ``/``, ``\\``, ``.``/``..``, control characters, and not
    a split's name (a ``train/`` folder below the root is a dataset's, not a version)."""
    if not name or len(name) > MAX_VERSION_NAME:
        raise ValueError(f"{name!r} is not a version name (1-{MAX_VERSION_NAME} characters)")
    if "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a version name: one folder name, without / or \\")
    if any(not c.isprintable() for c in name):
        raise ValueError(f"{name!r} is not a version name: it has control characters")
    if name in SPLITS or name == MARKER:
        raise ValueError(
            f"{name!r} is not a version name: {name} directly below a data root is part of a "
            "dataset without versions"
        )
    return name


def _valid_version(name: str) -> bool:
    try:
        check_version_name(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class DataRoot:
    """A container and the prefix below which data versions are folders ("" = the container)."""

    container: str
    prefix: str

    def folder(self, version: str | None) -> str:
        """The prefix of a version's files (the root itself for a root without versions)."""
        root = self.prefix.strip("/")
        if not version:
            return root
        return f"{root}/{version}" if root else version

    def marker(self, version: str | None) -> str:
        """The blob that makes ``version`` complete (the root's own for None)."""
        folder = self.folder(version)
        return f"{folder}/{MARKER}" if folder else MARKER

    def holds(self, name: str) -> bool:
        root = self.prefix.strip("/")
        return not root or name.startswith(f"{root}/")

    def version_of_marker(self, name: str) -> str | None:
        """The version ``name`` completes: a version's name, "" for the root's own marker
        (a root without versions that was written whole), None for any other blob (data, or a
        marker deeper down, which completes no version of this root)."""
        if not self.holds(name):
            return None
        root = self.prefix.strip("/")
        rel = name[len(root) + 1 :] if root else name
        parts = rel.split("/")
        if parts == [MARKER]:
            return ""
        if len(parts) == 2 and parts[1] == MARKER and _valid_version(parts[0]):
            return parts[0]
        return None

    @property
    def where(self) -> str:
        return f"{self.container}/{self.prefix.strip('/')}".rstrip("/")


@dataclass(frozen=True)
class Complete:
    """A complete version: its name and its marker."""

    name: str
    etag: str
    # The marker's Last-Modified: when the version became complete. Storage keeps it to the
    # second; markers written in the same second are ordered by the versions' names
    # (:func:`in_completion_order`).
    completed_at: datetime


@dataclass(frozen=True)
class Survey:
    """What lies directly below a data root (``backends.data_root.survey`` lists it)."""

    root: DataRoot
    files: list[str]  # names of the blobs directly below the root (its own marker included)
    splits: list[str]  # split folders directly below it: train, val, test
    complete: list[Complete]
    incomplete: list[str]  # other folders, without a marker (still arriving)
    root_marker_etag: str | None = None


@dataclass(frozen=True)
class DataVersion:
    """The data one run trains on: a complete version below the root, or the whole root when it
    holds no versions. Stored in the run's record and shown in its summary and in ``list``."""

    container: str
    root: str
    version: str | None  # None: the root holds one dataset and no versions
    marker_etag: str | None  # of the marker that completed it (None: a root without one)
    completed_at: str | None  # ISO 8601: when its marker was written
    chosen: str  # why this one: named by the run, the newest of N, a root without versions

    @property
    def prefix(self) -> str:
        """Where its files are: the gate lists this, staging mirrors it."""
        return DataRoot(self.container, self.root).folder(self.version)

    @property
    def label(self) -> str:
        """A short name for tables: the version, or the root for a root without versions."""
        return self.version if self.version else f"{self.root or '(container)'} (no versions)"

    def describe(self) -> str:
        where = DataRoot(self.container, self.root).where
        if self.version is None:
            return f"{where}, a data root without versions"
        return f"version {self.version} of {where}"

    def as_record(self) -> dict[str, Any]:
        return {**asdict(self), "prefix": self.prefix}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> DataVersion:
        """The version an ``as_record`` stored (a run's result, its record)."""
        values: dict[str, Any] = {f.name: record.get(f.name) for f in fields(cls)}
        return cls(**values)


def _names(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


_NUMBER = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[Any, ...]:
    """A version name as people number versions: its runs of digits compared as numbers, so
    v10 comes after v9 and 2024-1-10 after 2024-1-9 (as text, "v9" > "v10"). The text itself
    breaks the last ties (v01 and v1)."""
    parts = _NUMBER.split(name)  # text, number, text, ...: the kinds line up between names
    return (tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name)


def in_completion_order(complete: list[Complete]) -> list[Complete]:
    """Complete versions, the one completed first first: by their markers' times, and those of
    one second (storage keeps no finer time) by :func:`natural_key`. The one order every
    chooser of "the newest" uses: the runs, the sensor and the messages that list versions."""
    return sorted(complete, key=lambda c: (c.completed_at, natural_key(c.name)))


def _newest(complete: list[Complete]) -> Complete:
    return in_completion_order(complete)[-1]


def loose_files(survey: Survey) -> list[str]:
    """What lies directly below the root outside any version: split folders and files (the
    root's own marker is none of them)."""
    own = survey.root.marker(None)
    return [f"{s}/" for s in survey.splits] + [f for f in survey.files if f != own]


def refuse_mixed(survey: Survey) -> None:
    """DataVersionError when loose files and complete versions share the root, naming both
    and saying how to move the loose files into a version."""
    root, loose = survey.root, loose_files(survey)
    complete = in_completion_order(survey.complete)
    versions = [c.name for c in complete]
    if not (complete and loose):
        return
    taken = versions + survey.incomplete
    new = next((n for n in ("v0", "loose", "loose-0") if n not in taken), "<version>")
    below = f"{root.folder(None)}/" if root.folder(None) else ""
    raise DataVersionError(
        f"data root {root.where} holds both loose files ({_names(loose)}) and data versions "
        f"({_names(versions)}): a run cannot tell which to train. Move the loose files into a "
        f"version of their own (e.g. {root.folder(new)}/train/... for {below}train/...), "
        f"write its marker {root.marker(new)} last, then delete the loose copies; or move "
        f"the versions (such as {root.folder(versions[-1])}) to a data root of their own"
    )


def choose(survey: Survey, requested: str | None) -> DataVersion:
    """The data a run trains: ``requested`` (a version name), else the newest complete version,
    else the whole root when it holds no versions. DataVersionError says why none can be."""
    refuse_mixed(survey)
    root = survey.root
    where = root.where
    loose = loose_files(survey)
    complete = in_completion_order(survey.complete)
    versions = [c.name for c in complete]
    if requested:
        found = next((c for c in complete if c.name == requested), None)
        if found is not None:
            return DataVersion(
                root.container,
                root.prefix,
                found.name,
                found.etag,
                found.completed_at.isoformat(),
                "named by the run",
            )
        if requested in survey.incomplete:
            raise DataVersionError(
                f"data version {requested} of {where} is not complete: {root.marker(requested)} "
                "does not exist (it is written last, once every file of the version is uploaded)"
            )
        if not complete:
            raise DataVersionError(
                f"data version {requested} was asked for, but {where} holds no versions "
                f"(no {root.marker('<version>')} exists): leave the data version empty to train "
                "the root as one dataset"
            )
        raise DataVersionError(
            f"no data version {requested} in {where}: its complete versions are "
            f"{_names(versions[::-1])} (newest first)"
        )
    if complete:
        newest = _newest(complete)
        many = len(complete)
        return DataVersion(
            root.container,
            root.prefix,
            newest.name,
            newest.etag,
            newest.completed_at.isoformat(),
            "the only complete version" if many == 1 else f"the newest of {many} complete versions",
        )
    if loose:
        return DataVersion(
            root.container,
            root.prefix,
            None,
            survey.root_marker_etag,
            None,
            "a data root without versions: trained whole",
        )
    if survey.incomplete:
        raise DataVersionError(
            f"data root {where} holds folders ({_names(survey.incomplete)}) but no complete "
            f"version and no dataset: a version is complete once {root.marker('<version>')} is "
            "written (write it last); a root without versions holds train/ and test/ directly"
        )
    raise DataVersionError(f"data root {where} is empty: no version and no file below it")
