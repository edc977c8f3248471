"""A model's lineage (registry/lineage.py), read from the runs' metrics.json in a real Azurite."""

from __future__ import annotations

import json
from typing import Any

import pytest
from azure.storage.blob import ContainerClient

from backends.blob import container_client
from core.config import BlobLocation
from registry.lineage import lineage


@pytest.fixture
def outputs(azurite: str, monkeypatch: pytest.MonkeyPatch) -> ContainerClient:
    import uuid

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    return container_client(BlobLocation(container=f"lin-{uuid.uuid4().hex[:10]}"), create=True)


def _run(outputs: ContainerClient, run_id: str, init_from: Any, base: str = "p") -> None:
    metrics = {"test_accuracy": 0.9, "init_from": init_from}
    outputs.upload_blob(f"{base}/runs/{run_id}/metrics.json", json.dumps(metrics))


def test_the_champion_is_followed_back_to_a_run_from_scratch(outputs: ContainerClient) -> None:
    _run(outputs, "r1", None)
    _run(outputs, "r2", {"run_id": "r1", "source": "x", "md5": "m1"})
    _run(outputs, "r3", {"run_id": "r2", "source": "y", "md5": "m2"})
    chain = lineage(outputs, "p", "r3")
    assert [(a.run_id, a.started_from) for a in chain] == [
        ("r3", "run r2"),
        ("r2", "run r1"),
        ("r1", "scratch"),
    ]


def test_outside_weights_missing_records_and_cycles_end_the_chain(
    outputs: ContainerClient,
) -> None:
    _run(outputs, "t1", {"run_id": None, "source": "nfs/weights/r50.pth", "md5": "abc"})
    assert lineage(outputs, "p", "t1")[0].started_from == "nfs/weights/r50.pth (MD5 abc)"
    _run(outputs, "g1", {"run_id": "gone"})
    assert lineage(outputs, "p", "g1")[-1].started_from.startswith("unknown: p/runs/gone/")
    _run(outputs, "c1", {"run_id": "c2"})
    _run(outputs, "c2", {"run_id": "c1"})
    assert lineage(outputs, "p", "c1")[-1].started_from == "unknown: the records form a cycle"
    outputs.upload_blob("p/runs/old/metrics.json", json.dumps({"test_accuracy": 0.5}))
    assert lineage(outputs, "p", "old")[0].started_from.startswith("scratch (before")
