"""The gate's manifest: one row per blob under the data prefix, from the listing plus one small
ranged read per image (enough for the header, and usually the whole file).

So the gate costs seconds, and no GPU is provisioned and no data copied, for a dataset that
would fail. What each read found is kept in the work folder by blob name and ETag (a blob's ETag
changes with its content), so a nightly run over unchanged data lists the container and reads
nothing: per-request cost, not bandwidth, is what a gate over many small images pays.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from backends.blob import container_client, folder
from backends.listing import PinnedBlob, pin
from core.config import BlobLocation
from training.atomic import atomic_write, read_json_object
from training.images import SPLITS, is_image_name, open_image

HEADER_BYTES = 64 * 1024
# Written last by an uploader, directly under the version's prefix; the relay and the sensor
# wait for it. It is the one blob that is neither validated nor staged.
COMPLETION_MARKER = "_SUCCESS"
# Bumped when what a row says about an image changes, so cached rows of older rules are not
# reused (2: only PNG and JPEG, by name and content, are readable).
DESCRIBE_VERSION = 2


def list_dataset(location: BlobLocation, retries: int = 3) -> list[PinnedBlob]:
    """Every blob under the prefix but the completion marker, as the gate validates it and
    staging stages it (a name starting with ``_`` elsewhere is data like any other)."""
    container = container_client(location, retries)
    prefix = location.prefix
    marker = f"{prefix}/{COMPLETION_MARKER}" if prefix else COMPLETION_MARKER
    return [
        pin(b) for b in container.list_blobs(name_starts_with=folder(prefix)) if b.name != marker
    ]


def _describe_image(container: Any, blob: PinnedBlob, prefix: str) -> dict[str, Any]:
    rel = blob.name[len(prefix) + 1 :] if prefix else blob.name
    parts = rel.split("/")
    row: dict[str, Any] = {
        "path": rel,
        "split": parts[0] if len(parts) == 3 else None,
        "label": parts[1] if len(parts) == 3 else None,
        "bytes": blob.size,
        "width": None,
        "height": None,
        "channels": None,
        "readable": False,
        "md5": blob.md5,
    }
    if blob.size == 0 or not is_image_name(rel):  # the trainer reads only .png/.jpg/.jpeg
        return row
    head = container.download_blob(
        blob.name, offset=0, length=min(blob.size, HEADER_BYTES)
    ).readall()
    if row["md5"] is None and len(head) == blob.size:
        row["md5"] = base64.b64encode(hashlib.md5(head, usedforsecurity=False).digest()).decode()
    try:
        with open_image(io.BytesIO(head)) as image:
            row.update(
                width=image.width,
                height=image.height,
                channels=len(image.getbands()),
                readable=True,
            )
    except Exception:  # PIL raises many types for garbage; the gate reports them as unreadable
        pass
    return row


def cache_path(location: BlobLocation, cache_dir: Path) -> Path:
    """The cache file of one data location (account, container, prefix) under ``cache_dir``."""
    where = (
        f"{DESCRIBE_VERSION}|{location.account_url or ''}|{location.container}|{location.prefix}"
    )
    key = hashlib.sha256(where.encode()).hexdigest()[:16]
    return cache_dir / f"{location.container}-{key}.json"


def _flag_leaks(rows: list[dict[str, Any]]) -> None:
    """``leak``: the same content (by MD5) in train and in test or val."""
    by_split: dict[str, set[str]] = {}
    for row in rows:
        if row["md5"]:
            by_split.setdefault(row["split"] or "", set()).add(row["md5"])
    train = by_split.get("train", set())
    test = by_split.get("test", set()) | by_split.get("val", set())
    for row in rows:
        row["leak"] = bool(row["md5"]) and row["md5"] in train and row["md5"] in test


def build_manifest(
    location: BlobLocation,
    cache_dir: Path,
    retries: int = 3,
    blobs: list[PinnedBlob] | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """One row per blob (``blobs``, default: :func:`list_dataset`), and how many rows came
    from the cache (unchanged blobs)."""
    container = container_client(location, retries)
    if blobs is None:
        blobs = list_dataset(location, retries)
    cache_file = cache_path(location, cache_dir)
    cache = read_json_object(cache_file) or {}  # none usable: every image is read again

    def describe(blob: PinnedBlob) -> tuple[dict[str, Any], bool]:
        """The blob's row, and whether it came from the cache (same name, same ETag)."""
        hit = cache.get(blob.name)
        if (
            isinstance(hit, dict)
            and hit.get("etag") == blob.etag
            and isinstance(hit.get("row"), dict)
        ):
            return dict(hit["row"]), True
        return _describe_image(container, blob, location.prefix), False

    with ThreadPoolExecutor(max_workers=16) as pool:
        described = list(pool.map(describe, blobs))
    rows = [row for row, _ in described]
    reused = sum(1 for _, from_cache in described if from_cache)
    entries = {b.name: {"etag": b.etag, "row": row} for b, row in zip(blobs, rows, strict=True)}
    atomic_write(
        cache_file, lambda fh: fh.write(json.dumps(entries, separators=(",", ":")).encode())
    )
    _flag_leaks(rows)
    return rows, reused


def class_counts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Images per class and split: the rows of the gate's second table."""
    labels = sorted({r["label"] for r in rows if r["label"]})
    counts = []
    for label in labels:
        per = {s: sum(1 for r in rows if r["label"] == label and r["split"] == s) for s in SPLITS}
        counts.append({"label": label, **{f"{s}_images": n for s, n in per.items()}})
    return counts
