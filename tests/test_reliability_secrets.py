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


def test_relay_secret_is_in_no_log_and_no_event(tmp_path: Path) -> None:
    """The relay as documented (`python -m deployments.relay`, uvicorn's access log on): Event
    Grid puts the shared secret in the endpoint's query string (`?key=`). Deliveries, the
    validation handshake and wrong guesses must leave it out of the relay's output, and out of
    the events and flow runs it causes."""
    import socket
    import subprocess
    import sys
    import time
    import uuid

    import requests

    from tests.conftest import ROOT, child_env, prefect_api_env

    secret = f"relay-{uuid.uuid4().hex}"
    guesses = [f"guess-{uuid.uuid4().hex}" for _ in range(3)] + [secret[:-1]]
    container = f"relaysecret{uuid.uuid4().hex[:8]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **child_env(),
        **prefect_api_env(),
        "RETRAIN_RELAY_WATCH": f"{container}/images",
        "RETRAIN_RELAY_SECRET": secret,
    }
    log_path = tmp_path / "relay.log"
    with log_path.open("w") as log_file:
        relay = subprocess.Popen(
            [sys.executable, "-m", "deployments.relay", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}/events"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
                    break
                except requests.ConnectionError:
                    assert relay.poll() is None and time.monotonic() < deadline
                    time.sleep(0.2)
            marker = {
                "id": str(uuid.uuid4()),
                "eventType": "Microsoft.Storage.BlobCreated",
                "subject": f"/blobServices/default/containers/{container}/blobs/images/v1/_SUCCESS",
                "data": {"eTag": '"0x8DCSECRET"'},
            }
            validation = {
                "id": str(uuid.uuid4()),
                "eventType": "Microsoft.EventGrid.SubscriptionValidationEvent",
                "data": {"validationCode": "code"},
            }
            answers = [
                requests.post(url, params={"key": secret}, json=[validation], timeout=30),
                requests.options(url, params={"key": secret}, timeout=30),
                requests.post(url, params={"key": secret}, json=[marker], timeout=30),
                requests.post(url, params={"key": secret}, json=[marker], timeout=30),
                requests.post(url, headers={"X-Relay-Key": secret}, json=[marker], timeout=30),
                requests.post(url, params={"key": secret, "x": "1"}, json="not events", timeout=30),
            ]
            refused = [
                requests.post(url, params={"key": g}, json=[marker], timeout=30) for g in guesses
            ]
        finally:
            relay.terminate()
            relay.wait(timeout=30)
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 200, 400]
    assert answers[2].json()["outcomes"] == ["started"]
    assert {r.status_code for r in refused} == {401}

    relay_log = log_path.read_text()

    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter

    async def events() -> str:
        async with get_client() as client:
            reply = await client.request(
                "POST",
                "/events/filter",
                json={
                    "filter": EventFilter(
                        event=EventNameFilter(name=["retrain.data.ready"])
                    ).model_dump(mode="json"),
                    "limit": 50,
                },
            )
        return reply.text

    deadline = time.monotonic() + 60  # the server stores events in batches
    while container not in (stored := asyncio.run(events())):
        assert time.monotonic() < deadline, "the delivery's event never reached the server"
        time.sleep(1)
    places = {"relay log": relay_log, "Prefect events": stored}
    hits = {
        (where, what)
        for where, text in places.items()
        for what in [secret, *guesses]
        if what in text
    }
    assert hits == set()
    assert "POST /events?key=REDACTED" in relay_log  # the access log is on, and was scanned
    report.record(
        "secrets",
        "relay shared secret (?key=) over 6 deliveries and 4 wrong guesses",
        "0 hits",
        places_scanned=", ".join(places),
        hits=0,
    )
