"""What a crash may have lost, and what a re-sync trusts: staging against Azurite, with the
kernel's boot id and mount table read from files a test can write (a reboot and an NFS mount
cannot be made here)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient

from backends.blob import API_VERSION
from imagedata.staged_folder import MANIFEST
from staging import durability
from staging.durability import filesystem_type
from staging.sync import sync_to_directory

FILES = 12


@pytest.fixture
def container(azurite: str) -> ContainerClient:
    client = ContainerClient.from_connection_string(
        azurite, f"durable-{uuid.uuid4().hex[:12]}", api_version=API_VERSION
    )
    client.create_container()
    for i in range(FILES):
        client.upload_blob(f"ds/train/c{i % 3}/{i}.png", f"image-{i}".encode() * 40)
    return client


def _boot(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, boot: str) -> None:
    """The machine's boot id, as the kernel gives it (a new one after every restart)."""
    path = tmp_path / f"boot_id-{boot}"
    path.write_text(f"{boot}\n")
    monkeypatch.setattr(durability, "BOOT_ID", path)


def _no_flush_for_an_hour(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Kernel write-back times under which no sync of a test counts as written back."""
    vm = tmp_path / "vm"
    vm.mkdir()
    (vm / "dirty_expire_centisecs").write_text("360000\n")
    monkeypatch.setattr(durability, "VM", vm)


def _mounted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: Path, kind: str) -> None:
    """A mount table where ``where`` is a mount of type ``kind``, over this machine's own."""
    table = tmp_path / f"mountinfo-{kind}"
    own = Path("/proc/self/mountinfo").read_text()
    point = str(where.resolve()).replace(" ", "\\040")
    dev = os.stat(where).st_dev  # a mounted folder is on its mount's device
    device = f"{os.major(dev)}:{os.minor(dev)}"
    table.write_text(f"{own}999 1 {device} / {point} rw,relatime - {kind} server:/export rw\n")
    monkeypatch.setattr(durability, "MOUNTINFO", table)


def _manifest(dest: Path) -> dict[str, object]:
    data = json.loads((dest / MANIFEST).read_text())
    assert isinstance(data, dict)
    return data


def test_files_written_unflushed_are_read_again_after_a_restart(
    container: ContainerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a local disk nothing is flushed: the manifest names the boot and marks the files.
    Under the same boot a re-sync reads none of them; under the next one it reads each once
    (then they are the disk's) and trusts them from then on, through later restarts too."""
    _no_flush_for_an_hour(monkeypatch, tmp_path)
    _boot(monkeypatch, tmp_path, "boot-a")
    dest = tmp_path / "data"
    first = sync_to_directory(container, "ds", dest, verify_every=10**6)
    assert len(first.downloaded) == FILES
    manifest = _manifest(dest)
    assert manifest["boot"] == "boot-a"
    files = manifest["files"]
    assert isinstance(files, dict) and all(e["unflushed"] is True for e in files.values())

    same = sync_to_directory(container, "ds", dest, verify_every=10**6)
    assert (same.verified, same.downloaded) == (0, [])

    _boot(monkeypatch, tmp_path, "boot-b")
    restarted = sync_to_directory(container, "ds", dest, verify_every=10**6)
    assert (restarted.verified, restarted.skipped, restarted.downloaded) == (FILES, FILES, [])
    files = _manifest(dest)["files"]
    assert isinstance(files, dict) and not any("unflushed" in e for e in files.values())

    for boot in ("boot-b", "boot-c"):
        _boot(monkeypatch, tmp_path, boot)
        later = sync_to_directory(container, "ds", dest, verify_every=10**6)
        assert (later.verified, later.downloaded) == (0, [])


def test_once_written_back_the_next_sync_flushes_and_a_restart_reads_nothing(
    container: ContainerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel writes dirty pages back within its expiry (set here as Linux's defaults,
    30 s plus a 5 s flusher pass). A sync soon after keeps the marks; one after that window
    flushes, which then finds little to write, and drops them: a restart then reads none of
    the files."""
    vm = tmp_path / "vm"
    vm.mkdir()
    (vm / "dirty_expire_centisecs").write_text("3000\n")
    (vm / "dirty_writeback_centisecs").write_text("500\n")
    monkeypatch.setattr(durability, "VM", vm)
    _boot(monkeypatch, tmp_path, "boot-a")
    dest = tmp_path / "data"
    sync_to_directory(container, "ds", dest, verify_every=10**6)
    soon = sync_to_directory(container, "ds", dest, verify_every=10**6)
    assert soon.verified == 0
    files = _manifest(dest)["files"]
    assert isinstance(files, dict) and all(e.get("unflushed") is True for e in files.values())

    an_hour_ago = time.time() - 3600
    os.utime(dest / MANIFEST, (an_hour_ago, an_hour_ago))
    later = sync_to_directory(container, "ds", dest, verify_every=10**6)
    assert (later.verified, later.downloaded) == (0, [])
    files = _manifest(dest)["files"]
    assert isinstance(files, dict) and not any("unflushed" in e for e in files.values())

    _boot(monkeypatch, tmp_path, "boot-b")
    restarted = sync_to_directory(container, "ds", dest, verify_every=10**6)
    assert (restarted.verified, restarted.downloaded) == (0, [])


def test_files_adopted_or_rewritten_without_a_flush_are_marked_too(
    container: ContainerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files a sync did not download may still be in memory only: those a cut-short sync
    wrote before any manifest (adopted by their MD5), and one rewritten with the same bytes
    behind the manifest's back. Each is marked, and read again after a restart."""
    _no_flush_for_an_hour(monkeypatch, tmp_path)
    _boot(monkeypatch, tmp_path, "boot-a")
    dest = tmp_path / "data"
    sync_to_directory(container, "ds", dest, verify_every=10**6)
    (dest / MANIFEST).unlink()  # as if cut short before its first manifest
    adopted = sync_to_directory(container, "ds", dest, verify_every=10**6)
    assert (adopted.verified, adopted.downloaded) == (FILES, [])
    files = _manifest(dest)["files"]
    assert isinstance(files, dict) and all(e.get("unflushed") is True for e in files.values())

    _boot(monkeypatch, tmp_path, "boot-b")
    assert sync_to_directory(container, "ds", dest, verify_every=10**6).verified == FILES
    rewritten = dest / "train" / "c2" / "5.png"
    rewritten.write_bytes(rewritten.read_bytes())
    report = sync_to_directory(container, "ds", dest, verify_every=10**6)
    assert (report.verified, report.downloaded) == (1, [])
    files = _manifest(dest)["files"]
    assert isinstance(files, dict)
    assert [n for n, e in files.items() if e.get("unflushed")] == ["ds/train/c2/5.png"]

    _boot(monkeypatch, tmp_path, "boot-c")
    assert sync_to_directory(container, "ds", dest, verify_every=10**6).verified == 1


def test_bytes_lost_behind_a_recorded_status_are_found_after_a_restart(
    container: ContainerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a crash can leave: a file of the recorded size and status whose bytes never
    reached the disk (zeros here; the manifest given the damaged file's status, as if it had
    been recorded so). Under the next boot the sync reads it, finds it wrong and stages it
    again; every other file is read and kept."""
    _boot(monkeypatch, tmp_path, "boot-a")
    dest = tmp_path / "data"
    sync_to_directory(container, "ds", dest, verify_every=10**6)
    lost = dest / "train" / "c1" / "4.png"
    size = lost.stat().st_size
    with open(lost, "r+b") as fh:
        fh.write(bytes(size))
    manifest = _manifest(dest)
    files = manifest["files"]
    assert isinstance(files, dict)
    st = os.stat(lost)
    files["ds/train/c1/4.png"]["stat"] = [st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    (dest / MANIFEST).write_text(json.dumps(manifest))

    _boot(monkeypatch, tmp_path, "boot-b")
    report = sync_to_directory(container, "ds", dest, verify_every=10**6)
    assert report.repaired == ["ds/train/c1/4.png"]
    assert report.downloaded == ["ds/train/c1/4.png"]
    assert report.verified == FILES
    assert lost.read_bytes() == b"image-4" * 40


def test_on_nfs_files_are_trusted_under_any_boot(
    container: ContainerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS commits a file to the server when it is closed: nothing is marked, and a node that
    booted elsewhere (another run's pool) trusts the manifest without reading a file."""
    dest = tmp_path / "nfs share" / "data"
    dest.mkdir(parents=True)
    _mounted(monkeypatch, tmp_path, dest.parent, "nfs4")
    _boot(monkeypatch, tmp_path, "node-1")
    sync_to_directory(container, "ds", dest, verify_every=10**6)
    files = _manifest(dest)["files"]
    assert isinstance(files, dict) and not any("unflushed" in e for e in files.values())
    _boot(monkeypatch, tmp_path, "node-2")
    report = sync_to_directory(container, "ds", dest, verify_every=10**6)
    assert (report.verified, report.downloaded) == (0, [])


@pytest.mark.parametrize("kind", ["fuse.blobfuse2", "cifs"])
def test_other_file_systems_and_no_boot_id_are_flushed_and_trusted(
    container: ContainerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Where neither rule holds (a FUSE or SMB mount, or a kernel that gives no boot id) the
    files are flushed before the manifest is written, which then marks none of them."""
    dest = tmp_path / "mounted" / "data"
    dest.mkdir(parents=True)
    _mounted(monkeypatch, tmp_path, dest.parent, kind)
    _boot(monkeypatch, tmp_path, "boot-a")
    sync_to_directory(container, "ds", dest, verify_every=10**6)
    files = _manifest(dest)["files"]
    assert isinstance(files, dict) and not any("unflushed" in e for e in files.values())

    local = tmp_path / "local"
    monkeypatch.setattr(durability, "BOOT_ID", tmp_path / "no-such-file")
    sync_to_directory(container, "ds", local, verify_every=10**6)
    manifest = _manifest(local)
    files = manifest["files"]
    assert "boot" not in manifest
    assert isinstance(files, dict) and not any("unflushed" in e for e in files.values())


@pytest.mark.processes
def test_the_file_system_type_is_the_one_findmnt_names(tmp_path: Path) -> None:
    """Against util-linux's own reading of the mount table, for folders on this machine."""
    for where in (tmp_path, Path("/proc/self"), Path("/dev/shm"), Path("/")):
        if not where.exists():
            continue
        named = subprocess.run(
            ["findmnt", "-n", "-o", "FSTYPE", "--target", str(where)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[-1]
        assert filesystem_type(where) == named, where


def test_the_innermost_and_last_mount_holds_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nested mounts, a mount point with a space (written escaped, as the kernel does), a
    mount over another at the same point (the last one shows), a sibling whose name only
    starts like the path's, and a mount hidden by one made later over its parent folder (the
    path is on the later one's device)."""
    for folder in ("srv/nfs share/data", "srv/nfs/x", "srv/nfsother", "etc", "hid/a/b/data"):
        (tmp_path / folder).mkdir(parents=True)
    dev = os.stat(tmp_path).st_dev
    here = f"{os.major(dev)}:{os.minor(dev)}"
    root = str(tmp_path.resolve())
    table = tmp_path / "mountinfo"
    # Every folder here is on tmp_path's device, as each would be on its mount's: all but the
    # hidden NFS mount (mounted first, then covered by the mount over its parent) name it.
    table.write_text(
        f"1 0 {here} / / rw - ext4 /dev/vda rw\n"
        f"2 1 {here} / {root}/srv rw - xfs /dev/vdb rw\n"
        f"3 2 {here} / {root}/srv/nfs\\040share rw - nfs4 server:/a rw\n"
        f"4 2 {here} / {root}/srv/nfs\\040share rw shared:9 - fuse.blobfuse2 blobfuse2 rw\n"
        f"5 2 {here} / {root}/srv/nfs rw - tmpfs tmpfs rw\n"
        f"6 1 0:44 / {root}/hid/a/b rw - nfs4 server:/b rw\n"
        f"7 1 {here} / {root}/hid rw - btrfs /dev/vdc rw\n"
    )
    monkeypatch.setattr(durability, "MOUNTINFO", table)
    assert filesystem_type(tmp_path / "srv" / "nfs share" / "data") == "fuse.blobfuse2"
    assert filesystem_type(tmp_path / "srv" / "nfs" / "x") == "tmpfs"
    assert filesystem_type(tmp_path / "srv" / "nfsother") == "xfs"
    assert filesystem_type(tmp_path / "etc") == "ext4"
    assert filesystem_type(tmp_path / "hid" / "a" / "b" / "data") == "btrfs"


def test_an_unreadable_mount_table_means_a_flush(
    container: ContainerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mount point that is not UTF-8 in the table is read as the file system names it; a
    table that cannot be read at all gives no type, and the sync flushes and marks nothing."""
    table = tmp_path / "mountinfo"
    own = Path("/proc/self/mountinfo").read_bytes()
    table.write_bytes(own + b"998 1 0:98 / /mnt/caf\xe9 rw - ext4 /dev/vdz rw\n")
    expected = filesystem_type(tmp_path)
    monkeypatch.setattr(durability, "MOUNTINFO", table)
    assert expected is not None and filesystem_type(tmp_path) == expected
    monkeypatch.setattr(durability, "MOUNTINFO", tmp_path / "no-such-table")
    assert filesystem_type(tmp_path) is None
    _boot(monkeypatch, tmp_path, "boot-a")
    dest = tmp_path / "data"
    sync_to_directory(container, "ds", dest, verify_every=10**6)
    files = _manifest(dest)["files"]
    assert isinstance(files, dict) and not any("unflushed" in e for e in files.values())
