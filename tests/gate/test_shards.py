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


def test_what_the_trainer_would_refuse_or_miss_fails_the_gate_saying_why(
    azurite: str, small_folders: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gate that passes is a promise the trainer keeps: a shard outside a split's folder
    (the trainer never reads it), class folders beside shards (the trainer refuses the split)
    and a shard that is not samples each fail it, and the report says why, naming each."""
    from core.config import ValidationConfig
    from gate.report import failure
    from gate.suites import run_expectations

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config = make_config(tmp_path)
    pack_folders(small_folders, tmp_path / "packed", max_bytes=20_000)
    seed(config, tmp_path / "packed")
    container = container_client(config.data)
    good = next((tmp_path / "packed" / "train").glob("*.tar")).read_bytes()
    png = next(small_folders.rglob("*.png")).read_bytes()
    prefix = config.data.prefix
    container.upload_blob(f"{prefix}/extra.tar", good)  # beside the splits
    container.upload_blob(f"{prefix}/test/digit_0/more.tar", good)  # in a class folder
    container.upload_blob(f"{prefix}/val/digit_0/x.png", png)  # val: loose only, fine
    container.upload_blob(f"{prefix}/train/digit_0/x.png", png)  # beside train's shards
    container.upload_blob(f"{prefix}/test/999999.tar", good[: len(good) // 2])  # cut short
    container.upload_blob(f"{prefix}/other/000000.tar", good)  # a folder no reader knows
    container.upload_blob(f"{prefix}/train/a/b/y.png", png)  # deep, beside train's shards

    rows, _ = build_manifest(config.data, config.work_dir / "gate-cache")
    problems = {r["path"]: r["problem"] for r in rows if r["problem"]}
    assert problems == {
        "extra.tar": "a tar shard is read only as <split>/NNNNNN.tar (train/, val/ or test/)",
        "test/digit_0/more.tar": (
            "a tar shard is read only as <split>/NNNNNN.tar (train/, val/ or test/)"
        ),
        "other/000000.tar": (
            "a tar shard is read only as <split>/NNNNNN.tar (train/, val/ or test/)"
        ),
        "train/digit_0/x.png": "split train holds tar shards: no class folders beside them",
        "train/a/b/y.png": "split train holds tar shards: no class folders beside them",
        "test/999999.tar": problems.get("test/999999.tar", "missing"),
    }
    # Kept by content: the sentence names no blob (the row's path does), so the same bytes
    # under another version's folder are not reported under this one's name.
    assert problems["test/999999.tar"].startswith(("cut short", "damaged tar"))
    success, records = run_expectations(
        rows, ValidationConfig(min_images_per_class=1), tmp_path / "docs"
    )
    assert not success
    message = str(failure(rows, records))
    assert "expect_column_values_to_be_null(problem): 6 unexpected" in message
    assert "train/a/b/y.png: split train holds tar shards" in message
