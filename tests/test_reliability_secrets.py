"""Secrets: the whole local flow run with recognisable secrets in its environment; every log,
artifact, flow-run parameter, output blob and local file it wrote is scanned for them."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.blob import container_client
from flows.retrain import retrain
from tests.pipeline_helpers import flow_run_logs, make_config, seed, task_runs_and_artifacts
from tests.reliability import report
from training.make_images import write_digits

pytestmark = pytest.mark.usefixtures("prefect_api", "horovodrun")

FAKE_SAS = "sv=2025-01-05&sr=c&sp=rl&sig=RETRAINFAKESIGNATURE0123456789abcdef%3D"
FAKE_KEY = "UkVUUkFJTi1GQUtFLUFDQ09VTlQtS0VZLTAxMjM0NTY3ODk="


def _flow_run(flow_run_id: Any) -> Any:
    from prefect.client.orchestration import get_client

    async def read() -> Any:
        async with get_client() as client:
            return await client.read_flow_run(flow_run_id)

    return asyncio.run(read())


@pytest.fixture
def private_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """An Azurite with an account of its own and a fresh random key (the emulator's default key
    is a published constant, and appears in this project's source)."""
    from urllib.parse import urlparse

    from backends.azurite import running_azurite

    key = base64.b64encode(os.urandom(64)).decode()
    monkeypatch.setenv("AZURITE_ACCOUNTS", f"retrainsecret:{key}")
    with running_azurite(tmp_path / "azurite") as default:
        endpoint = dict(p.split("=", 1) for p in default.split(";") if "=" in p)["BlobEndpoint"]
        port = urlparse(endpoint).port
        yield (
            "DefaultEndpointsProtocol=http;AccountName=retrainsecret;"
            f"AccountKey={key};BlobEndpoint=http://127.0.0.1:{port}/retrainsecret;",
            key,
        )


def test_no_secret_in_logs_artifacts_parameters_or_files(
    private_account: tuple[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    azurite, account_key = private_account
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)  # holds the account key
    monkeypatch.setenv("RETRAIN_OUTPUTS_SAS", f"https://a.blob.core.windows.net/c?{FAKE_SAS}")
    monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
    source = tmp_path / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=40)
    config = make_config(tmp_path, "training.epochs=2")
    seed(config, source)

    state = retrain(config=config, return_state=True)
    assert state.is_completed(), state.message

    secrets = {
        "account key": account_key,
        "SAS signature": "RETRAINFAKESIGNATURE",
        "connection string": azurite,
        "key variable": FAKE_KEY,
    }
    flow_run_id = state.state_details.flow_run_id
    task_runs, artifacts = task_runs_and_artifacts(flow_run_id)
    places: dict[str, str] = {
        "logs": flow_run_logs(flow_run_id),
        "artifacts": json.dumps([a.data for a in artifacts], default=str),
        "flow run parameters": json.dumps(_flow_run(flow_run_id).parameters, default=str),
        "task run inputs": json.dumps([r.task_inputs for r in task_runs.values()], default=str),
    }
    outputs = container_client(config.output)
    places["output blobs"] = "\n".join(
        outputs.download_blob(b.name).readall().decode("latin-1") for b in outputs.list_blobs()
    )
    local = [
        p
        for d in (config.work_dir, config.share.local_dir, config.nfs.local_dir)
        for p in d.rglob("*")
        if p.is_file()
    ]
    places["local files"] = "\n".join(p.read_bytes().decode("latin-1") for p in local)
    hits = {
        (where, what)
        for where, text in places.items()
        for what, secret in secrets.items()
        if secret in text
    }
    assert hits == set()
    report.record(
        "secrets",
        "local flow with an account key, a SAS and a connection string",
        "0 hits",
        places_scanned=", ".join(places),
        files_scanned=len(local),
        output_blobs=len(list(outputs.list_blobs())),
        hits=0,
    )
