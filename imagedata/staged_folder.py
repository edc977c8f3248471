"""What a staged data folder holds besides the data: the staging manifest, and the names that
staging and the packed shards reserve. One owner for the format: staging writes the manifest,
the shard packer and the trainer read it.

The manifest (``.staging-manifest.json``) maps each staged blob to the file it became::

    {"prefix": "images/v2", "data_version": "<16 hex>", "syncs": 12, "boot": "<boot id>",
     "flush_failed": true,   # a flush under ``boot`` reported a write error: marks stay
     "files": {"<blob name>": {"path": "<relative path>", "etag": ..., "size": ..., "md5": ...,
                               "stat": [mtime_ns, ctime_ns, inode], "unflushed": true}},
     "stale": {...}}   # written by earlier versions (files yet to delete): read, not written

``data_version`` names the content, not the time: the same bytes under the same names give the
same version. ``stat`` is the file's status right after staging renamed it into place: a later
sync that finds the same size, times and inode trusts the file without reading it (the change
time cannot be set by a program, so a rewrite that keeps the modification time still shows).
``syncs`` counts the syncs, which take turns re-reading a slice of the files (see
``staging.sync``). ``unflushed`` marks a file written to a local disk and not flushed: its
status vouches for it only under ``boot``, the boot of the machine that wrote the manifest (see
``staging.durability``). Kept free of heavy imports (no torch): the staging task on a node
imports it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from common.atomic import atomic_write, read_json_object

MANIFEST = ".staging-manifest.json"
TEMP_PREFIX = ".staging-"  # a download in progress: ``.staging-<token>-<n>.part`` by its target
SHARD_DIR = ".shards"  # the packed shards (imagedata.shards) live here
INDEX = "index.json"  # in SHARD_DIR: the pack's commit point, written last
# 2: rows decoded by what the pixels mean (imagedata.images.to_rgb: EXIF orientation, 16-bit
# scaled, transparency composited); rows of format 1 are neither reused nor read.
PACK_FORMAT = 2


@dataclass
class PackReport:
    """What a pack did (``imagedata.shards``)."""

    action: str  # packed | unchanged | not packed
    reason: str = ""
    images: int = 0
    decoded: int = 0
    reused: int = 0
    skipped: int = 0
    shards: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def pack_is_current(index: dict[str, Any] | None, version: str, image_size: int) -> bool:
    """Whether the pack ``index`` describes holds data version ``version`` at ``image_size``."""
    return bool(
        index
        and index.get("format") == PACK_FORMAT
        and index.get("version") == version
        and index.get("image_size") == image_size
    )


def unchanged_pack(index: dict[str, Any]) -> PackReport:
    return PackReport("unchanged", images=sum(s["count"] for s in index["splits"].values()))


def current_pack(root: Path, image_size: int, version: str) -> PackReport | None:
    """The report of a pack already current for ``version`` (a staged folder's manifest
    version, when the manifest vouches for every file in it, as after a sync), or None when
    it must be checked and maybe packed. Read without importing the packer (torch): a
    re-sync that changed nothing pays for neither."""
    index = _read(root / SHARD_DIR, INDEX)
    if not pack_is_current(index, version, image_size):
        return None
    assert index is not None
    try:
        return unchanged_pack(index)
    except (AttributeError, KeyError, TypeError):  # a damaged index: the packer decides
        return None


def data_version(files: dict[str, dict[str, Any]]) -> str:
    """The version of a set of staged files: a digest of every name, MD5 and size."""
    return hashlib.sha256(
        json.dumps(sorted((n, f["md5"], f["size"]) for n, f in files.items())).encode()
    ).hexdigest()[:16]


def _read(dest: Path, name: str = MANIFEST) -> dict[str, Any] | None:
    try:
        return read_json_object(dest / name)
    except NotADirectoryError:  # the destination is a file: nothing was staged there
        return None


class PreviousSync(NamedTuple):
    """What the last sync left: blob name -> entry, the sync count, the boot the manifest was
    written under, and whether a flush under that boot reported a write error."""

    entries: dict[str, dict[str, Any]]
    syncs: int
    boot: str | None
    flush_failed: bool


def previous_sync(dest: Path) -> PreviousSync:
    """What the last sync left in ``dest``: blob name -> entry of every file it wrote, stale
    ones it had yet to delete included (a sync deletes them unless a blob lands on their path
    again), how many syncs the manifest has seen, and the boot it was written under. One read
    of the manifest for all of them (it holds an entry per file). An unusable manifest reads as
    empty, and one written before the status record and the sync count (no ``stat``, no
    ``syncs``) as zero syncs whose files have no status to trust: every file is then checked
    again, nothing is lost."""
    data = _read(dest) or {}
    entries: dict[str, Any] = {}
    for section in ("stale", "files"):  # a live entry wins over a stale one of the same name
        part = data.get(section)
        if isinstance(part, dict):
            entries.update(part)
    count = data.get("syncs")
    syncs = count if type(count) is int and count >= 0 else 0
    boot = data.get("boot") if isinstance(data.get("boot"), str) else None
    live = {n: e for n, e in entries.items() if isinstance(e, dict) and "path" in e}
    return PreviousSync(live, syncs, boot, data.get("flush_failed") is True)


def write_manifest(
    dest: Path,
    prefix: str,
    files: dict[str, dict[str, Any]],
    syncs: int = 0,
    boot: str | None = None,
    flush_failed: bool = False,
) -> str:
    """Write the manifest of ``files`` atomically; returns its data version. ``boot``: the boot
    its unflushed files are trusted under; ``flush_failed``: a flush under that boot reported
    a write error."""
    version = data_version(files)
    manifest: dict[str, Any] = {
        "prefix": prefix,
        "data_version": version,
        "syncs": syncs,
        "files": files,
    }
    if boot:
        manifest["boot"] = boot
    if flush_failed:
        manifest["flush_failed"] = True
    text = json.dumps(manifest, separators=(",", ":")).encode()  # compact: one entry per file
    atomic_write(dest / MANIFEST, lambda fh: fh.write(text))
    return version


def staged_md5s(root: Path) -> tuple[str | None, dict[str, str]]:
    """The manifest's data version and each staged file's MD5 by relative path, or
    ``(None, {})`` when the folder was not staged."""
    manifest = _read(root)
    if not manifest or not manifest.get("data_version"):
        return None, {}
    files = manifest.get("files")
    if not isinstance(files, dict):
        return None, {}
    md5s = {
        str(f["path"]): str(f["md5"])
        for f in files.values()
        if isinstance(f, dict) and f.get("md5") and "path" in f
    }
    return str(manifest["data_version"]), md5s
