"""Blob -> NFS staging against Azurite: incremental, verified, atomic and path-safe."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient

from backends.blob import API_VERSION
from staging.sync import UnsafeBlobNameError, safe_relative_path, sync_to_directory
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
