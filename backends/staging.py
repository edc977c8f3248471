"""Blob -> directory sync: the data-staging step, identical on a laptop and on a Batch node.

Properties a training run relies on:

* incremental: a blob whose etag and size match the last sync is not downloaded again;
* atomic: each file is written under a temporary name and renamed, so a reader (or a resumed
  sync) never sees a partial file under its final name; the manifest is written only after
  the files are flushed to storage;
* verified: size, and MD5 whenever the service stored one, are checked before the rename;
* path-safe: every blob name is checked before anything is written; a name that would land
  outside the destination fails the sync and names the blob;
* parallel: downloads run on a thread pool (I/O bound, the GIL is released).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from backends.blob import folder
from training.atomic import atomic_write_json
from training.shards import SHARD_DIR, pack_shards, remove_shards
from training.shards import STAGING_MANIFEST as MANIFEST

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

MAX_NAME = 1024  # Azure's own limit on blob names


class UnsafeBlobNameError(ValueError):
    """A blob name would be written outside the destination, or is not a usable path."""


class IntegrityError(IOError):
    """A downloaded file's size or MD5 does not match what the service reported."""


@dataclass
class SyncReport:
    downloaded: list[str] = field(default_factory=list)
    skipped: int = 0
    deleted: list[str] = field(default_factory=list)
    bytes_downloaded: int = 0
    total_files: int = 0
    manifest: str = ""
    data_version: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def safe_relative_path(name: str, prefix: str) -> PurePosixPath:
    """The path of blob ``name`` below ``prefix``, or UnsafeBlobNameError naming the blob."""
    rel = name[len(prefix) + 1 :] if prefix else name
    problem = None
    if not rel:
        problem = "empty name below the prefix"
    elif len(name) > MAX_NAME:
        problem = f"longer than {MAX_NAME} characters"
    elif rel.startswith("/") or "\\" in rel or "\x00" in rel or (len(rel) > 1 and rel[1] == ":"):
        problem = "absolute path, backslash, drive letter or NUL"
    elif any(part in ("", ".", "..") for part in rel.split("/")):
        problem = "'.', '..' or empty path segment"
    elif any(part == MANIFEST or part.startswith(".staging-") for part in rel.split("/")):
        problem = "collides with the staging manifest"
    elif rel.split("/", 1)[0] == SHARD_DIR:
        problem = f"collides with the packed shards ({SHARD_DIR}/)"
    if problem:
        raise UnsafeBlobNameError(f"blob {name!r} rejected: {problem}")
    return PurePosixPath(rel)


def _md5_b64(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return base64.b64encode(digest.digest()).decode()


def _load_manifest(dest: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads((dest / MANIFEST).read_text())
        return dict(data.get("files", {}))
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return {}  # no usable manifest: everything is checked again, nothing is lost


def _download(
    container: ContainerClient, name: str, target: Path, size: int, md5: str | None
) -> str:
    """Download to a temp file beside ``target``, verify, rename. Returns the MD5 (base64).

    The MD5 is computed from the bytes as they arrive (no second read of the file), and the
    temp name is this thread's own in that folder: small files are bound by per-file costs.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".staging-{os.getpid()}-{threading.get_ident()}.part"
    digest = hashlib.md5(usedforsecurity=False)
    received = 0
    try:
        with open(tmp, "wb") as fh:
            for chunk in container.download_blob(name, max_concurrency=1).chunks():
                digest.update(chunk)
                fh.write(chunk)
                received += len(chunk)
        if received != size:
            raise IntegrityError(f"blob {name!r}: downloaded {received} bytes, expected {size}")
        actual_md5 = base64.b64encode(digest.digest()).decode()
        if md5 and actual_md5 != md5:
            raise IntegrityError(f"blob {name!r}: MD5 {actual_md5} does not match stored {md5}")
        os.replace(tmp, target)
        return actual_md5
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sync_to_directory(
    container: ContainerClient, prefix: str, dest: Path, workers: int = 16
) -> SyncReport:
    """Mirror the blobs under ``prefix`` into ``dest``; see the module docstring."""
    prefix = prefix.strip("/")
    listing = list(container.list_blobs(name_starts_with=folder(prefix)))
    planned: dict[str, tuple[Any, PurePosixPath]] = {}
    for blob in listing:  # check every name before writing anything
        planned[blob.name] = (blob, safe_relative_path(blob.name, prefix))
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    previous = _load_manifest(dest)
    report = SyncReport(total_files=len(planned))
    todo = []
    files: dict[str, dict[str, Any]] = {}
    inside: dict[Path, bool] = {}  # per folder: resolving each file's path costs a stat per part
    for name, (blob, rel) in planned.items():
        target = dest / rel
        if target.parent not in inside:
            inside[target.parent] = target.parent.resolve().is_relative_to(root)
        if not inside[target.parent] or target.is_symlink():  # e.g. through a symlinked folder
            raise UnsafeBlobNameError(f"blob {name!r} rejected: resolves outside {dest}")
        md5 = (
            base64.b64encode(bytes(blob.content_settings.content_md5)).decode()
            if blob.content_settings and blob.content_settings.content_md5
            else None
        )
        entry = {"path": str(rel), "etag": blob.etag, "size": blob.size, "md5": md5}
        old = previous.get(name)
        same_size = target.is_file() and target.stat().st_size == blob.size
        if same_size and old and old.get("etag") == blob.etag and old.get("size") == blob.size:
            report.skipped += 1
            files[name] = {**entry, "md5": old.get("md5") or md5}
        elif same_size and md5 and _md5_b64(target) == md5:  # manifest lost, file intact
            report.skipped += 1
            files[name] = entry
        else:
            todo.append((name, target, blob.size, md5, entry))
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        futures = {
            pool.submit(_download, container, name, target, size, md5): (name, entry)
            for name, target, size, md5, entry in todo
        }
        for future in as_completed(futures):
            name, entry = futures[future]
            files[name] = {**entry, "md5": future.result()}
            report.downloaded.append(name)
            report.bytes_downloaded += entry["size"]
    finally:
        # After a failure nothing new starts (each queued download would only retry against
        # the same broken storage); the step's retry fetches the rest. What did arrive is
        # recorded, and files finished but unrecorded are recognised by their MD5 next time.
        pool.shutdown(wait=True, cancel_futures=True)
        # One flush of everything written, before the manifest vouches for it, instead of an
        # fsync per file (a COMMIT round trip each on NFS). A file lost to a crash before this
        # point is not in the manifest and is re-checked by size and MD5 on the next sync.
        if report.downloaded:
            os.sync()
        _write_manifest(dest, prefix, files, report)
    for name, old in previous.items():
        if name not in planned:  # removed from the container since the last sync
            stale = dest / old["path"]
            if stale.resolve().is_relative_to(root) and stale.is_file():
                stale.unlink()
                report.deleted.append(name)
    return report


def stage(
    container: ContainerClient, prefix: str, dest: Path, shard_size: int, workers: int = 16
) -> dict[str, Any]:
    """The staging step, wherever it runs: sync, then pack shards for a trainer reading
    ``shard_size`` pixels (0: no packing, and an older pack is removed). Returns the report."""
    report = sync_to_directory(container, prefix, dest, workers=workers).as_dict()
    if shard_size:
        report["shards"] = pack_shards(dest, shard_size).as_dict()
    else:
        remove_shards(dest)
        report["shards"] = {"action": "not packed", "reason": "nfs.shards is off"}
    return report


def _write_manifest(
    dest: Path, prefix: str, files: dict[str, dict[str, Any]], report: SyncReport
) -> None:
    # The data version names the content, not the time: same bytes, same version.
    version = hashlib.sha256(
        json.dumps(sorted((n, f["md5"], f["size"]) for n, f in files.items())).encode()
    ).hexdigest()[:16]
    atomic_write_json({"prefix": prefix, "data_version": version, "files": files}, dest / MANIFEST)
    report.manifest = str(dest / MANIFEST)
    report.data_version = version
