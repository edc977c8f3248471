"""The data gate on a dataset uploaded as WebDataset tar shards: a row per sample (its class
from its .cls member), each shard read once per content, and a shard that cannot be read as
samples one unreadable row under the shard's own name, which fails the gate."""

from __future__ import annotations

import io
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from backends.blob import container_client
from gate.manifest import build_manifest
from tests.pipeline_helpers import make_config, seed
from training.webdataset import pack_folders


def test_a_row_per_sample_and_each_shard_read_once(
    azurite: str, small_folders: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    written = pack_folders(small_folders, tmp_path / "packed", max_bytes=20_000)
    shards = seed(config, tmp_path / "packed")
    assert shards == sum(written.values())
    loose = Counter(
        (p.parent.parent.name, p.parent.name) for p in small_folders.rglob("*") if p.is_file()
    )
    cache = config.work_dir / "gate-cache"

    rows, reused = build_manifest(config.data, cache)
    assert reused == 0
    assert Counter((r["split"], r["label"]) for r in rows) == loose
    assert all(r["readable"] and r["md5"] and not r["leak"] for r in rows)
    assert {r["path"].split(".tar/")[0] + ".tar" for r in rows} == {
        p.relative_to(tmp_path / "packed").as_posix() for p in (tmp_path / "packed").rglob("*.tar")
    }
    again, reused = build_manifest(config.data, cache)
    assert (again, reused) == (rows, shards)

    # A shard replaced by one with a sample without its class: read again, and unreadable.
    container = container_client(config.data)
    victim = sorted(r["path"].split(".tar/")[0] + ".tar" for r in rows)[0]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("x.png")
        png = next(small_folders.rglob("*.png")).read_bytes()
        info.size = len(png)
        tar.addfile(info, io.BytesIO(png))
    container.upload_blob(f"{config.data.prefix}/{victim}", buffer.getvalue(), overwrite=True)
    changed, reused = build_manifest(config.data, cache)
    assert reused == shards - 1
    (row,) = [r for r in changed if r["path"].startswith(victim)]
    assert (row["path"], row["readable"], row["label"]) == (victim, False, None)
