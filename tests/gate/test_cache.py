"""The data gate reads each image once per content: unchanged blobs come from its cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backends.blob import container_client
from core.config import PipelineConfig
from gate.manifest import build_manifest, cache_path
from tests.pipeline_helpers import make_config, seed


@pytest.fixture
def seeded(
    azurite: str, small_folders: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[PipelineConfig, int]:
    """A config on containers of its own, its data container seeded; and how many images."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    return config, seed(config, small_folders)


def _build(config: PipelineConfig) -> tuple[list[dict[str, Any]], int]:
    return build_manifest(config.data, config.work_dir / "gate-cache")


def test_unchanged_blobs_are_not_read_again(seeded: tuple[PipelineConfig, int]) -> None:
    config, total = seeded
    first, cached = _build(config)
    assert (len(first), cached) == (total, 0)
    again, cached = _build(config)
    assert cached == total and again == first  # same rows, no image read

    # New content under an old name: that one blob is read again, and what it holds now is
    # what the gate sees (here: not an image any more).
    container = container_client(config.data)
    victim = sorted(r["path"] for r in first if r["split"] == "train")[0]
    container.upload_blob(f"{config.data.prefix}/{victim}", b"not an image", overwrite=True)
    changed, cached = _build(config)
    assert cached == total - 1
    row = next(r for r in changed if r["path"] == victim)
    assert row["readable"] is False and row["bytes"] == len(b"not an image")


def test_damaged_cache_is_ignored(seeded: tuple[PipelineConfig, int]) -> None:
    config, total = seeded
    _build(config)
    cache = cache_path(config.data, config.work_dir / "gate-cache")
    cache.write_text(cache.read_text()[: len(cache.read_text()) // 2])  # cut mid-write
    rows, cached = _build(config)
    assert (len(rows), cached) == (total, 0)
    assert len(json.loads(cache.read_text())) == total  # rewritten whole


def test_new_version_under_a_new_prefix_reads_only_new_content(
    seeded: tuple[PipelineConfig, int],
) -> None:
    """The trigger's layout: each version under a prefix of its own. Images whose content the
    last gate read (same Content-MD5 and size) are not read again under their new names; a
    changed image is, and every row carries its new path."""
    config, total = seeded
    _build(config)
    container = container_client(config.data)
    old = config.data.prefix
    new = f"{old}-v2"
    names = sorted(b.name for b in container.list_blobs(name_starts_with=f"{old}/"))
    for name in names:
        container.upload_blob(
            f"{new}/{name[len(old) + 1 :]}", container.download_blob(name).readall()
        )
    victim = next(n for n in names if "/train/" in n)
    changed_rel = victim[len(old) + 1 :]
    container.upload_blob(f"{new}/{changed_rel}", b"new bytes, not an image", overwrite=True)
    v2 = config.model_copy(update={"data": config.data.model_copy(update={"prefix": new})})

    rows, cached = _build(v2)

    assert (len(rows), cached) == (total, total - 1)
    assert sorted(r["path"] for r in rows) == sorted(n[len(old) + 1 :] for n in names)
    changed = next(r for r in rows if r["path"] == changed_rel)
    assert changed["readable"] is False and changed["bytes"] == len(b"new bytes, not an image")
    assert all(r["readable"] for r in rows if r["path"] != changed_rel)


def test_a_copy_under_another_kind_of_name_does_not_stand_for_the_image(
    seeded: tuple[PipelineConfig, int],
) -> None:
    """`a.png.bak`, the same bytes as `a.png`, shares its content key (MD5 and size); its row
    (not an image, nothing read) must not be cached as what the image holds."""
    config, _ = seeded
    container = container_client(config.data)
    first, _ = _build(config)
    image = sorted(r["path"] for r in first if r["split"] == "train")[0]
    data = container.download_blob(f"{config.data.prefix}/{image}").readall()
    container.upload_blob(f"{config.data.prefix}/{image}.bak", data)
    for _ in range(2):
        rows, _ = _build(config)
        assert next(r for r in rows if r["path"] == image)["readable"] is True


def test_cached_rows_are_built_without_the_collector_walking_the_process(
    azurite: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A nightly gate over unchanged data builds a row per blob from the cache: bulk
    allocations with no cycle, made with the collector paused (1.38 M rows: 12.1 s running,
    10.5 s paused). At most two collections run: where the pause steps out for the reads
    (none here) and after it."""
    import gc

    from bench.gate_scale import _prefill
    from staging.listing import PinnedBlob

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    blobs = [
        PinnedBlob(f"{config.data.prefix}/train/c{i % 10}/{i}.jpg", f'"0x{i:X}"', 1000 + i, f"m{i}")
        for i in range(20_000)
    ]
    cache_dir = config.work_dir / "gate-cache"
    _prefill(cache_path(config.data, cache_dir), blobs)
    build_manifest(config.data, cache_dir, blobs=blobs)  # once: the modules it imports on first use
    collections: list[int] = []

    def counted(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(counted)
    try:
        rows, reused = build_manifest(config.data, cache_dir, blobs=blobs)
    finally:
        gc.callbacks.remove(counted)
    assert reused == len(rows) == 20_000 and rows[7]["width"] == 500
    assert len(collections) <= 2
    assert gc.isenabled()


def test_a_blob_over_the_byte_cap_is_not_read(
    seeded: tuple[PipelineConfig, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image file larger than imagedata.images.MAX_IMAGE_BYTES is unreadable by its listed
    size, never downloaded: here the cap is lowered below a valid image's size, which then
    reads as unreadable (it would decode fine if it were read)."""
    import gate.manifest

    config, _ = seeded
    rows, _ = _build(config)
    image = max((r for r in rows if r["readable"]), key=lambda r: r["bytes"])
    monkeypatch.setattr(gate.manifest, "MAX_IMAGE_BYTES", image["bytes"] - 1)
    monkeypatch.setattr(gate.manifest, "DESCRIBE_VERSION", -1)  # a cache of its own
    again, cached = _build(config)
    assert cached == 0
    assert next(r for r in again if r["path"] == image["path"])["readable"] is False
    assert sum(r["readable"] for r in again) == sum(r["readable"] for r in rows) - 1


def test_a_blob_rewritten_after_the_listing_is_not_read_under_the_listed_md5(
    seeded: tuple[PipelineConfig, int],
) -> None:
    """A producer re-uploads an image between the gate's listing and its read: the read is
    refused by the listed ETag (If-Match), naming the blob, so no row of other bytes is filed
    under the listed MD5 for a later version to reuse."""
    from gate.manifest import BlobChangedError, _content
    from staging.blob import list_pinned

    config, _ = seeded
    container = container_client(config.data)
    listed = [b for b in list_pinned(container, config.data.prefix) if b.name.endswith(".png")]
    pinned = listed[0]
    rel = pinned.name.removeprefix(f"{config.data.prefix}/")
    assert _content(container, pinned, rel)["readable"] is True  # as listed: read
    container.upload_blob(pinned.name, b"garbage now", overwrite=True)
    with pytest.raises(BlobChangedError, match=f"blob {pinned.name} changed while the gate"):
        _content(container, pinned, rel)
