"""Uploading a folder on this machine as a new data version (``python -m cli.data upload``).

What ``core.data_versions`` asks of whoever writes a version, done by the storage SDK's public
API: every blob with its Content-MD5 (the gate keys what it read by it, staging checks every
byte against it), each request's body checked by the service (``validate_content``), many
files at once and a large one in parallel blocks (``max_concurrency``), transient failures
retried by the SDK's retry policy (``backends.blob``: no loop of our own), and the ``_SUCCESS``
marker written last, only once a listing shows every file there with its MD5, and never over
an existing one (If-None-Match), so a version is complete exactly once.

A run cut short (Ctrl-C, a lost connection) leaves the version incomplete, and no run reads it;
the same command again uploads only what is missing or differs (by size and MD5). A complete
version is never touched: runs, champion records and summaries name it.
"""

from __future__ import annotations

import base64
import mimetypes
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from backends.data_root import survey
from common.atomic import file_md5
from core.data_versions import (
    Complete,
    DataRoot,
    DataVersionError,
    check_version_name,
    refuse_mixed,
)
from staging.blob import redact
from staging.sync import UnsafeBlobNameError, safe_relative_path

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

EMPTY_MD5 = "1B2M2Y8AsgTpgAmY7PhCfg=="  # the MD5 of no bytes: the marker's
BLOCK_CONCURRENCY = 4  # parallel blocks of one large blob (a shard), on top of files at once


class UploadError(RuntimeError):
    """The version cannot be (or was not) completed; the message names the blobs and files
    concerned and what to do."""


@dataclass(frozen=True)
class LocalFile:
    """A file of the folder, as it will be stored: its name below the version, its size and
    its MD5 (base64, as Content-MD5 holds it), and when it last changed (a file changed while
    it uploads is refused, not stored under the MD5 it had before)."""

    rel: str
    path: Path
    size: int
    md5: str
    mtime_ns: int


def local_files(source: Path, workers: int = 8) -> list[LocalFile]:
    """Every file below ``source`` (links to files followed, links to folders not), with its
    MD5, sorted by name; read ``workers`` at once."""
    if not source.is_dir():
        raise UploadError(f"{source} is not a folder")
    paths = []
    for top, dirs, names in os.walk(source):
        dirs.sort()
        paths += [Path(top) / n for n in names if (Path(top) / n).is_file()]

    def describe(path: Path) -> LocalFile:
        stat = path.stat()
        return LocalFile(
            path.relative_to(source).as_posix(),
            path,
            stat.st_size,
            file_md5(path),
            stat.st_mtime_ns,
        )

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return sorted(pool.map(describe, sorted(paths)), key=lambda f: f.rel)


@dataclass
class Uploaded:
    """What an upload did: files sent, files already there, blobs deleted, bytes sent."""

    sent: list[str] = field(default_factory=list)
    unchanged: int = 0
    deleted: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    seconds: float = 0.0
    marker: str = ""


def _names(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _stored(container: ContainerClient, prefix: str) -> dict[str, tuple[int, str | None]]:
    """The blobs below ``prefix``: name -> (size, Content-MD5 in base64 or None)."""
    found = {}
    for blob in container.list_blobs(name_starts_with=f"{prefix}/"):
        md5 = blob.content_settings.content_md5
        found[str(blob.name)] = (
            int(blob.size),
            base64.b64encode(bytes(md5)).decode() if md5 else None,
        )
    return found


def check_target(container: ContainerClient, root: DataRoot, version: str) -> None:
    """UploadError when ``version`` of ``root`` must not be written: it is complete already,
    or the root holds loose files (a dataset without versions), beside which a version would
    make the root one that no run can train (``core.data_versions.refuse_mixed``)."""
    try:
        check_version_name(version)
    except ValueError as exc:
        raise UploadError(str(exc)) from None
    found = survey(container, root.prefix)
    done = next((c for c in found.complete if c.name == version), None)
    if done is not None:
        raise UploadError(
            f"data version {version} of {root.where} is complete ({root.marker(version)} was "
            f"written at {done.completed_at:%Y-%m-%d %H:%M:%S} UTC): a complete version is "
            "never changed, since runs and champion records name it. Upload this folder as a "
            "new version (another --version)"
        )
    planned = replace(found, complete=[*found.complete, Complete(version, "", datetime.now(UTC))])
    try:
        refuse_mixed(planned)
    except DataVersionError as exc:
        raise UploadError(f"uploading version {version} is refused: {exc}") from None


def _content_type(rel: str) -> str:
    return mimetypes.guess_type(rel)[0] or "application/octet-stream"


def _put(container: ContainerClient, name: str, file: LocalFile) -> None:
    """One file as one blob, its MD5 stored and each request's body checked by the service."""
    from azure.storage.blob import ContentSettings

    settings = ContentSettings(
        content_type=_content_type(file.rel),
        content_md5=bytearray(base64.b64decode(file.md5)),
    )
    with open(file.path, "rb") as data:
        container.upload_blob(
            name,
            data,
            length=file.size,
            overwrite=True,
            validate_content=True,
            max_concurrency=BLOCK_CONCURRENCY,
            content_settings=settings,
        )
    stat = file.path.stat()
    if (stat.st_size, stat.st_mtime_ns) != (file.size, file.mtime_ns):
        raise UploadError(f"{file.path} changed while it was uploaded: run the command again")


def upload_version(
    container: ContainerClient,
    root: DataRoot,
    version: str,
    files: list[LocalFile],
    workers: int = 8,
    delete_extra: bool = False,
    say: Callable[[str], None] = print,
) -> Uploaded:
    """Upload ``files`` as ``version`` of ``root``, then its marker; what was done. Files whose
    blob has the same size and MD5 already are not sent again. UploadError names what failed;
    the version is then left incomplete, for the same call to finish."""
    started = time.monotonic()
    if not files:
        raise UploadError("the folder holds no files: nothing to upload")
    check_target(container, root, version)
    prefix = root.folder(version)
    names = {}
    unsafe = []
    for file in files:
        name = f"{prefix}/{file.rel}"
        try:
            safe_relative_path(name, prefix)
        except UnsafeBlobNameError as exc:
            unsafe.append(str(exc))
        names[name] = file
    if unsafe:
        raise UploadError(
            f"{len(unsafe)} file names cannot be blobs staging writes: {_names(unsafe)}"
        )
    stored = _stored(container, prefix)
    extra = sorted(set(stored) - set(names))
    if extra and not delete_extra:
        raise UploadError(
            f"{prefix}/ holds {len(extra)} blobs this folder does not ({_names(extra)}): an "
            "earlier upload's of files since removed or renamed, or another upload's. "
            "--delete-extra deletes them; or choose another --version"
        )
    done = Uploaded()
    for name in extra:
        container.delete_blob(name)
        done.deleted.append(name)
    todo = [(n, f) for n, f in names.items() if stored.get(n) != (f.size, f.md5)]
    done.unchanged = len(names) - len(todo)
    total = sum(f.size for _, f in todo)
    say(
        f"uploading {len(todo)} of {len(names)} files ({total / 2**20:.1f} MB) to "
        f"{root.container}/{prefix}/, {workers} at once"
        + (f"; {done.unchanged} are there already" if done.unchanged else "")
    )
    failed: dict[str, str] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    queue = iter(todo)
    pending: dict[Future[None], tuple[str, LocalFile]] = {}

    def top_up() -> None:
        """A few files per worker in flight, not a future per file of the folder up front."""
        while len(pending) < 4 * max(1, workers) and (item := next(queue, None)) is not None:
            pending[pool.submit(_put, container, *item)] = item

    try:
        top_up()
        shown = time.monotonic()
        while pending:
            finished, _ = wait(pending, timeout=5, return_when=FIRST_COMPLETED)
            for future in finished:
                name, file = pending.pop(future)
                problem = future.exception()
                if problem is None:
                    done.sent.append(name)
                    done.bytes_sent += file.size
                else:
                    first = (str(problem).splitlines() or [""])[0][:200]
                    failed[name] = redact(f"{type(problem).__name__}: {first}")
            top_up()
            if time.monotonic() - shown >= 10 and pending:
                say(f"  {len(done.sent)} of {len(todo)} files sent")
                shown = time.monotonic()
    finally:  # Ctrl-C: nothing more is started, what runs finishes, nothing is marked complete
        pool.shutdown(wait=True, cancel_futures=True)
    done.seconds = time.monotonic() - started
    if failed:
        listed = [f"{n} ({why})" for n, why in sorted(failed.items())]
        raise UploadError(
            f"{len(failed)} of {len(todo)} files were not uploaded: {_names(listed, 3)}; the "
            f"version is not marked complete: run the same command again to upload what is "
            "missing"
        )
    _complete(container, root, version, names)
    done.marker = root.marker(version)
    done.seconds = time.monotonic() - started
    return done


def _complete(
    container: ContainerClient, root: DataRoot, version: str, names: dict[str, LocalFile]
) -> None:
    """The marker, last: only once a fresh listing shows every file with its size and MD5 and
    nothing else, and never over a marker already there."""
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import ContentSettings

    _same_files(container, root, version, names)
    empty = ContentSettings(content_md5=bytearray(base64.b64decode(EMPTY_MD5)))
    try:
        container.upload_blob(
            root.marker(version),
            b"",
            overwrite=False,
            validate_content=True,
            content_settings=empty,
        )
    except ResourceExistsError:
        # This write, its answer lost and the SDK's retry refused; or another upload of the
        # same folder that finished first. Either way complete, if the files are still these.
        _same_files(container, root, version, names)


def _same_files(
    container: ContainerClient, root: DataRoot, version: str, names: dict[str, LocalFile]
) -> None:
    """UploadError unless the version's blobs are exactly ``names``, each with its file's size
    and MD5 (the marker aside)."""
    stored = _stored(container, root.folder(version))
    stored.pop(root.marker(version), None)
    wrong = [n for n, f in names.items() if stored.get(n) != (f.size, f.md5)]
    other = sorted(set(stored) - set(names))
    if not (wrong or other):
        return
    found = []
    if wrong:
        found.append(f"{len(wrong)} blobs differ from the files ({_names(wrong)})")
    if other:
        found.append(f"{len(other)} blobs were added meanwhile ({_names(other)})")
    raise UploadError(
        f"{root.folder(version)} is not these files: {'; '.join(found)}. Another upload to the "
        "same version? Run the command again once it is done, or choose another --version"
    )
