"""Packed shards: the same samples as the loose files, reused rows on repack, and a safe
fallback to the loose files whenever the shards do not match the folder."""

from __future__ import annotations

import errno
import fcntl
import json
import threading
import uuid
from pathlib import Path

import pytest
import torch
from azure.storage.blob import ContainerClient
from filelock import FileLock

from backends.blob import API_VERSION, upload_directory
from imagedata.data import open_dataset
from imagedata.dataset import DatasetError
from imagedata.shards import (
    INDEX,
    LOCK,
    SHARD_DIR,
    TARGET_SHARD_BYTES,
    open_shards,
    pack_shards,
)
from imagedata.staged_folder import PackReport
from imagedata.synthetic import encode_png
from staging.sync import safe_relative_path, stage

SIZE = 32


def _same_samples(root: Path, size: int = SIZE) -> None:
    packed = open_dataset(str(root), size)
    loose = open_dataset(str(root), size, use_shards=False)
    assert packed.kind == "image-folders (packed shards)"
    assert packed.class_names == loose.class_names
    for split, data in loose.splits.items():
        assert len(packed.splits[split]) == len(data)
        for i in range(len(data)):
            a, label_a = packed.splits[split].dataset[i]
            b, label_b = data.dataset[i]
            assert label_a == label_b and torch.equal(a, b), (split, i)
        assert len(packed.splits[split].skipped) == len(data.skipped)


def test_shards_hold_exactly_the_loose_samples(small_folders: Path) -> None:
    report = pack_shards(small_folders, SIZE)
    assert report.action == "packed" and report.decoded == report.images == 48
    _same_samples(small_folders)
    again = pack_shards(small_folders, SIZE)
    assert again.action == "unchanged" and again.decoded == 0


def test_rows_split_across_shards_of_the_target_size(
    small_folders: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("imagedata.shards.TARGET_SHARD_BYTES", 5 * 3 * SIZE * SIZE)
    report = pack_shards(small_folders, SIZE)
    index = json.loads((small_folders / SHARD_DIR / INDEX).read_text())
    counts = [s["count"] for split in index["splits"].values() for s in split["shards"]]
    assert report.shards == len(counts) > 2 and max(counts) == 5
    _same_samples(small_folders)
    assert TARGET_SHARD_BYTES >= 64 << 20  # the real target: few, large files


def test_repack_decodes_only_changed_images_and_drops_old_files(small_folders: Path) -> None:
    pack_shards(small_folders, SIZE)
    kept = {small_folders / SHARD_DIR / name for name in (INDEX, LOCK)}  # fixed names
    old_files = set((small_folders / SHARD_DIR).iterdir()) - kept
    victim = sorted((small_folders / "train").rglob("*.png"))[0]
    donor = sorted((small_folders / "train").rglob("*.png"))[-1]
    victim.write_bytes(donor.read_bytes())  # new content under an old name
    report = pack_shards(small_folders, SIZE)
    assert (report.action, report.decoded, report.reused) == ("packed", 1, 47)
    assert not old_files & set((small_folders / SHARD_DIR).iterdir())
    _same_samples(small_folders)


def test_damaged_image_left_out_and_reported(small_folders: Path) -> None:
    bad = sorted((small_folders / "test").rglob("*.png"))[0]
    bad.write_bytes(b"\x89PNG not really")
    report = pack_shards(small_folders, SIZE)
    assert report.skipped == 1 and report.images == 47
    info = open_dataset(str(small_folders), SIZE)
    assert info.kind.endswith("(packed shards)")
    assert [s.split(":")[0] for s in info.splits["test"].skipped] == [str(bad)]
    _same_samples(small_folders)


def test_class_with_no_readable_image_is_not_packed(small_folders: Path) -> None:
    for path in (small_folders / "test" / "class_1").iterdir():
        path.write_bytes(b"")
    report = pack_shards(small_folders, SIZE)
    assert report.action == "not packed" and "class_1" in report.reason
    assert not (small_folders / SHARD_DIR / INDEX).exists()
    with pytest.raises(DatasetError, match="class 'class_1' in split test has no readable"):
        open_dataset(str(small_folders), SIZE)


@pytest.mark.parametrize("change", ["size", "data", "truncated", "format"])
def test_stale_or_damaged_shards_fall_back_to_loose_files(small_folders: Path, change: str) -> None:
    pack_shards(small_folders, SIZE)
    directory = small_folders / SHARD_DIR
    index = json.loads((directory / INDEX).read_text())
    size, expected = SIZE, ""
    if change == "size":
        size, expected = 48, "packed at 32 px; the model reads 48"
    elif change == "data":
        (small_folders / "train" / "class_0" / "extra.png").write_bytes(
            next((small_folders / "train" / "class_2").iterdir()).read_bytes()
        )
        expected = "the folder holds"
    elif change == "truncated":
        shard = directory / index["splits"]["train"]["shards"][0]["file"]
        shard.write_bytes(shard.read_bytes()[:1000])
        expected = f"shard {shard.name} is 1000 bytes"
    else:
        (directory / INDEX).write_text(json.dumps({**index, "format": 99}))
        expected = "format 99"
    assert expected in str(open_shards(small_folders, size))
    info = open_dataset(str(small_folders), size)
    assert info.kind == "image-folders" and expected in info.notes[0]


def test_interrupted_pack_leftovers_removed(small_folders: Path) -> None:
    directory = small_folders / SHARD_DIR
    directory.mkdir()
    (directory / ".train-abc-00000.tmp").write_bytes(b"half a shard")
    (directory / "train-old-00000.u8").write_bytes(b"an old pack")
    pack_shards(small_folders, SIZE)
    names = {p.name for p in directory.iterdir()}
    assert ".train-abc-00000.tmp" not in names and "train-old-00000.u8" not in names
    assert INDEX in names


def test_a_pack_waits_while_another_holds_the_folders_lock(
    small_folders: Path,
) -> None:
    """Two packs of one folder (two runs staging one NFS folder) take turns on the shard
    folder's lock file, whoever holds it (here another process's lock, as on another node)."""
    pack_shards(small_folders, SIZE)
    (small_folders / SHARD_DIR / INDEX).unlink()  # the next pack has work to do
    reports: list[PackReport] = []
    with FileLock(small_folders / SHARD_DIR / LOCK):
        waiting = threading.Thread(target=lambda: reports.append(pack_shards(small_folders, SIZE)))
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive() and not (small_folders / SHARD_DIR / INDEX).exists()
    waiting.join(timeout=60)
    (second,) = reports
    assert second.action == "packed"
    _same_samples(small_folders)


def test_a_filesystem_without_locks_packs_and_leaves_other_packs_temp_files(
    small_folders: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An NFS mount without its lock daemon answers flock with ENOLCK: the pack goes on
    unlocked and leaves temp files alone, which may be another pack's shard being written."""

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    directory = small_folders / SHARD_DIR
    directory.mkdir()
    (directory / ".train-other-00000.tmp").write_bytes(b"another pack's shard")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert pack_shards(small_folders, SIZE).action == "packed"
    assert (directory / ".train-other-00000.tmp").exists()
    _same_samples(small_folders)


def test_not_image_folders_left_alone(tmp_path: Path) -> None:
    (tmp_path / "cifar").mkdir()
    report = pack_shards(tmp_path / "cifar", SIZE)
    assert report.action == "not packed" and "train/" in report.reason
    assert not (tmp_path / "cifar" / SHARD_DIR).exists()


def test_blob_cannot_write_into_the_shards() -> None:
    with pytest.raises(ValueError, match="collides with the packed shards"):
        safe_relative_path("ds/.shards/index.json", "ds")
    assert str(safe_relative_path("ds/train/.shards/x.png", "ds")) == "train/.shards/x.png"


def test_staging_packs_by_manifest_md5_and_unpacks_when_off(
    azurite: str, small_folders: Path, tmp_path: Path
) -> None:
    container = ContainerClient.from_connection_string(
        azurite, f"shards-{uuid.uuid4().hex[:12]}", api_version=API_VERSION
    )
    container.create_container()
    upload_directory(container, small_folders, "ds")
    dest = tmp_path / "nfs" / "data"
    first = stage(container, "ds", dest, SIZE, workers=4)
    assert first["shards"]["action"] == "packed" and first["shards"]["decoded"] == 48
    index = json.loads((dest / SHARD_DIR / INDEX).read_text())
    assert index["version"] == first["data_version"]  # the staging manifest's version
    _same_samples(dest)
    # One blob changes: one download, one decode; the rest is copied from the old pack.
    name = sorted(b.name for b in container.list_blobs(name_starts_with="ds/train/"))[3]
    fresh = encode_png(torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8))
    container.upload_blob(name, fresh, overwrite=True)
    second = stage(container, "ds", dest, SIZE, workers=4)
    assert len(second["downloaded"]) == 1
    assert (second["shards"]["decoded"], second["shards"]["reused"]) == (1, 47)
    _same_samples(dest)
    off = stage(container, "ds", dest, 0, workers=4)
    assert off["shards"]["action"] == "not packed" and not (dest / SHARD_DIR).exists()
    assert open_dataset(str(dest), SIZE).kind == "image-folders"
