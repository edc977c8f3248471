"""Uploading a folder on this machine as a new data version (``python -m cli.data upload``).

What ``core.data_versions`` asks of whoever writes a version, done by the storage SDK's public
API: every blob with its Content-MD5 (the gate keys what it read by it, staging checks every
byte against it), each request's body checked by the service (``validate_content``), many
files at once and a large one in parallel blocks (``max_concurrency``), transient failures
retried by the SDK's retry policy (``backends.blob``: no loop of our own), and the ``_SUCCESS``
marker written last, only once a listing shows every file there with its MD5.

A complete version never changes, even with another upload of it running: every write is
conditional on what this upload listed (``backends.conditional``: a new blob only where none
is, a listed one replaced or deleted only at its listed ETag, the marker only where none is),
and before each write the version's marker is looked for, so an upload that finds the version
completed meanwhile stops there and says so. A file whose bytes the newest complete version
already holds (same MD5 and size) is copied by the service instead of sent again.

A run cut short (Ctrl-C, a lost connection) leaves the version incomplete, and no run reads it;
the same command again uploads only what is missing or differs (by size and MD5).

The folder is read as it is on disk: a link is followed while it stays inside the folder (to a
file or a folder), and refused by name when it leads out of it, to nothing, or to a folder
above it; a pipe, socket or device is refused by name. Nothing below the folder is left out
without a word.
"""

from __future__ import annotations

import mimetypes
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from backends.conditional import Conflict, CopyUnavailable, copy, delete, listed, properties, put
from backends.data_root import survey
from common.atomic import file_md5
from core.data_versions import (
    Complete,
    DataRoot,
    DataVersionError,
    Survey,
    check_version_name,
    in_completion_order,
    refuse_mixed,
)
from staging.blob import redact
from staging.listing import PinnedBlob
from staging.sync import UnsafeBlobNameError, safe_relative_path

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

EMPTY_MD5 = "1B2M2Y8AsgTpgAmY7PhCfg=="  # the MD5 of no bytes: the marker's
BLOCK_CONCURRENCY = 4  # parallel blocks of one large blob (a shard), on top of files at once
# How long a look that found no marker stands for the writes after it: one look a second,
# not one per blob, which cost as much as the small blob's own write.
FENCE_SECONDS = 1.0


class UploadError(RuntimeError):
    """The version cannot be (or was not) completed; the message names the blobs and files
    concerned and what to do."""


@dataclass(frozen=True)
class LocalFile:
    """A file of the folder, as it will be stored: its name below the version, where its bytes
    are (links resolved), its size and its MD5 (base64, as Content-MD5 holds it), and when it
    last changed (a file changed while it uploads is refused, not stored under the MD5 it had
    before)."""

    rel: str
    path: Path
    size: int
    md5: str
    mtime_ns: int


def _names(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _walk(source: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """The files below ``source`` (name below it, real path), and what cannot be uploaded, each
    by its name: links leading out of the folder, to nothing or to a folder above them, and
    entries that are neither files nor folders."""
    root = source.resolve()
    found: list[tuple[str, Path]] = []
    refused: list[str] = []

    def visit(folder: Path, rel: str, above: frozenset[Path]) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            refused.append(f"{rel or './'} (cannot be read: {exc.strerror})")
            return
        for entry in entries:
            name, path = f"{rel}{entry.name}", Path(entry.path)
            if entry.is_symlink():
                target = path.resolve()
                shown = f"{name} -> {os.readlink(path)}"
                if not target.is_relative_to(root):
                    refused.append(f"{shown} (leads out of the folder)")
                    continue
                if not target.exists():
                    refused.append(f"{shown} (leads to nothing)")
                    continue
                if target in above:
                    refused.append(f"{shown} (a loop: it leads to a folder above it)")
                    continue
            else:
                target = path
            if target.is_dir():
                visit(target, f"{name}/", above | {target})
            elif target.is_file():
                found.append((name, target))
            else:
                refused.append(f"{name} (not a file or a folder: a pipe, socket or device)")

    visit(root, "", frozenset({root}))
    return found, refused


def local_files(source: Path, workers: int = 8) -> list[LocalFile]:
    """Every file below ``source`` with its MD5, sorted by name, read ``workers`` at once;
    links inside the folder followed (to files and folders). UploadError names every link
    that leads out of the folder, to nothing or in a loop, and every pipe, socket or device:
    nothing is left out without a word."""
    if not source.is_dir():
        raise UploadError(f"{source} is not a folder")
    paths, refused = _walk(source)
    if refused:
        raise UploadError(
            f"{source}: {len(refused)} entries cannot be uploaded: {_names(refused, 10)}. A "
            "link is followed only while it stays inside the folder; copy what it leads to "
            "into the folder instead. Nothing was uploaded"
        )

    def describe(item: tuple[str, Path]) -> LocalFile:
        rel, path = item
        stat = path.stat()
        return LocalFile(rel, path, stat.st_size, file_md5(path), stat.st_mtime_ns)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return sorted(pool.map(describe, paths), key=lambda f: f.rel)


@dataclass
class Uploaded:
    """What an upload did: files sent, files copied in storage from an earlier version (and
    which), files already there, blobs deleted, bytes sent and not sent; ``by_another``: the
    version was completed by another upload of the same files while this one ran."""

    sent: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    unchanged: int = 0
    deleted: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_copied: int = 0
    copied_from: str | None = None
    seconds: float = 0.0
    marker: str = ""
    by_another: bool = False


def check_target(container: ContainerClient, root: DataRoot, version: str) -> Survey:
    """What lies below ``root``; UploadError when ``version`` must not be written: it is
    complete already, or the root holds loose files (a dataset without versions), beside which
    a version would make the root one that no run can train
    (``core.data_versions.refuse_mixed``)."""
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
    return found


def _content_type(rel: str) -> str:
    return mimetypes.guess_type(rel)[0] or "application/octet-stream"


@dataclass(frozen=True)
class _Write:
    """One blob to write: its file, the ETag listed for it (None: there was none), and a blob
    of the previous version holding the same bytes to copy instead of sending them."""

    name: str
    file: LocalFile
    etag: str | None
    source: PinnedBlob | None


class _CompletedMeanwhile(Exception):
    """The version's marker appeared while this upload ran."""


class _Fence:
    """The version's marker, looked for before each write (at most :data:`FENCE_SECONDS`
    before it, by the monotonic clock and by the wall clock, which also counts a machine's
    sleep): once another upload has completed the version, this one writes nothing more."""

    def __init__(self, container: ContainerClient, marker: str) -> None:
        self.container, self.marker, self.completed = container, marker, False
        self._lock = threading.Lock()
        self._absent_at: tuple[float, float] | None = None  # (monotonic, wall) of the last look

    def check(self) -> None:
        with self._lock:
            if not self.completed:
                now = (time.monotonic(), time.time())
                seen = self._absent_at
                if seen and all(0 <= a - b < FENCE_SECONDS for a, b in zip(now, seen, strict=True)):
                    return
                self.completed = properties(self.container, self.marker) is not None
                self._absent_at = now
            if self.completed:
                raise _CompletedMeanwhile


def _send(container: ContainerClient, name: str, file: LocalFile, etag: str | None) -> None:
    """One file as one blob, conditional on ``etag`` (``backends.conditional.put``)."""
    with open(file.path, "rb") as data:
        put(
            container,
            name,
            data,
            file.size,
            file.md5,
            _content_type(file.rel),
            etag,
            BLOCK_CONCURRENCY,
        )
    stat = file.path.stat()
    if (stat.st_size, stat.st_mtime_ns) != (file.size, file.mtime_ns):
        raise UploadError(f"{file.path} changed while it was uploaded: run the command again")


def _write(container: ContainerClient, fence: _Fence, item: _Write) -> bool:
    """The blob written, by a copy in storage where it can be (True) or by sending the file."""
    fence.check()
    etag = item.etag
    if item.source is not None:
        try:
            copy(container, item.name, item.source, etag)
            return True
        except CopyUnavailable as exc:  # the bytes are sent instead
            etag = exc.etag
    _send(container, item.name, item.file, etag)
    return False


def _sources(
    container: ContainerClient, root: DataRoot, found: Survey, version: str
) -> tuple[str | None, dict[tuple[str, int, str], PinnedBlob]]:
    """The newest complete version but ``version``, and its blobs by (MD5, size, content
    type): what a new version's files may be copied from in storage."""
    earlier = [c for c in found.complete if c.name != version]
    if not earlier:
        return None, {}
    previous = in_completion_order(earlier)[-1].name
    marker = root.marker(previous)
    by_content: dict[tuple[str, int, str], PinnedBlob] = {}
    for blob in listed(container, root.folder(previous)).values():
        if blob.name != marker and blob.md5 and blob.size:
            by_content.setdefault((blob.md5, blob.size, _content_type(blob.name)), blob)
    return previous, by_content


def _stopped(
    container: ContainerClient,
    root: DataRoot,
    version: str,
    names: dict[str, LocalFile],
    done: Uploaded,
) -> Uploaded:
    """The version was completed by another upload while this one ran: complete with these
    files (``done``, said so), or UploadError."""
    try:
        _same_files(container, root, version, names)
    except UploadError:
        raise UploadError(
            f"data version {version} of {root.where} was completed by another upload while "
            f"this one ran ({root.marker(version)} appeared): this upload stopped and wrote "
            "nothing more to it, since a complete version never changes. Upload this folder "
            "as a new version (another --version)"
        ) from None
    done.by_another = True
    done.marker = root.marker(version)
    return done


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
    blob has the same size and MD5 already are not sent again; those the previous complete
    version holds are copied in storage. UploadError names what failed; the version is then
    left incomplete, for the same call to finish."""
    started = time.monotonic()
    if not files:
        raise UploadError("the folder holds no files: nothing to upload")
    found = check_target(container, root, version)
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
    done = Uploaded()
    fence = _Fence(container, root.marker(version))
    stored = listed(container, prefix)
    if root.marker(version) in stored:  # completed since check_target looked
        return _stopped(container, root, version, names, done)
    extra = sorted(set(stored) - set(names))
    if extra and not delete_extra:
        raise UploadError(
            f"{prefix}/ holds {len(extra)} blobs this folder does not ({_names(extra)}): an "
            "earlier upload's of files since removed or renamed, or another upload's. "
            "--delete-extra deletes them; or choose another --version"
        )
    done.copied_from, sources = _sources(container, root, found, version)
    todo = []
    for name, file in names.items():
        blob = stored.get(name)
        if blob is None or (blob.size, blob.md5) != (file.size, file.md5):
            source = sources.get((file.md5, file.size, _content_type(file.rel)))
            todo.append(_Write(name, file, blob.etag if blob else None, source))
    done.unchanged = len(names) - len(todo)
    to_copy = [w for w in todo if w.source is not None]
    total = sum(w.file.size for w in todo if w.source is None)
    say(
        f"uploading {len(todo)} of {len(names)} files to {root.container}/{prefix}/, "
        f"{workers} at once: {len(todo) - len(to_copy)} to send ({total / 2**20:.1f} MB)"
        + (f", {len(to_copy)} to copy in storage from {done.copied_from}" if to_copy else "")
        + (f"; {done.unchanged} are there already" if done.unchanged else "")
        + (f"; {len(extra)} blobs the folder does not hold to delete first" if extra else "")
    )
    conflicts: list[str] = []
    try:
        for name in extra:
            fence.check()
            delete(container, name, stored[name].etag)
            done.deleted.append(name)
    except _CompletedMeanwhile:
        return _stopped(container, root, version, names, done)
    except Conflict as exc:
        conflicts.append(exc.name)
    failed: dict[str, str] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    queue = iter(todo if not conflicts else [])
    pending: dict[Future[bool], _Write] = {}

    def top_up() -> None:
        """A few files per worker in flight, not a future per file of the folder up front;
        none more once the version was found completed or written by another upload."""
        while (
            not (fence.completed or conflicts)
            and len(pending) < 4 * max(1, workers)
            and (item := next(queue, None)) is not None
        ):
            pending[pool.submit(_write, container, fence, item)] = item

    try:
        top_up()
        shown = time.monotonic()
        while pending:
            finished, _ = wait(pending, timeout=5, return_when=FIRST_COMPLETED)
            for future in finished:
                item = pending.pop(future)
                problem = future.exception()
                if problem is None:
                    if future.result():
                        done.copied.append(item.name)
                        done.bytes_copied += item.file.size
                    else:
                        done.sent.append(item.name)
                        done.bytes_sent += item.file.size
                elif isinstance(problem, Conflict):
                    conflicts.append(problem.name)
                elif not isinstance(problem, _CompletedMeanwhile):
                    first = (str(problem).splitlines() or [""])[0][:200]
                    failed[item.name] = redact(f"{type(problem).__name__}: {first}")
            top_up()
            if time.monotonic() - shown >= 10 and pending:
                say(f"  {len(done.sent) + len(done.copied)} of {len(todo)} files written")
                shown = time.monotonic()
    finally:  # Ctrl-C: nothing more is started, what runs finishes, nothing is marked complete
        pool.shutdown(wait=True, cancel_futures=True)
    done.seconds = time.monotonic() - started
    if fence.completed:
        return _stopped(container, root, version, names, done)
    if conflicts:
        raise UploadError(
            f"another upload is writing data version {version} of {root.where}: "
            f"{len(conflicts)} blobs changed since this upload listed them "
            f"({_names(sorted(conflicts))}); this upload stopped. Run the command again once "
            "the other is done, or choose another --version"
        )
    if failed:
        listed_failures = [f"{n} ({why})" for n, why in sorted(failed.items())]
        raise UploadError(
            f"{len(failed)} of {len(todo)} files were not uploaded: "
            f"{_names(listed_failures, 3)}; the version is not marked complete: run the same "
            "command again to upload what is missing"
        )
    _complete(container, root, version, names)
    done.marker = root.marker(version)
    done.seconds = time.monotonic() - started
    return done


def _complete(
    container: ContainerClient, root: DataRoot, version: str, names: dict[str, LocalFile]
) -> None:
    """The marker, last: only once a fresh listing shows every file with its size and MD5 and
    nothing else, and only where no marker is (a marker already there, from this write's lost
    answer or another upload of the same files, counts when the files are still these)."""
    _same_files(container, root, version, names)
    try:
        put(container, root.marker(version), b"", 0, EMPTY_MD5, "application/octet-stream", None)
    except Conflict:
        raise UploadError(
            f"{root.marker(version)} was written by another upload meanwhile, not empty: "
            "upload this folder as a new version (another --version)"
        ) from None
    _same_files(container, root, version, names)


def _same_files(
    container: ContainerClient, root: DataRoot, version: str, names: dict[str, LocalFile]
) -> None:
    """UploadError unless the version's blobs are exactly ``names``, each with its file's size
    and MD5 (the marker aside)."""
    stored = listed(container, root.folder(version))
    stored.pop(root.marker(version), None)
    wrong = [
        n
        for n, f in names.items()
        if n not in stored or (stored[n].size, stored[n].md5) != (f.size, f.md5)
    ]
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
