"""Blob -> NFS staging against Azurite: incremental, verified, atomic and path-safe."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import parse_qs, quote

import pytest
from azure.storage.blob import ContainerClient, ContainerSasPermissions, generate_container_sas

from backends.blob import API_VERSION
from staging.blob import Retry, data_container
from staging.listing import ChangedSinceGateError, PinnedBlob, pin
from staging.sync import UnsafeBlobNameError, safe_relative_path, sync_to_directory
from staging.transfer import IntegrityError, TransferError, redact
from training.staged_folder import MANIFEST


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
    assert report.downloaded == [] and report.skipped == 30


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


def test_redact_keeps_the_message_and_drops_sas_fields() -> None:
    """Defence in depth behind the engine's own redaction: any SAS field in a message that
    reaches an exception is replaced, and only the first line (no request dump) is kept."""
    text = "GET https://a.blob.core.windows.net/c/x?sv=2025-01-05&sig=abc%2Bdef&se=2030 failed\nx"
    assert redact(text) == (
        "GET https://a.blob.core.windows.net/c/x?sv=REDACTED&sig=REDACTED&se=REDACTED failed"
    )
