"""When the manifest may vouch for a staged file by its status alone: when its bytes would
survive a crash, or when no crash can have happened since they were written.

A re-sync trusts a file the manifest vouches for without reading it. That is sound only if the
bytes behind the recorded status are the ones staged; a crash of the machine between the
write and its flush to the disk can leave a file of the right size (and times) whose content
is lost. Three cases, by the destination's file system:

* NFS: the client flushes a file to the server and commits it when the file is closed (close-
  to-open consistency), so every staged file is on the server's storage once it has its name;
  nothing more to wait for, and other nodes may trust the manifest.
* a local disk (ext4, XFS, Btrfs, ...): the bytes sit in this machine's page cache until the
  kernel writes them back (within ``vm.dirty_expire_centisecs``, 30 s by default). A
  ``syncfs`` before the manifest would make every sync wait for the disk, and for whatever
  else is dirty on that file system (another program's files, a checkpoint being written):
  the flush is of the whole file system, a per-file fsync being a journal commit per file.
  Instead the manifest records the machine's boot (the kernel's ``boot_id``) and marks the
  files written unflushed. A crash is a reboot: a sync under another boot reads the marked
  files again (then they are the disk's, read back from it) before trusting them. A sync
  under the same boot, once the kernel has had time to write them back, flushes (by then
  little is left to write) and drops the marks, so a restart re-reads only what the last
  recent syncs wrote.
* anything else (SMB, FUSE mounts, an unknown type, no boot id): one ``syncfs`` before the
  manifest, as every sync did before.

What a flush at once would add on a local disk and this does not: a write-back error
reported by the disk before the manifest is written (the page stays in the cache, so reads
see the staged bytes until it is evicted; the deferred flush reports it and the marks stay).
The by-turns re-read of ``staging.sync`` reads every file again within ``verify_every`` syncs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # a new random id at every boot
MOUNTINFO = Path("/proc/self/mountinfo")
VM = Path("/proc/sys/vm")  # the kernel's write-back timing: dirty_expire_centisecs and others
COMMITTED_AT_CLOSE = frozenset({"nfs", "nfs4"})
LOCAL_DISKS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "jfs", "tmpfs", "overlay"}
)


def boot_id() -> str | None:
    """This boot's id, or None where the kernel gives none."""
    try:
        value = BOOT_ID.read_text().strip()
    except OSError:
        return None
    return value or None


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    for code in ("040", "011", "012", "134"):
        field = field.replace(f"\\{code}", chr(int(code, 8)))
    return field


def filesystem_type(path: Path) -> str | None:
    """The type of the file system ``path`` is on (``ext4``, ``nfs4``...), from the mount
    table: the mount point that holds it, the last one mounted when several do."""
    target = os.path.realpath(path)
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:
        return None
    best, kind = -1, None
    for line in lines:
        fields, sep, rest = line.partition(" - ")
        parts = fields.split()
        if not sep or len(parts) < 5 or not rest.split():
            continue
        point = _unescape(parts[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, kind = len(point), rest.split()[0]
    return kind


def flush_filesystem(path: Path) -> bool:
    """Flush what was written to the file system holding ``path`` (``syncfs``): one flush for
    all files instead of an fsync per file, and only this file system, not every disk of the
    machine as ``sync`` would. False when the file system reported a write error (then
    ``sync`` is called, which reports none)."""
    libc_name = ctypes.util.find_library("c")
    syncfs = getattr(ctypes.CDLL(libc_name, use_errno=True), "syncfs", None) if libc_name else None
    if syncfs is None:
        os.sync()
        return True
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if syncfs(fd) != 0:
            os.sync()
            return False
    finally:
        os.close(fd)
    return True


def _centiseconds(name: str, default: int) -> int:
    try:
        return int((VM / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def written_back(path: Path) -> bool:
    """Whether the kernel has had time to write back what was written before ``path`` was
    last modified: its age is past the age at which dirty pages are written, plus one pass
    of the flusher. A flush then finds little or nothing left to write."""
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return False
    window = _centiseconds("dirty_expire_centisecs", 3000)
    window += _centiseconds("dirty_writeback_centisecs", 500)
    return age * 100 > window


def settle(dest: Path, boot: str | None) -> bool:
    """Make the files just written under ``dest`` safe for the manifest to vouch for; whether
    they are left unflushed, to be trusted only under ``boot`` (this boot's id)."""
    kind = filesystem_type(dest)
    if kind in COMMITTED_AT_CLOSE:
        return False
    if kind in LOCAL_DISKS and boot:
        return True
    flush_filesystem(dest)
    return False
