"""Blob -> directory sync: the data-staging step, identical on a laptop and on a Batch node.

Properties a training run relies on:

* incremental: a blob whose ETag and size match the last sync is not downloaded again (nor a
  blob of a new name, a new version's, whose size and Content-MD5 match the file on its path);
* trusted without reading: a file the manifest vouches for (same blob, ETag, size and MD5 as
  recorded) whose status is the one recorded when it was staged (size, modification time,
  change time, inode) is not read again. A file changed behind the manifest's back changes
  its change time (which no program can set back), so it is read, and downloaded again when
  its bytes differ. What a status cannot show (bits rotting on the disk, a restore that keeps
  every time, a rewrite within the same tick of the file system's clock as staging's own
  rename) is caught by turns: each sync re-reads the files of one slice in
  ``verify_every`` (by a hash of the path), so every file is read again at least once every
  ``verify_every`` syncs;
* atomic: each file is written under a temporary name and renamed, so a reader (or a resumed
  sync) never sees a partial file under its final name; the manifest vouches for a file only
  when a crash cannot have lost its bytes since (on NFS once it is closed, on a local disk
  under the boot that wrote it, anywhere else after a flush: ``staging.durability``);
* verified: size, and MD5 whenever the service stored one, are checked before the rename;
* path-safe: every blob name is checked before anything is written; a name that would land
  outside the destination, needs a path segment longer than the filesystem allows, or would be
  both a file and a folder fails the sync and names the blob;
* pinned: given the listing the data gate validated (names, ETags, sizes), exactly that listing
  is staged, each blob downloaded only while its ETag is still the validated one; a blob added
  after the gate is not staged, one changed or deleted since fails the sync and is named;
* exactly the listing: before anything is written, whatever the folder holds that no staged
  blob lands on is deleted, whoever left it: an earlier version's files, files a sync killed
  before its manifest renamed into place (no manifest names them), temporary files of
  interrupted downloads, and the folders left empty; the trainer reads every class folder it
  finds. It goes by destination path, so a new version under a new prefix (``images/v2``
  after ``images/v1``, the same relative paths under new blob names) keeps every file it
  staged. A walk of names, nothing read;
* parallel: downloads run in :mod:`staging.transfer`, many in flight, outside the
  interpreter lock (see there for why, and for each download's own guarantees); a sync
  that lists the container itself asks for the listing first and reads the manifest and
  the files whose turn it is while the service answers (until the listing arrives): a
  re-sync's own work is a fraction of that wait.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from common.atomic import file_md5
from imagedata.staged_folder import (
    MANIFEST,
    SHARD_DIR,
    TEMP_PREFIX,
    current_pack,
    previous_sync,
    write_manifest,
)
from staging.blob import GcPause, Retry, list_pinned, object_store, paused_gc
from staging.durability import boot_id, flush_filesystem, settle, written_back
from staging.listing import PinnedBlob
from staging.transfer import Download, download_all

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

log = logging.getLogger(__name__)

MAX_NAME = 1024  # Azure's own limit on blob names
MAX_SEGMENT_BYTES = 255  # NAME_MAX of ext4, XFS and NFS exports: one path segment, in bytes
VERIFY_EVERY = 16  # a file the manifest vouches for is read again once in this many syncs


class UnsafeBlobNameError(ValueError):
    """A blob name would be written outside the destination, or is not a usable path."""


@dataclass
class SyncReport:
    downloaded: list[str] = field(default_factory=list)
    skipped: int = 0
    # Staged files read to check their bytes: their turn, a status not the one recorded, or
    # no manifest entry vouching for them. 0: the sync read no staged file.
    verified: int = 0
    # Files the manifest vouched for, found changed when read: downloaded again.
    repaired: list[str] = field(default_factory=list)
    # Blob names of the files an earlier sync recorded that this listing does not name.
    deleted: list[str] = field(default_factory=list)
    # Relative paths of what no manifest recorded and the listing does not name, deleted: files
    # a killed sync renamed into place, temporary files of interrupted downloads.
    removed: list[str] = field(default_factory=list)
    bytes_downloaded: int = 0
    total_files: int = 0
    manifest: str = ""
    data_version: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def safe_relative_path(name: str, prefix: str) -> PurePosixPath:
    """The path of blob ``name`` below ``prefix``, or UnsafeBlobNameError naming the blob."""
    return PurePosixPath(_relative(name, prefix))


def _relative(name: str, prefix: str) -> str:
    """:func:`safe_relative_path` as a string: a sync plans every blob's path, and plain
    strings cost a sixth of what paths do per blob (a re-sync of 5,000 files spent more in
    pathlib than in its own logic)."""
    rel = name[len(prefix) + 1 :] if prefix else name
    problem = None
    parts = rel.split("/")
    if prefix and not name.startswith(f"{prefix}/"):
        problem = f"not below the prefix {prefix!r}"
    elif not rel:
        problem = "empty name below the prefix"
    elif len(name) > MAX_NAME:
        problem = f"longer than {MAX_NAME} characters"
    elif rel.startswith("/") or "\\" in rel or "\x00" in rel or (len(rel) > 1 and rel[1] == ":"):
        problem = "absolute path, backslash, drive letter or NUL"
    elif "" in parts or "." in parts or ".." in parts:
        problem = "'.', '..' or empty path segment"
    elif len(rel.encode()) > MAX_SEGMENT_BYTES and any(
        len(part.encode()) > MAX_SEGMENT_BYTES for part in parts
    ):
        problem = f"a path segment longer than {MAX_SEGMENT_BYTES} bytes (the filesystem's limit)"
    elif MANIFEST in parts or (
        TEMP_PREFIX in rel and any(part.startswith(TEMP_PREFIX) for part in parts)
    ):
        problem = "collides with the staging manifest"
    elif parts[0] == SHARD_DIR:
        problem = f"collides with the packed shards ({SHARD_DIR}/)"
    if problem:
        raise UnsafeBlobNameError(f"blob {name!r} rejected: {problem}")
    return rel


def _plan(blobs: list[PinnedBlob], prefix: str) -> dict[str, tuple[PinnedBlob, str]]:
    """Every blob's destination path (relative, as a string), checked before anything is
    written: unsafe names, and names that would make one path both a file and a folder, fail
    naming the blobs."""
    planned: dict[str, tuple[PinnedBlob, str]] = {}
    owner: dict[str, str] = {}  # relative path -> blob name
    for blob in blobs:
        rel = _relative(blob.name, prefix)
        planned[blob.name] = (blob, rel)
        owner[rel] = blob.name
    folders: set[str] = set()  # checked already: no blob is a file there
    for name, (_, rel) in planned.items():
        end = rel.rfind("/")
        while end > 0:
            parent = rel[:end]
            if parent in folders:
                break
            other = owner.get(parent)
            if other is not None:
                raise UnsafeBlobNameError(
                    f"blob {name!r} rejected: it needs {parent!r} as a folder, but blob "
                    f"{other!r} is a file there"
                )
            folders.add(parent)
            end = rel.rfind("/", 0, end)
    return planned


def _remove_unlisted(dest: Path, planned: dict[str, tuple[PinnedBlob, str]]) -> list[str]:
    """Delete whatever in ``dest`` no listed file needs, and return the relative paths of the
    files deleted. The trainer reads every class folder it finds, so the folder must hold the
    listing and nothing else, whatever an earlier sync left: an earlier version's files, files
    a sync killed before its manifest renamed into place (no manifest names them), temporary
    files of interrupted downloads and manifest writes, links, and folders left empty. Only
    names are walked (a directory read per folder), nothing is read. Left alone: the manifest
    and the packed shards (their packer keeps them). A link where the listing needs a file or
    a folder is refused, naming a blob, before anything is deleted: it may lead outside."""
    listed = {rel: name for name, (_, rel) in planned.items()}
    folders: dict[str, str] = {}  # each folder a listed file needs -> a blob below it
    for rel, name in listed.items():
        end = rel.rfind("/")
        while end > 0 and rel[:end] not in folders:
            folders[rel[:end]] = name
            end = rel.rfind("/", 0, end)
    files: list[str] = []
    doomed: list[str] = []  # folders no listed file needs, each before those inside it
    base = os.fspath(dest)
    todo = [""]
    while todo:
        folder = todo.pop()
        try:
            entries = list(os.scandir(f"{base}/{folder}" if folder else base))
        except FileNotFoundError:
            continue
        for entry in entries:
            rel = f"{folder}/{entry.name}" if folder else entry.name
            if not folder and entry.name in (MANIFEST, SHARD_DIR):
                continue
            if entry.is_dir(follow_symlinks=False):
                todo.append(rel)
                if rel not in folders:
                    doomed.append(rel)
            elif entry.is_symlink() and (rel in listed or rel in folders):
                name = listed.get(rel) or folders[rel]
                raise UnsafeBlobNameError(
                    f"blob {name!r} rejected: resolves outside {dest} ({rel} is a link)"
                )
            elif rel not in listed:
                files.append(rel)
    files.sort()
    for rel in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{base}/{rel}")
    for rel in reversed(doomed):
        os.rmdir(f"{base}/{rel}")
    return files


def _same_content(name: str, blob: PinnedBlob, old_name: str, old: dict[str, Any]) -> bool:
    """Whether the manifest's entry on a path vouches for ``blob``'s content. The same blob
    only at the same ETag (and the listed MD5, when there is one): its Content-MD5 is whatever
    its writer sent with Put Block List, so a blob rewritten with its old MD5 kept is new
    content. Across names (a new version's blob landing on an old one's path) the MD5 is the
    only content identity there is."""
    if old.get("size") != blob.size:
        return False
    if old_name == name:
        return old.get("etag") == blob.etag and (blob.md5 is None or old.get("md5") == blob.md5)
    return blob.md5 is not None and old.get("md5") == blob.md5


def _status(st: os.stat_result) -> list[int]:
    """What the manifest records of a staged file's status (its size is recorded apart)."""
    return [st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _slice(path: str, verify_every: int) -> int:
    """Which of the ``verify_every`` slices a staged file is re-read with (by its path)."""
    return zlib.crc32(path.encode(errors="replace")) % verify_every


class _Inside:
    """Whether a folder resolves inside ``root`` (a resolved path), asked once per folder:
    resolving costs a stat per path part. ``seen`` holds each answer given (a sync's loop
    looks there first: a dictionary lookup per file instead of a call)."""

    def __init__(self, root: str) -> None:
        self._root = root.rstrip("/")
        self.seen: dict[str, bool] = {}

    def __call__(self, folder: str) -> bool:
        if folder not in self.seen:
            real = os.path.realpath(folder)
            root = self._root
            self.seen[folder] = real == (root or "/") or real.startswith(f"{root}/")
        return self.seen[folder]


def _lstat(target: str) -> os.stat_result | None:
    try:
        return os.lstat(target)
    except (FileNotFoundError, NotADirectoryError):
        return None


class _Survey:
    """The MD5s of the files whose turn it is to be read, taken while the listing is on its
    way instead of after it, each with the status it was read at: the sync uses one only for
    a file whose status it finds the same. It stops when the listing arrives (what is left is
    read by the sync as before), so it costs no wait, and a listing that fails is not held up.
    It reads only regular files of the recorded size and status inside the destination, and
    skips any entry it cannot use (the sync decides about those, and raises what it must)."""

    def __init__(
        self,
        dest: Path,
        previous: dict[str, dict[str, Any]],
        verify_every: int,
        turn: int,
        until: Callable[[], bool],
        pause: GcPause,
    ) -> None:
        self._md5: dict[str, tuple[int, list[int], str]] = {}
        base = os.fspath(dest)
        inside = _Inside(os.path.realpath(base))
        for old in previous.values():
            path = old["path"]
            if until():
                return
            if not isinstance(path, str) or _slice(path, verify_every) != turn:
                continue
            target = f"{base}/{path}"
            try:
                st = _lstat(target)
                if (
                    st is None
                    or not stat.S_ISREG(st.st_mode)
                    or st.st_size != old.get("size")
                    or old.get("stat") != _status(st)
                ):
                    continue
                if inside(target.rpartition("/")[0]):
                    with pause.resumed():
                        self._md5[path] = (st.st_size, _status(st), file_md5(Path(target)))
            except (OSError, ValueError):  # unreadable, a NUL or an unencodable character
                continue

    def md5(self, path: str, st: os.stat_result) -> str | None:
        """The file's MD5 if it was surveyed at the status ``st`` shows."""
        size, status, md5 = self._md5.get(path, (-1, [], ""))
        return md5 if size == st.st_size and status == _status(st) else None


def sync_to_directory(
    container: ContainerClient,
    prefix: str,
    dest: Path,
    workers: int = 32,
    listing: list[PinnedBlob] | None = None,
    retry: Retry | None = None,
    verify_every: int = VERIFY_EVERY,
) -> SyncReport:
    """Mirror the blobs under ``prefix`` into ``dest``; see the module docstring.

    ``listing``: the data gate's pinned listing, staged exactly (the flow always passes it);
    without it the container is listed now (benchmarks, a standalone sync). ``workers``:
    requests in flight at once. ``retry``: how hard each download tries. ``verify_every``:
    each file the manifest vouches for is read again once in this many syncs (1: every time).
    """
    if verify_every < 1:
        raise ValueError(f"verify_every must be 1 or more, not {verify_every}")
    prefix = prefix.strip("/")
    pinned = listing is not None
    # The listing's parse and the plan below allocate an entry per file, none of them in a
    # cycle: without the collector walking the whole process each time (staging.blob). Waits
    # and file reads step out of the pause.
    with paused_gc() as pause:
        with ThreadPoolExecutor(1, thread_name_prefix="listing") as listing_pool:
            listed = None if pinned else listing_pool.submit(list_pinned, container, prefix)
            # While the listing is on its way (a re-sync's own work is a fraction of its wait):
            # what the last sync left, and the files whose turn it is to be read.
            previous, syncs, previous_boot, failed_before = previous_sync(dest)
            syncs += 1
            turn = syncs % verify_every  # this sync re-reads the files whose path hashes to it
            arrived = listed.done if listed else lambda: True  # a given listing: no survey
            ahead = _Survey(dest, previous, verify_every, turn, arrived, pause)
            if listed:
                with pause.resumed():  # the service's wait
                    listing = listed.result()
        assert listing is not None
        planned = _plan(listing, prefix)  # every name checked before anything is written

        def read(target: str) -> str:
            with pause.resumed():  # reads can take long: the collector runs meanwhile
                return file_md5(Path(target))

        dest.mkdir(parents=True, exist_ok=True)
        root = dest.resolve()
        boot = boot_id()
        same_boot = boot is not None and previous_boot == boot
        # Files an earlier sync of this boot left unflushed: once the kernel has had time to write
        # them back, one flush (which then finds little to write) makes them the disk's. Not after
        # a flush of this boot reported a write error: the kernel reports it once, so a later
        # flush that succeeds does not mean those pages were stored.
        flush_failed = same_boot and failed_before
        unflushed = same_boot and any(e.get("unflushed") for e in previous.values())
        flushed = False
        if unflushed and not flush_failed and written_back(dest / MANIFEST):
            with pause.resumed():
                flushed = flush_filesystem(dest)
            flush_failed = not flushed
        # Whatever the folder holds that the listing does not name goes before anything is
        # written, whoever left it. Decided on destination paths, not blob names: a new version
        # under a new prefix renames every blob but lands on the same paths, which must stay.
        by_path = {str(old["path"]): (n, old) for n, old in previous.items()}
        report = SyncReport(total_files=len(planned))
        for path in _remove_unlisted(dest, planned):
            if path in by_path:
                report.deleted.append(by_path[path][0])
            else:
                report.removed.append(path)
        todo: list[Download] = []
        entries: dict[str, dict[str, Any]] = {}
        files: dict[str, dict[str, Any]] = {}
        fresh: list[str] = []  # files whose bytes this boot may hold only in memory
        inside = _Inside(os.fspath(root))
        base = os.fspath(dest)
        for name, (blob, path) in planned.items():
            target = f"{base}/{path}"
            folder = target.rpartition("/")[0]
            within = inside.seen.get(folder)
            first = within is None
            if first:
                within = inside(folder)
            st = _lstat(target)  # one call answers every question
            if not within or (st and stat.S_ISLNK(st.st_mode)):
                raise UnsafeBlobNameError(f"blob {name!r} rejected: resolves outside {dest}")
            entry: dict[str, Any] = {
                "path": path,
                "etag": blob.etag,
                "size": blob.size,
                "md5": blob.md5,
            }
            # What the last sync wrote on this path: this blob, or an earlier version's blob of
            # another name whose content may well be the same.
            old_name, old = by_path.get(path, (None, None))
            same_size = st is not None and stat.S_ISREG(st.st_mode) and st.st_size == blob.size
            if (
                same_size
                and old_name
                and old is not None
                and _same_content(name, blob, old_name, old)
            ):
                assert st is not None
                md5 = old.get("md5") or blob.md5
                recorded = old.get("stat")
                # Written unflushed under another boot: the machine has restarted since, maybe
                # crashed with the bytes still in its memory. Read back, they are the disk's.
                kept = (
                    {"unflushed": True}
                    if old.get("unflushed") and same_boot and not flushed
                    else {}
                )
                survived = same_boot or not old.get("unflushed")
                if recorded == _status(st) and survived and _slice(path, verify_every) != turn:
                    report.skipped += 1  # trusted: not read
                    entry["md5"], entry["stat"] = md5, recorded
                    files[name] = entry | kept if kept else entry
                    continue
                # Its turn to be read, its status is not the one staging left (changed behind
                # the manifest's back, or a manifest older than the status record), or it may
                # have been lost in a crash.
                report.verified += 1
                if (ahead.md5(path, st) or read(target)) == md5:
                    report.skipped += 1
                    files[name] = {**entry, "md5": md5, "stat": _status(st), **kept}
                    if recorded != _status(st):  # rewritten since: maybe not on the disk yet
                        fresh.append(name)
                    continue
                report.repaired.append(name)
            elif old is None and same_size and blob.md5:
                # Not in the manifest, yet maybe the blob's bytes: written by a sync cut short
                # before its first manifest (or the manifest lost). A path the manifest holds at
                # another ETag is downloaded again, whatever its MD5: a blob rewritten with its old
                # Content-MD5 kept (Put Block List stores it unchecked) would match the old bytes.
                assert st is not None
                report.verified += 1
                if read(target) == blob.md5:
                    report.skipped += 1
                    files[name] = {**entry, "stat": _status(st)}
                    fresh.append(name)  # written by a sync cut short: maybe not on the disk yet
                    continue
            todo.append(Download(blob, Path(target)))
            entries[name] = entry

    def landed(job: Download, md5: str, st: os.stat_result) -> None:
        files[job.blob.name] = {**entries[job.blob.name], "md5": md5, "stat": _status(st)}
        report.downloaded.append(job.blob.name)
        fresh.append(job.blob.name)
        report.bytes_downloaded += job.blob.size

    try:
        if todo:
            download_all(object_store(container, retry), todo, pinned, workers, landed, retry)
    finally:
        # What did arrive is recorded. A sync killed before this point (SIGKILL skips it)
        # leaves files no manifest names: the next one keeps those its listing names, checked
        # by their MD5, and deletes the others with the temporary files. Before the manifest
        # vouches for what was written, it is made safe from a crash, or marked as trusted
        # under this boot only (staging.durability). A file lost to a crash before this point
        # is not in the manifest and is checked again.
        settled = settle(dest, boot) if fresh else None
        if settled in ("unflushed", "failed"):
            for name in fresh:
                files[name]["unflushed"] = True
        if settled == "failed" or (flush_failed and not flushed):
            flush_failed = True
            log.warning(
                "staging: the file system holding %s reported a write error while flushing "
                "staged files; they are read again after the next restart",
                dest,
            )
        _write_manifest(dest, prefix, files, report, syncs, boot, flush_failed)
    return report


def stage(
    container: ContainerClient,
    prefix: str,
    dest: Path,
    pack_image_size: int,
    workers: int = 32,
    listing: list[PinnedBlob] | None = None,
) -> dict[str, Any]:
    """The staging step, wherever it runs: sync (exactly ``listing`` when given), then pack
    shards of ``pack_image_size`` pixels a side, the trainer's input size (0: no packing, and
    an older pack is removed). Returns the report."""
    report = sync_to_directory(container, prefix, dest, workers=workers, listing=listing)
    result = report.as_dict()
    # The packer needs torch (about 2 s to import): imported only to pack, to check a pack
    # that is not plainly current, or to remove one. After a sync the manifest vouches for
    # every file in the folder, so its version is the one a current pack records.
    if pack_image_size:
        current = current_pack(dest, pack_image_size, report.data_version)
        if current is None:
            from imagedata.shards import pack_shards

            current = pack_shards(dest, pack_image_size)
        result["shards"] = current.as_dict()
        return result
    if (dest / SHARD_DIR).is_dir():
        from imagedata.shards import remove_shards

        remove_shards(dest)
    result["shards"] = {"action": "not packed", "reason": "nfs.shards is off"}
    return result


def _write_manifest(
    dest: Path,
    prefix: str,
    files: dict[str, dict[str, Any]],
    report: SyncReport,
    syncs: int,
    boot: str | None,
    flush_failed: bool,
) -> None:
    report.data_version = write_manifest(dest, prefix, files, syncs, boot, flush_failed)
    report.manifest = str(dest / MANIFEST)
