"""When the manifest may vouch for a staged file by its status alone: when its bytes would
survive a crash, or when no crash can have happened since they were written.

A re-sync trusts a file the manifest vouches for without reading it. That is sound only if the
bytes behind the recorded status are the ones staged; a crash of the machine between the
write and its flush to the disk can leave a file of the right size (and times) whose content
is lost. Three cases, by the destination's file system:

* NFS: the client flushes a file to the server and commits it when the file is closed (close-
  to-open consistency), and the manifest is written after every staged file is closed;
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

A flush that reports a write error (the disk failed to store a page, which stays in the
cache, so reads under this boot still see the staged bytes) keeps the marks, and the manifest
records the failure for the rest of the boot: the kernel reports such an error once, so a
later flush that succeeds does not mean the failed pages were stored.

Limits: "a crash is a reboot" does not hold for a file system lost while the machine runs (a
disk detached, a file system shut down or remounted read-only after an I/O error): its marked
files are trusted under the same boot. A folder staged both on the machine that exports it
and through NFS by another within the write-back window is read back from the exporter's
cache, not its disk. Neither is how the pipeline stages (Batch nodes write through NFS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from pathlib import Path
from typing import Literal

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # a new random id at every boot
MOUNTINFO = Path("/proc/self/mountinfo")
VM = Path("/proc/sys/vm")  # the kernel's write-back timing: dirty_expire_centisecs and others
COMMITTED_AT_CLOSE = frozenset({"nfs", "nfs4"})
# What :func:`settle` did with the files just written.
Settled = Literal["committed", "unflushed", "flushed", "failed"]
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
    table: of the mounts whose point holds it, those of its device (a mount hidden by one over
    a parent folder has another), the innermost, the last one mounted when several are; None
    when the table cannot be read (the caller then flushes)."""
    try:
        target = os.path.realpath(path)
        dev = os.stat(target).st_dev
        device = f"{os.major(dev)}:{os.minor(dev)}"
        lines = os.fsdecode(MOUNTINFO.read_bytes()).splitlines()
    except (OSError, ValueError):
        return None
    holding: list[tuple[int, bool, str]] = []  # (mount point length, same device, type)
    for line in lines:
        fields, sep, rest = line.partition(" - ")
        parts = fields.split()
        if not sep or len(parts) < 5 or not rest.split():
            continue
        point = _unescape(parts[4])
        if target == point or target.startswith(point.rstrip("/") + "/"):
            holding.append((len(point), parts[2] == device, rest.split()[0]))
    same = [h for h in holding if h[1]] or holding  # no device matches: btrfs subvolumes
    best = max((h[0] for h in same), default=-1)
    kinds = [h[2] for h in same if h[0] == best]
    return kinds[-1] if kinds else None


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


def settle(dest: Path, boot: str | None) -> Settled:
    """Make the files just written under ``dest`` safe for the manifest to vouch for. Returns
    ``committed`` (NFS: closed is stored), ``unflushed`` (a local disk: trusted under ``boot``
    only), ``flushed``, or ``failed`` (the flush reported a write error)."""
    kind = filesystem_type(dest)
    if kind in COMMITTED_AT_CLOSE:
        return "committed"
    if kind in LOCAL_DISKS and boot:
        return "unflushed"
    return "flushed" if flush_filesystem(dest) else "failed"
