"""Blob -> NFS staging against Azurite: incremental, verified, atomic and path-safe."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

import pytest
from azure.storage.blob import ContainerClient, ContainerSasPermissions, generate_container_sas

from backends.blob import API_VERSION
from imagedata.staged_folder import MANIFEST
from staging.blob import Retry, data_container
from staging.listing import ChangedSinceGateError, PinnedBlob, pin
from staging.sync import UnsafeBlobNameError, safe_relative_path, stage, sync_to_directory
from staging.transfer import IntegrityError, TransferError, redact
from tests.conftest import child_env


@pytest.fixture
def container(azurite: str) -> ContainerClient:
    client = ContainerClient.from_connection_string(
        azurite, f"stage-{uuid.uuid4().hex[:12]}", api_version=API_VERSION
    )
    client.create_container()
    for i in range(30):
        client.upload_blob(f"ds/train/c{i % 3}/{i}.png", f"image-{i}".encode() * 50)
    return client


def test_resync_downloads_only_what_changed(container: ContainerClient, tmp_path: Path) -> None:
    dest = tmp_path / "nfs" / "data"
    first = sync_to_directory(container, "ds", dest)
    assert len(first.downloaded) == 30 and first.skipped == 0
    assert (dest / "train" / "c1" / "4.png").read_bytes() == b"image-4" * 50

    again = sync_to_directory(container, "ds", dest)
    assert again.downloaded == [] and again.skipped == 30
    assert again.data_version == first.data_version

    container.upload_blob("ds/train/c1/4.png", b"changed", overwrite=True)
    container.delete_blob("ds/train/c2/5.png")
    changed = sync_to_directory(container, "ds", dest)
    assert changed.downloaded == ["ds/train/c1/4.png"]
    assert changed.deleted == ["ds/train/c2/5.png"]
    assert (dest / "train" / "c1" / "4.png").read_bytes() == b"changed"
    assert not (dest / "train" / "c2" / "5.png").exists()
    assert changed.data_version != first.data_version
    leftovers = [p for p in dest.rglob("*.part")]
    assert leftovers == []  # no temporary file survives
    assert (dest / MANIFEST).is_file()


def test_lost_manifest_does_not_redownload_intact_files(
    container: ContainerClient, tmp_path: Path
) -> None:
    dest = tmp_path / "data"
    sync_to_directory(container, "ds", dest)
    (dest / MANIFEST).unlink()
    report = sync_to_directory(container, "ds", dest)
    assert report.downloaded == [] and report.skipped == report.verified == 30


# Azurite refuses names with literal ".." segments, but stores backslashes as slashes, so the
# first name below becomes "ds/a/../../escape.png" in the container: a real traversal name.
@pytest.mark.parametrize(
    ("name", "prefix"),
    [("ds/a\\..\\..\\escape.png", "ds"), ("ds/train//x.png", "ds"), ("/abs.png", "")],
)
def test_unsafe_blob_rejected_and_nothing_written(
    azurite: str, tmp_path: Path, name: str, prefix: str
) -> None:
    client = ContainerClient.from_connection_string(
        azurite, f"evil-{uuid.uuid4().hex[:12]}", api_version=API_VERSION
    )
    client.create_container()
    client.upload_blob("ds/train/ok/1.png", b"fine")
    client.upload_blob(name, b"payload")
    stored = sorted(b.name for b in client.list_blobs())
    assert len(stored) == 2
    dest = tmp_path / "box" / "data"
    with pytest.raises(UnsafeBlobNameError, match="rejected"):
        sync_to_directory(client, prefix, dest)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written == []  # not even the harmless blob: names are checked before any download


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("p/a/b.png", True),
        ("p/ünïcode/ß.png", True),
        ("p/../x", False),
        ("p//x", False),
        ("p/./x", False),
        ("p/", False),
        ("p/C:/x", False),
        ("p/" + "x" * 1100, False),
        ("p/a/.staging-manifest.json", False),
        ("p/a\x00b", False),
    ],
)
def test_safe_relative_path(name: str, ok: bool) -> None:
    if ok:
        assert str(safe_relative_path(name, "p")) == name[2:]
    else:
        with pytest.raises(UnsafeBlobNameError, match=r"blob .* rejected"):
            safe_relative_path(name, "p")


def _pinned(container: ContainerClient, prefix: str = "ds") -> list[PinnedBlob]:
    return [pin(b) for b in container.list_blobs(name_starts_with=f"{prefix}/")]


def test_wrong_bytes_are_refused_and_never_renamed(
    container: ContainerClient, tmp_path: Path
) -> None:
    """A blob whose bytes do not match the MD5 the listing holds fails the sync naming the blob;
    nothing lands under its final name and no temporary file stays behind."""
    listing = _pinned(container)
    bad = next(b for b in listing if b.name == "ds/train/c1/4.png")
    wrong = base64.b64encode(hashlib.md5(b"other bytes").digest()).decode()
    assert bad.md5 not in (None, wrong)  # Azurite stores an MD5 for a one-shot upload
    listing = [b if b is not bad else replace(b, md5=wrong) for b in listing]
    dest = tmp_path / "data"
    with pytest.raises(IntegrityError, match=r"ds/train/c1/4\.png.*MD5"):
        sync_to_directory(container, "ds", dest, listing=listing)
    assert not (dest / "train" / "c1" / "4.png").exists()
    assert list(dest.rglob("*.part")) == []


def test_no_queued_download_starts_after_a_hard_failure(azurite: str, tmp_path: Path) -> None:
    """A blob changed since the gate (a refusal no retry can fix) stops the sync: the downloads
    already in flight finish and are recorded, no queued one starts."""
    client = ContainerClient.from_connection_string(
        azurite, f"stop-{uuid.uuid4().hex[:12]}", api_version=API_VERSION
    )
    client.create_container()
    for i in range(400):
        client.upload_blob(f"ds/{i:04d}.bin", f"blob-{i}".encode() * 20)
    listing = _pinned(client)
    first = listing[0]  # staged first: the listing's order is the download order
    client.upload_blob(first.name, b"changed after the gate", overwrite=True)
    dest = tmp_path / "data"
    with pytest.raises(ChangedSinceGateError, match=r"ds/0000\.bin"):
        sync_to_directory(client, "ds", dest, workers=2, listing=listing)
    landed = sorted(p.name for p in dest.glob("*.bin"))
    assert "0000.bin" not in landed
    assert len(landed) < len(listing) // 4, "queued downloads went on after the refusal"
    manifest = json.loads((dest / MANIFEST).read_text())
    assert sorted(Path(f["path"]).name for f in manifest["files"].values()) == landed


def test_a_refused_sas_is_reported_without_its_signature(
    container: ContainerClient, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A SAS that may list but not read: the failure names the blob and the refusal, and
    neither the exception nor the log carries the signature."""
    sas = generate_container_sas(
        container.account_name,
        container.container_name,
        account_key=container.credential.account_key,
        permission=ContainerSasPermissions(list=True),
        expiry=datetime.now(UTC) + timedelta(hours=1),
    )
    signature = parse_qs(sas)["sig"][0]
    listing_only = data_container(f"{container.url}?{sas}")
    caplog.set_level(logging.INFO)  # what a run logs; urllib3 prints URLs at DEBUG
    with pytest.raises(TransferError, match=r"blob 'ds/train/c\d/\d+\.png'") as refused:
        sync_to_directory(listing_only, "ds", tmp_path / "data", retry=Retry(first_wait=0.01))
    for text in (str(refused.value), repr(refused.value), caplog.text):
        assert signature not in text and quote(signature, safe="") not in text


def test_http_request_lines_logged_at_debug_carry_no_signature(
    container: ContainerClient,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user who turns DEBUG on for a run: urllib3, under the storage SDK, logs every
    request line with its query. Through a SAS URL (the node's staging) and through a
    connection string holding a SAS (the orchestrator's clients), no signature reaches a log;
    the request lines are still there."""
    from backends.blob import container_client
    from core.config import BlobLocation

    sas = generate_container_sas(
        container.account_name,
        container.container_name,
        account_key=container.credential.account_key,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.now(UTC) + timedelta(hours=1),
    )
    signature = parse_qs(sas)["sig"][0]
    caplog.set_level(logging.DEBUG)
    report = sync_to_directory(data_container(f"{container.url}?{sas}"), "ds", tmp_path / "d")
    assert len(report.downloaded) == 30
    endpoint = container.url.rsplit("/", 1)[0]
    monkeypatch.setenv(
        "SAS_ONLY_CONNECTION", f"BlobEndpoint={endpoint};SharedAccessSignature={sas}"
    )
    location = BlobLocation(
        container=container.container_name, prefix="ds", connection_string_env="SAS_ONLY_CONNECTION"
    )
    assert len(list(container_client(location).list_blobs())) == 30
    lines = [r.getMessage() for r in caplog.records if r.name == "urllib3.connectionpool"]
    assert any("restype=container" in line for line in lines)  # the listings were logged
    for text in (caplog.text, *lines):
        assert signature not in text and quote(signature, safe="") not in text


def test_redact_keeps_the_message_and_drops_sas_fields() -> None:
    """Defence in depth behind the engine's own redaction: any SAS field in a message that
    reaches an exception is replaced, and only the first line (no request dump) is kept."""
    text = "GET https://a.blob.core.windows.net/c/x?sv=2025-01-05&sig=abc%2Bdef&se=2030 failed\nx"
    assert redact(text) == (
        "GET https://a.blob.core.windows.net/c/x?sv=REDACTED&sig=REDACTED&se=REDACTED failed"
    )


def _recorded(dest: Path) -> dict[str, dict[str, Any]]:
    return {f["path"]: f for f in json.loads((dest / MANIFEST).read_text())["files"].values()}


def _rewrite_in_place(path: Path, data: bytes, status: list[int]) -> None:
    """New bytes of the same size in the same inode, the modification time set back to the
    recorded one; until the change time differs from the recorded one (it moves with the file
    system's clock, which may tick coarser than a fast test)."""
    assert len(data) == path.stat().st_size
    with open(path, "r+b") as fh:
        fh.write(data)
    mtime_ns, ctime_ns, _ = status
    os.utime(path, ns=(mtime_ns, mtime_ns))
    while path.stat().st_ctime_ns == ctime_ns:
        time.sleep(0.01)
        os.utime(path, ns=(mtime_ns, mtime_ns))


def test_resync_with_nothing_changed_reads_no_staged_file(
    container: ContainerClient, tmp_path: Path
) -> None:
    """A re-sync trusts every file whose status is the one recorded: none is read (outside
    the by-turns slice, empty here: one turn in a million), none downloaded."""
    dest = tmp_path / "data"
    sync_to_directory(container, "ds", dest)
    again = sync_to_directory(container, "ds", dest, verify_every=1 << 20)
    assert (again.verified, again.downloaded, again.skipped) == (0, [], 30)
    assert again.repaired == []


def test_a_file_changed_behind_the_manifests_back_is_found(
    container: ContainerClient, tmp_path: Path
) -> None:
    """Same size, same inode, the modification time restored: the change time still differs
    from the recorded one, so the file is read, found wrong and downloaded again; the other
    files are not read."""
    dest = tmp_path / "data"
    sync_to_directory(container, "ds", dest)
    target = dest / "train" / "c1" / "4.png"
    _rewrite_in_place(
        target, b"x" * target.stat().st_size, _recorded(dest)["train/c1/4.png"]["stat"]
    )
    again = sync_to_directory(container, "ds", dest, verify_every=1 << 20)
    assert again.verified == 1
    assert again.repaired == again.downloaded == ["ds/train/c1/4.png"]
    assert target.read_bytes() == b"image-4" * 50
    assert list(dest.rglob("*.part")) == []


def test_every_file_is_read_again_within_verify_every_syncs(
    container: ContainerClient, tmp_path: Path
) -> None:
    """What no status shows (bits rotting in place): every file rewritten, the manifest's
    status record made to match (as if nothing had touched them). Each re-sync reads one slice,
    a file is read once per cycle, and after ``verify_every`` syncs every file was read,
    found wrong and repaired."""
    dest = tmp_path / "data"
    every = 4
    sync_to_directory(container, "ds", dest, verify_every=every)
    manifest = json.loads((dest / MANIFEST).read_text())
    for entry in manifest["files"].values():
        path = dest / entry["path"]
        path.write_bytes(b"\0" * entry["size"])
        st = path.stat()
        entry["stat"] = [st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    (dest / MANIFEST).write_text(json.dumps(manifest))
    repaired: list[str] = []
    for _ in range(every):
        report = sync_to_directory(container, "ds", dest, verify_every=every)
        assert report.verified == len(report.repaired) < 30  # one slice, not every file
        repaired += report.repaired
    assert sorted(repaired) == sorted(b.name for b in container.list_blobs())  # each once
    for i in range(30):
        assert (
            dest / "train" / f"c{i % 3}" / f"{i}.png"
        ).read_bytes() == f"image-{i}".encode() * 50
    assert sync_to_directory(container, "ds", dest, verify_every=1 << 20).verified == 0


@pytest.mark.parametrize("syncs", ["absent", "not a count"])
def test_a_manifest_of_the_earlier_format_is_read_and_checked(
    container: ContainerClient, tmp_path: Path, syncs: str
) -> None:
    """A manifest written before the status record and the sync count (no ``stat``, no
    ``syncs``): it loads, every file is read once (nothing vouches for its status), a wrong
    one is downloaded again, and the manifest is written in the new format."""
    dest = tmp_path / "data"
    first = sync_to_directory(container, "ds", dest)
    manifest = json.loads((dest / MANIFEST).read_text())
    older = {
        "prefix": manifest["prefix"],
        "data_version": manifest["data_version"],
        "files": {
            n: {k: e[k] for k in ("path", "etag", "size", "md5")}
            for n, e in manifest["files"].items()
        },
    }
    if syncs != "absent":
        older["syncs"] = syncs
    (dest / MANIFEST).write_text(json.dumps(older, indent=2))
    target = dest / "train" / "c2" / "5.png"
    target.write_bytes(b"y" * target.stat().st_size)
    report = sync_to_directory(container, "ds", dest)
    assert report.verified == 30 and report.downloaded == report.repaired == ["ds/train/c2/5.png"]
    assert target.read_bytes() == b"image-5" * 50
    assert report.data_version == first.data_version
    rewritten = json.loads((dest / MANIFEST).read_text())
    assert rewritten["syncs"] == 1
    assert all(len(e["stat"]) == 3 for e in rewritten["files"].values())
    assert sync_to_directory(container, "ds", dest, verify_every=1 << 20).verified == 0


def test_a_resync_reads_its_files_while_the_listing_is_on_its_way(
    container: ContainerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-sync's own reads (the manifest, the files whose turn it is to be read)
    need no listing: they are made while the service answers, not after. The listing below
    is held back until a staged file has been read (10 s at most) and records whether one
    was."""
    from staging.blob import list_pinned
    from tests.staging.list_server import page

    dest = tmp_path / "data"
    sync_to_directory(container, "ds", dest)
    reads: list[Path] = []
    _spy_reads(monkeypatch, reads)
    with _held_until_read(page(list_pinned(container, "ds")), reads) as (
        client,
        read_before_answer,
    ):
        again = sync_to_directory(client, "ds", dest, verify_every=1)
    assert read_before_answer == [True]
    assert (again.verified, again.skipped, again.downloaded, again.repaired) == (30, 30, [], [])


def test_a_folder_swapped_for_a_link_outside_is_refused_and_nothing_there_is_read(
    container: ContainerClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A class folder moved outside the destination and linked back in: its files keep their
    status (inode, times), so the manifest would vouch for them. The sync refuses the first
    blob that resolves there, reads no file outside (not even ahead of the listing, on its
    turn) and writes nothing there."""
    dest, outside = tmp_path / "data", tmp_path / "elsewhere"
    sync_to_directory(container, "ds", dest)
    outside.mkdir()
    (dest / "train" / "c1").rename(outside / "c1")
    (dest / "train" / "c1").symlink_to(outside / "c1", target_is_directory=True)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (outside / "c1").iterdir()}
    read: list[Path] = []
    _spy_reads(monkeypatch, read)
    with pytest.raises(
        UnsafeBlobNameError, match=r"blob 'ds/train/c1/.*' rejected: resolves outside"
    ):
        sync_to_directory(container, "ds", dest, verify_every=1)
    assert read and all("/c1/" not in str(p) for p in read)  # the other folders were read
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (outside / "c1").iterdir()}
    assert after == before


def _adoptable(dest: Path, count: int) -> list[PinnedBlob]:
    """Files already in ``dest`` and the listing of blobs with their bytes: a sync adopts them
    by MD5 and writes its manifest, with nothing to download."""
    blobs = []
    for i in range(count):
        data = f"file-{i}".encode() * 100
        (dest / "c").mkdir(parents=True, exist_ok=True)
        (dest / "c" / f"{i}.bin").write_bytes(data)
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
        blobs.append(PinnedBlob(f"ds/c/{i}.bin", f'"0x{i}"', len(data), md5))
    return blobs


def _spy_reads(monkeypatch: pytest.MonkeyPatch, seen: list[Path]) -> None:
    """Records each staged file the sync reads (it still reads it)."""
    import staging.sync

    real = staging.sync.file_md5

    def reading(path: Path) -> str:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(staging.sync, "file_md5", reading)


@contextlib.contextmanager
def _held_until_read(
    body: bytes, reads: list[Path]
) -> Iterator[tuple[ContainerClient, list[bool]]]:
    """A loopback List Blobs endpoint answering ``body``, each answer held back until a staged
    file has been read (``reads``, from :func:`_spy_reads`; 10 s at most); yields a client of
    it and, per answer, whether a file had been read by then."""
    from tests.staging.list_server import data_client, reply_headers, serving

    read_before_answer: list[bool] = []

    def answer(handler: Any, call: int) -> None:
        deadline = time.monotonic() + 10
        while not reads and time.monotonic() < deadline:
            time.sleep(0.01)
        read_before_answer.append(bool(reads))
        reply_headers(handler, 200, body)
        handler.wfile.write(body)

    with serving(answer) as (port, _):
        yield data_client(port), read_before_answer


def test_a_given_listing_reads_nothing_ahead_of_the_names_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the gate's listing given (the flow's staging), nothing is read before every name is
    checked, and a file about to be deleted is not read, even on its turn."""
    dest = tmp_path / "data"
    blobs = _adoptable(dest, 4)
    sync_to_directory(None, "ds", dest, listing=blobs)  # type: ignore[arg-type]  # no download
    reads: list[Path] = []
    _spy_reads(monkeypatch, reads)
    hostile = [*blobs, PinnedBlob("ds/../x", '"0x9"', 1, None)]
    with pytest.raises(UnsafeBlobNameError, match=re.escape("'ds/../x' rejected")):
        sync_to_directory(None, "ds", dest, listing=hostile, verify_every=1)  # type: ignore[arg-type]
    assert reads == []
    report = sync_to_directory(None, "ds", dest, listing=blobs[1:], verify_every=1)  # type: ignore[arg-type]
    assert report.deleted == ["ds/c/0.bin"] and sorted(p.name for p in reads) == [
        "1.bin",
        "2.bin",
        "3.bin",
    ]


@pytest.mark.parametrize("bad", ["c/x\x00y", "c/x\ud800"], ids=["NUL", "lone surrogate"])
@pytest.mark.processes
def test_a_manifest_path_no_file_can_have_does_not_stop_the_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    """A manifest entry whose path holds a NUL or an unencodable character (a damaged or
    hand-edited manifest): the sync, listing the container itself and reading ahead while it
    waits, passes over it and stages as before. The listing is held back until the survey
    has read a file listed after the damaged entry."""
    from tests.staging.list_server import page

    dest = tmp_path / "data"
    blobs = _adoptable(dest, 4)
    sync_to_directory(None, "ds", dest, listing=blobs)  # type: ignore[arg-type]  # no download
    manifest = json.loads((dest / MANIFEST).read_text())
    damaged = {"ds/bogus": {"path": bad, "etag": '"0x0"', "size": 1, "md5": "x", "stat": [0]}}
    manifest["files"] = {**damaged, **manifest["files"]}  # the survey meets it first
    (dest / MANIFEST).write_text(json.dumps(manifest))
    reads: list[Path] = []
    _spy_reads(monkeypatch, reads)
    with _held_until_read(page(blobs), reads) as (client, read_before_answer):
        report = sync_to_directory(client, "ds", dest, verify_every=1)
    assert read_before_answer == [True]
    assert (report.skipped, report.downloaded, report.repaired) == (4, [], [])
    assert report.deleted == []  # the damaged entry names no file: nothing to delete


def test_the_folder_holds_exactly_the_listing_whatever_was_left_there(
    container: ContainerClient, tmp_path: Path
) -> None:
    """Whatever the folder holds that the listing does not name is deleted before anything is
    written, whoever left it: files no manifest recorded, temporary files of downloads and of
    a manifest write, a stray class folder, an empty one, a file where the listing needs a
    folder and a folder where it needs a file, a link (its target untouched). The manifest and
    the packed shards stay; nothing listed is downloaded again."""
    dest, outside = tmp_path / "data", tmp_path / "elsewhere.png"
    sync_to_directory(container, "ds", dest)
    outside.write_bytes(b"not staging's")
    left = {
        "train/c1/stray.png": b"x",
        "train/c1/.staging-0123456789ab-7.part": b"half",
        ".staging-manifest.json.k2j3.tmp": b"{",
        "train/bad/1.png": b"y",
        "train/gone/deeper/2.png": b"z",
        "val": b"a file where a folder will be needed",
        "train/c2/new.png/inner.png": b"a folder where a file will be needed",
    }
    for rel, data in left.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)
    (dest / "train" / "empty").mkdir()
    (dest / "train" / "c0" / "link.png").symlink_to(outside)
    (dest / ".shards").mkdir()
    (dest / ".shards" / "index.json").write_text("{}")
    container.upload_blob("ds/val/c0/1.png", b"val image")
    container.upload_blob("ds/train/c2/new.png", b"new image")

    again = sync_to_directory(container, "ds", dest)
    listed = {b.name[len("ds/") :] for b in container.list_blobs(name_starts_with="ds/")}
    on_disk = {
        p.relative_to(dest).as_posix()
        for p in dest.rglob("*")
        if (p.is_file() or p.is_symlink()) and p.name != MANIFEST
    }
    assert on_disk == listed | {".shards/index.json"}
    assert not (dest / "train" / "bad").exists() and not (dest / "train" / "empty").exists()
    assert (dest / "val" / "c0" / "1.png").read_bytes() == b"val image"
    assert (dest / "train" / "c2" / "new.png").read_bytes() == b"new image"
    assert outside.read_bytes() == b"not staging's"
    assert sorted(again.removed) == sorted([*left, "train/c0/link.png"])
    assert sorted(again.downloaded) == ["ds/train/c2/new.png", "ds/val/c0/1.png"]
    assert again.skipped == 30 and again.deleted == []


# A re-sync in a process of its own: what it imported, what it did.
RESYNC = """
import json, os, sys
from pathlib import Path
from azure.storage.blob import ContainerClient
from backends.blob import API_VERSION
from staging.sync import stage

container = ContainerClient.from_connection_string(
    os.environ["STAGE_CONN"], sys.argv[1], api_version=API_VERSION
)
done = stage(container, "ds", Path(sys.argv[2]), int(sys.argv[3]))
print(json.dumps({
    "torch": "torch" in sys.modules,
    "downloaded": len(done["downloaded"]),
    "shards": done["shards"]["action"],
}))
"""


@pytest.mark.parametrize("pack", [0, 8], ids=["shards off", "shards on"])
def test_a_resync_with_nothing_changed_imports_no_torch(
    azurite: str, tmp_path: Path, pack: int
) -> None:
    """The packer needs torch (seconds to import); a re-sync that changes nothing, whether its
    pack is current or packing is off, does not import it."""
    import io

    from PIL import Image

    client = ContainerClient.from_connection_string(
        azurite, f"lazy-{uuid.uuid4().hex[:12]}", api_version=API_VERSION
    )
    client.create_container()
    for i in range(8):
        png = io.BytesIO()
        Image.new("RGB", (10, 10), (i * 30, 0, 0)).save(png, "PNG")
        client.upload_blob(f"ds/{('train', 'test')[i % 2]}/c{i % 4 // 2}/{i}.png", png.getvalue())
    dest = tmp_path / "data"
    first = stage(client, "ds", dest, pack)
    assert first["shards"]["action"] == ("packed" if pack else "not packed"), first["shards"]
    done = subprocess.run(
        [sys.executable, "-c", RESYNC, client.container_name, str(dest), str(pack)],
        env=child_env() | {"STAGE_CONN": azurite},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    again = json.loads(done.stdout.strip().splitlines()[-1])
    shards = "unchanged" if pack else "not packed"
    assert again == {"torch": False, "downloaded": 0, "shards": shards}
