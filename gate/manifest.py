"""The gate's manifest: one row per blob under the data prefix, from the listing plus one read
of each image, decoded whole as the trainer will decode it (``imagedata.images.to_rgb``).

So the gate costs seconds, and no GPU is provisioned and no data copied, for a dataset that
would fail. "Readable" means decodable: a header alone says nothing about the pixels (a PNG
cut short passes a header read, and the scorer then skips it), and the width and height are
the picture's, after its EXIF orientation (a phone photo's stored pixels are its sensor's,
turned).

What each read found is kept in the work folder by content: the blob's Content-MD5 and size
from the listing (by name and ETag for a blob stored without an MD5). A nightly run over
unchanged data lists the container and reads nothing, and a new version under a new prefix (the
trigger's layout) reads and decodes only the images whose content is new: each image is read
once, whatever the number of runs and versions that hold it. Reusing a row by MD5 is sound
because staging checks every byte it stages against that same MD5.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeGuard

from backends.blob import container_client
from common.atomic import atomic_write, b64md5, read_json_object
from core.config import BlobLocation
from core.data_versions import MARKER
from gate.deadline import GateTimeoutError, read_within
from imagedata.class_names import name_problem, normal, shown
from imagedata.images import (
    MAX_IMAGE_BYTES,
    SPLITS,
    ImageTooLarge,
    is_image_name,
    open_image,
    to_rgb,
)
from imagedata.webdataset import ShardError, is_tar_name, open_shard, read_samples
from staging.blob import list_pinned, paused_gc
from staging.listing import PinnedBlob

# Bumped when what a row says about an image changes, so cached rows of older rules are not
# reused (2: only PNG and JPEG, by name and content, are readable; 3: rows kept by content;
# 4: readable means decoded whole, width and height after the EXIF orientation; 5: a shard's
# labels in NFC, refused rather than stripped, hostile member headers refused; 6: an image
# over imagedata.images.MAX_PIXELS is refused by its header, never decoded, and one over
# MAX_IMAGE_BYTES by its listed size, never read).
DESCRIBE_VERSION = 6
# What a cached row holds: what the image's bytes say, nothing that depends on its name.
CONTENT_FIELDS = ("width", "height", "channels", "readable", "md5")


def list_dataset(location: BlobLocation, retries: int = 3) -> list[PinnedBlob]:
    """Every blob under the prefix (a data version's folder, or a root without versions) but
    its completion marker, as the gate validates it and staging stages it (a name starting with
    ``_`` elsewhere is data like any other)."""
    container = container_client(location, retries)
    prefix = location.prefix
    marker = f"{prefix}/{MARKER}" if prefix else MARKER
    return [b for b in list_pinned(container, prefix) if b.name != marker]


def _path_fields(rel: str, size: int) -> dict[str, Any]:
    """What a row says from the blob's path below the prefix and its size alone."""
    parts = rel.split("/")
    return {
        "path": rel,
        "split": parts[0] if len(parts) == 3 else None,
        "label": parts[1] if len(parts) == 3 else None,
        "bytes": int(size),
        "problem": None,
    }


class BlobChangedError(RuntimeError):
    """A blob was rewritten between the listing the gate pinned and its read of it; the
    message names it. What the gate read would be filed under the listing's MD5."""


def _download(container: Any, blob: PinnedBlob) -> Any:
    """The blob's content as the listing pinned it: read only while its ETag is the listed
    one (as staging reads), so a producer rewriting it mid-gate never files other bytes under
    the listed MD5 in the cache."""
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceModifiedError

    try:
        return container.download_blob(
            blob.name, etag=blob.etag, match_condition=MatchConditions.IfNotModified
        )
    except ResourceModifiedError:
        raise BlobChangedError(
            f"blob {blob.name} changed while the gate read it (its ETag is no longer the "
            f"listed {blob.etag}): run again once its upload has finished"
        ) from None


def _content(container: Any, blob: PinnedBlob, rel: str) -> dict[str, Any]:
    """What the blob's bytes say (:data:`CONTENT_FIELDS`): one read of the whole image, decoded
    as the trainer decodes it."""
    if blob.size == 0 or not is_image_name(rel):  # the trainer reads only .png/.jpg/.jpeg
        return {**_UNREAD, "md5": blob.md5}
    if blob.size > MAX_IMAGE_BYTES:  # unreadable by its listed size: never downloaded
        return {**_UNREAD, "md5": blob.md5}
    return _decoded(_download(container, blob).readall(), blob.md5)


_UNREAD: dict[str, Any] = {
    "width": None,
    "height": None,
    "channels": None,
    "readable": False,
    "md5": None,
}


def _decoded(data: bytes, md5: str | None) -> dict[str, Any]:
    """:data:`CONTENT_FIELDS` of an image's bytes. ``channels``: the bands the file stores (the
    model gets RGB)."""
    if md5 is None:
        md5 = b64md5(hashlib.md5(data, usedforsecurity=False))
    row = {**_UNREAD, "md5": md5}
    if not data:
        return row
    try:
        with open_image(io.BytesIO(data)) as image:
            channels = len(image.getbands())
            picture = to_rgb(image)  # every pixel decoded: a cut or corrupt file fails here
        row.update(width=picture.width, height=picture.height, channels=channels, readable=True)
    except ImageTooLarge as exc:  # refused by its header: its size fails the side rule too
        row.update(width=exc.width, height=exc.height)
    except Exception:  # PIL raises many types for garbage; the gate reports them as unreadable
        pass
    return row


SHARD = "the shard"  # how a shard's own errors name it: its rows carry its path

# What a cached tar shard holds: a row per sample, its content and where it sits in the shard.
SAMPLE_FIELDS = ("name", "label", "bytes", *CONTENT_FIELDS)


def shard_samples(fh: IO[bytes], describe: Callable[[bytes], dict[str, Any]]) -> dict[str, Any]:
    """A WebDataset shard's samples, each its name, label and size with what ``describe`` says
    of its bytes; or ``error``: why it cannot be read as samples (``imagedata.webdataset``'s
    rules, the trainer's). The gate and the folder check before an upload read shards alike."""
    try:
        with open_shard(None, fh) as tar:
            found = []
            for sample in read_samples(tar, SHARD):
                handle = tar.extractfile(sample.image)
                data = handle.read() if handle else b""
                found.append(
                    {
                        "name": sample.image.name,
                        "label": sample.label,
                        "bytes": sample.image.size,
                        **describe(data),
                    }
                )
    except (ShardError, OSError) as exc:
        # Kept by content, so no name in it: the row under the shard's path says where.
        return {"error": str(exc).removeprefix(f"{SHARD}: ")}
    return {"samples": found}


def _shard_samples(container: Any, blob: PinnedBlob) -> dict[str, Any]:
    """A WebDataset shard's samples (:data:`SAMPLE_FIELDS` each), from one read of the whole
    blob (as every loose image is read whole), spooled to disk past 8 MB."""
    with tempfile.SpooledTemporaryFile(max_size=8 * 2**20) as spool:
        _download(container, blob).readinto(spool)
        spool.seek(0)
        return shard_samples(spool, lambda data: _decoded(data, None))


def _shard_rows(rel: str, size: int, shard: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's rows of a shard: one per sample, its path the shard's plus its name in
    it. A shard that cannot be read as samples, or that the trainer would not read (anywhere
    but directly in a split's folder), is one row under its own path saying why."""
    parts = rel.split("/")
    split = parts[0] if len(parts) == 2 else None
    problem = shard.get("error")
    if split not in SPLITS:
        problem = "a tar shard is read only as <split>/NNNNNN.tar (train/, val/ or test/)"
    if problem is not None or "samples" not in shard:
        return [
            {"path": rel, "split": split, "label": None, "bytes": int(size), **_UNREAD}
            | {"problem": problem or "not read as samples"}
        ]
    return [
        {
            "path": f"{rel}/{s['name']}",
            "split": split,
            "label": s["label"],
            "bytes": s["bytes"],
            **{k: s[k] for k in CONTENT_FIELDS},
            "problem": None,
        }
        for s in shard["samples"]
    ]


def _flag_mixed_splits(shard_rows: list[dict[str, Any]], loose: list[dict[str, Any]]) -> None:
    """A split is tar shards or class folders, never both (the trainer refuses a mix): each
    loose row below a split's folder that also holds shards says so, at any depth."""
    with_shards = {r["split"] for r in shard_rows if r["split"] in SPLITS}
    for row in loose:
        split = row["path"].split("/", 1)[0]
        if split in with_shards and "/" in row["path"] and row["problem"] is None:
            row["problem"] = f"split {split} holds tar shards: no class folders beside them"


def _cached(hit: Any, shard: bool) -> TypeGuard[dict[str, Any]]:
    """Whether a cache entry has the shape this gate writes (an older one is read again)."""
    if not isinstance(hit, dict):
        return False
    if not shard:
        return set(hit) == set(CONTENT_FIELDS)
    if set(hit) == {"error"}:
        return True
    found = hit.get("samples")
    return (
        set(hit) == {"samples"}
        and isinstance(found, list)
        and all(isinstance(s, dict) and set(s) == set(SAMPLE_FIELDS) for s in found)
    )


def cache_path(location: BlobLocation, cache_dir: Path) -> Path:
    """The cache file of one data container (account, container) under ``cache_dir``. Not
    keyed by prefix: a new version under a new prefix shares the rows of its content."""
    where = f"{DESCRIBE_VERSION}|{location.account_url or ''}|{location.container}"
    key = hashlib.sha256(where.encode()).hexdigest()[:16]
    return cache_dir / f"{location.container}-{key}.json"


def _content_key(blob: PinnedBlob) -> str:
    """The cache key of a blob's content: its MD5 and size from the listing when the service
    stores an MD5, else its name and ETag (a blob's ETag changes with its content)."""
    return f"md5:{blob.md5}:{blob.size}" if blob.md5 else f"etag:{blob.name}:{blob.etag}"


def _flag_class_names(rows: list[dict[str, Any]]) -> None:
    """Class names as the trainer takes them (``imagedata.class_names``): each row's label in
    NFC; a row whose class name the trainer refuses (white space at an end, an invisible or
    control character), or whose class folder is one name in two forms with another folder of
    its split, says so. A shard's labels were judged as it was read (``imagedata.webdataset``)."""
    forms: dict[tuple[str | None, str], set[str]] = {}
    for row in rows:
        if row["label"] is not None:
            forms.setdefault((row["split"], normal(row["label"])), set()).add(row["label"])
    for row in rows:
        label = row["label"]
        if label is None:
            continue
        others = sorted(forms[(row["split"], normal(label))] - {label})
        why = name_problem(label)
        if row["problem"] is None and why:
            row["problem"] = f"class name {shown(label)} {why}"
        elif row["problem"] is None and others:
            row["problem"] = (
                f"class folders {shown(label)} and {shown(others[0])} are one name in two "
                "Unicode forms: rename or merge them"
            )
        row["label"] = normal(label)


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
    timeout_minutes: float | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """One row per blob (``blobs``, default: :func:`list_dataset`), and how many rows came
    from the cache (unchanged blobs); GateTimeoutError when the reads are not done within
    ``timeout_minutes`` (:mod:`gate.deadline`)."""
    container = container_client(location, retries)
    if blobs is None:
        blobs = list_dataset(location, retries)
    # A row per blob and the cache's entries are bulk allocations with no cycle: made with the
    # collector paused (staging.blob.paused_gc), so it does not walk millions of rows for none.
    # Reading and decoding images steps out of the pause.
    with paused_gc() as pause:
        cache_file = cache_path(location, cache_dir)
        cache = read_json_object(cache_file) or {}  # none usable: every image is read again

        prefix = location.prefix
        rels = [blob.name[len(prefix) + 1 :] if prefix else blob.name for blob in blobs]
        # What each blob is read as: a tar shard, an image, or nothing (empty, or another kind).
        shards = [is_tar_name(rel) for rel in rels]
        read_as = [
            bool(blob.size) and (tar or is_image_name(rel))
            for blob, rel, tar in zip(blobs, rels, shards, strict=True)
        ]

        def rows_of(i: int, content: dict[str, Any]) -> list[dict[str, Any]]:
            if shards[i] and read_as[i]:
                return _shard_rows(rels[i], blobs[i].size, content)
            return [{**_path_fields(rels[i], blobs[i].size), **content}]

        def read(i: int) -> dict[str, Any]:
            if shards[i]:
                return _shard_samples(container, blobs[i])
            return _content(container, blobs[i], rels[i])

        # Cache hits in this thread (a nightly gate over unchanged data is all hits: 1.33 M futures
        # through a thread pool cost more than the rows); only what must be read goes to the pool.
        keys = [_content_key(blob) for blob in blobs]
        contents: list[dict[str, Any] | None] = []
        for i, key in enumerate(keys):
            cached = cache.get(key)
            if not read_as[i]:  # nothing to read, nothing kept: never from the cache
                contents.append(_content(container, blobs[i], rels[i]))
            else:
                contents.append(cached if _cached(cached, shards[i]) else None)
        reused = sum(1 for i, c in enumerate(contents) if read_as[i] and c is not None)
        misses = [i for i, c in enumerate(contents) if c is None]
        with pause.resumed():  # reads and decodes, 16 at once
            try:
                seconds = None if timeout_minutes is None else timeout_minutes * 60
                read_now = read_within(read, misses, 16, seconds, rels.__getitem__)
            except GateTimeoutError as exc:
                raise GateTimeoutError(
                    f"data gate stopped at validation.timeout_minutes ({timeout_minutes:g}), "
                    f"nothing was provisioned: {exc}"
                ) from None
        for i, fresh in zip(misses, read_now, strict=True):
            contents[i] = fresh
        described = [rows_of(i, c) for i, c in enumerate(contents) if c is not None]
        rows = [row for got in described for row in got]
        _flag_mixed_splits(
            [row for got, tar in zip(described, shards, strict=True) if tar for row in got],
            [row for got, tar in zip(described, shards, strict=True) if not tar for row in got],
        )
        _flag_class_names(rows)
        # Only what was read as an image or a shard: a blob of another kind (`a.png.bak`, the
        # same bytes) has the same content key, and its unread row must not stand for the image.
        entries = {
            key: content
            for key, content, kept in zip(keys, contents, read_as, strict=True)
            if kept and content is not None
        }
        if not (reused == len(blobs) and len(entries) == len(cache)):  # else: the same cache
            atomic_write(
                cache_file, lambda fh: fh.write(json.dumps(entries, separators=(",", ":")).encode())
            )
    _flag_leaks(rows)
    return rows, reused


def class_counts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Images per class and split: the rows of the gate's second table."""
    # One pass over the rows: counting per label by scanning every row was rows x classes,
    # more than an ImageNet-sized listing can afford (docs/performance.md times this).
    tally = Counter((r["label"], r["split"]) for r in rows if r["label"])
    labels = sorted({label for label, _ in tally})
    return [
        {"label": label, **{f"{s}_images": tally[(label, s)] for s in SPLITS}} for label in labels
    ]
