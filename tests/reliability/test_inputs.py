"""Bad input corpus: configs, blob names, datasets, credentials. Each gives a clear error that
names the problem, and nothing is written outside the target directories."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.blob import StorageConfigError, service_client
from core.config import BlobLocation, ConfigError, load_config
from staging.sync import UnsafeBlobNameError, safe_relative_path
from tests.conftest import ROOT, run_trainer
from tests.reliability import report

LOCAL = ROOT / "configs" / "local.yaml"

CONFIGS = [
    ("target=gcp", "target"),
    ("data.container=Bad_Name", "data.container"),
    ("data.container=ab", "data.container"),
    ("data.prefix=../../etc", "data.prefix"),
    ("output.container=-x-", "output.container"),
    ("pool.dedicated_nodes=-1", "pool.dedicated_nodes"),
    ("pool.dedicated_nodes=0", "pool"),
    ("pool.processes_per_node=0", "pool.processes_per_node"),
    ("pool.release=keep", "pool.release"),
    ("training.epochs=0", "training.epochs"),
    ("training.batch_size=abc", "training.batch_size"),
    ("training.lr=-0.1", "training.lr"),
    ("training.model=vgg", "training.model"),
    ("retries.training_attempts=0", "retries.training_attempts"),
    ("retries.backoff_seconds=-1", "retries.backoff_seconds"),
    ("promotion.min_improvement=-1", "promotion.min_improvement"),
    ("validation.min_side=0", "validation.min_side"),
    ("image.builder=kaniko", "image.builder"),
    ("unknown_section.x=1", "unknown_section"),
    ("training.unknown=1", "training.unknown"),
]


@pytest.mark.parametrize(("override", "field"), CONFIGS)
def test_invalid_config_names_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(LOCAL, [override])
    assert field in str(err.value)
    report.record(
        "inputs",
        f"config --set {override}",
        "refused, names " + field,
        message=str(err.value).splitlines()[-1].strip(),
    )


BLOB_NAMES = [
    ("ds/../../etc/passwd", "traversal"),
    ("ds/a/../../x", "traversal inside the prefix"),
    ("/ds/abs", "absolute"),
    ("ds//double", "empty segment"),
    ("ds/a\\..\\b", "backslash"),
    ("ds/" + "x" * 1100, "longer than a path can be"),
    ("ds/", "empty name"),
]


@pytest.mark.parametrize(("name", "kind"), BLOB_NAMES)
def test_malicious_blob_names_are_refused_by_name(name: str, kind: str) -> None:
    with pytest.raises(UnsafeBlobNameError) as err:
        safe_relative_path(name, "ds")
    assert repr(name)[:40] in str(err.value)
    report.record(
        "inputs",
        f"blob name: {kind}",
        "refused before anything is written",
        message=str(err.value)[:90],
    )


def test_unicode_blob_names_are_fine() -> None:
    assert str(safe_relative_path("ds/train/ünï/画像.png", "ds")) == "train/ünï/画像.png"
    report.record("inputs", "blob name: unicode", "accepted (a valid name)")


DATASETS = ["empty", "no_test_split", "zero_byte_only_class", "text_instead_of_images"]


@pytest.mark.processes
@pytest.mark.parametrize("case", DATASETS)
def test_wrong_dataset_layout_names_the_problem(case: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    if case == "no_test_split":
        for split in ("train",):
            (data / split / "a").mkdir(parents=True)
            (data / split / "a" / "1.png").write_bytes(b"")
    elif case == "zero_byte_only_class":
        for split in ("train", "test"):
            for cls in ("a", "b"):
                (data / split / cls).mkdir(parents=True)
                (data / split / cls / "1.png").write_bytes(b"")
    elif case == "text_instead_of_images":
        (data / "notes.txt").write_text("not a dataset")
    result = run_trainer(1, data, tmp_path / "out", "--epochs", "1")
    assert result.returncode == 2, result.output[-2000:]
    message = next(line for line in result.output.splitlines() if "error" in line.lower())
    assert str(data) in message or "split" in message or "class" in message
    assert not (tmp_path / "out" / "model.pt").exists()
    report.record(
        "inputs",
        f"dataset: {case.replace('_', ' ')}",
        "exit 2, problem named",
        message=message.replace(str(tmp_path), "<tmp>")[:110],
    )


def test_missing_credentials_name_the_config_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    with pytest.raises(StorageConfigError) as err:
        service_client(BlobLocation(container="training-data"))
    assert "AZURE_STORAGE_CONNECTION_STRING" in str(err.value)
    assert "credentials_block" in str(err.value) and "account_url" in str(err.value)
    report.record(
        "inputs",
        "no Blob credentials at all",
        "refused, names the three ways",
        message=str(err.value)[:110],
    )
