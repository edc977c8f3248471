"""Secrets: the whole local flow run, started from the CLI, with recognisable secrets in its
environment (an account key, a SAS connection string, credentials under names no filter would
guess); every log, artifact, Prefect database row, output blob, local file, CLI line, and the
command line and environment of every task process it started is scanned for them."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
import yaml

from backends.blob import container_client
from backends.local.ports import free_port
from flows.retrain import main
from imagedata.make_images import write_digits
from tests.pipeline_helpers import flow_run_logs, make_config, seed, task_runs_and_artifacts
from tests.reliability import report

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

    from backends.local.azurite import running_azurite

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


def _sas_connection_string(account_connection_string: str, key: str) -> tuple[str, str]:
    """A connection string holding an account SAS (read, write, list, create, delete) for the
    private account, and the signature in it as it appears in a URL (percent-encoded)."""
    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    parts = dict(p.split("=", 1) for p in account_connection_string.split(";") if "=" in p)
    now = datetime.now(UTC)
    sas = generate_account_sas(
        parts["AccountName"],
        key,
        ResourceTypes(service=True, container=True, object=True),
        AccountSasPermissions(read=True, write=True, delete=True, list=True, add=True, create=True),
        expiry=now + timedelta(hours=2),
        start=now - timedelta(minutes=5),
    )
    (signature,) = [v for k, _, v in (p.partition("=") for p in sas.split("&")) if k == "sig"]
    return f"BlobEndpoint={parts['BlobEndpoint']};SharedAccessSignature={sas}", signature


@contextlib.contextmanager
def task_processes(pool_id: str) -> Iterator[dict[tuple[str, bytes], tuple[str, str]]]:
    """Samples, while open, the command line and environment of every process a task of the
    pool runs (recognised by the pool id the cluster gives it, as Batch does)."""
    seen: dict[tuple[str, bytes], tuple[str, str]] = {}
    marker = f"AZ_BATCH_POOL_ID={pool_id}".encode()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    environ = Path(entry.path, "environ").read_bytes()
                    if marker not in environ.split(b"\0"):
                        continue
                    cmdline = Path(entry.path, "cmdline").read_bytes()
                except OSError:
                    continue
                seen[(entry.name, cmdline)] = (
                    cmdline.replace(b"\0", b" ").decode(errors="replace"),
                    environ.replace(b"\0", b"\n").decode(errors="replace"),
                )
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        stop.set()
        sampler.join()


def _flow_run_id(run_id: str) -> Any:
    """The flow run behind a run id (which ends with the first 8 characters of its id)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    async def read() -> list[Any]:
        async with get_client() as client:
            return await client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=50)

    return next(r.id for r in asyncio.run(read()) if str(r.id).startswith(run_id[-8:]))


def _database_rows(flow_run_id: Any) -> str:
    """Every row of every table of the Prefect server's database, once the events of this
    flow run (written in batches by the server) are in it."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    path = str(PREFECT_SERVER_DATABASE_CONNECTION_URL.value()).split(":///", 1)[1]
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        for _ in range(300):
            (done,) = db.execute(
                "SELECT count(*) FROM events WHERE resource_id = ? AND event = ?",
                (f"prefect.flow-run.{flow_run_id}", "prefect.flow-run.Completed"),
            ).fetchone()
            if done:
                break
            time.sleep(0.2)
        assert done, "the flow run's events never reached the database"
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return "\n".join(
            repr(row) for table in tables for row in db.execute(f'SELECT * FROM "{table}"')
        )
    finally:
        db.close()


def test_no_secret_in_logs_artifacts_database_outputs_or_task_processes(
    private_account: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    azurite, account_key = private_account
    sas_connection, signature = _sas_connection_string(azurite, account_key)
    unique = base64.b32encode(os.urandom(10)).decode()
    planted = {
        # The data through the account key, the outputs through a SAS connection string.
        "AZURE_STORAGE_CONNECTION_STRING": azurite,
        "RETRAIN_OUTPUTS_CONNECTION": sas_connection,
        "RETRAIN_OUTPUTS_SAS": f"https://a.blob.core.windows.net/c?{FAKE_SAS}",
        "AZURE_STORAGE_KEY": FAKE_KEY,
        # Credentials under names that no name filter would catch.
        "STORAGE_CONN": f"storage-conn-{unique}",
        "PREFECT_API_KEY": f"pnu_{unique}",
        "HTTPS_PROXY": f"http://retrain:proxy-pw-{unique}@proxy.invalid:3128",
        "DATABASE_URL": f"postgresql://retrain:db-pw-{unique}@db.invalid/prefect",
    }
    for name, value in planted.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    source = tmp_path / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=40)
    config = make_config(
        tmp_path, "training.epochs=2", "output.connection_string_env=RETRAIN_OUTPUTS_CONNECTION"
    )
    seed(config, source)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))

    with task_processes(config.pool.id) as processes:
        code = main(["--config", str(config_file)])
    cli = capsys.readouterr()
    assert code == 0, cli.out + cli.err
    assert len(processes) >= 3, "no task process was seen: the scan would prove nothing"

    secrets = {
        "account key": account_key,
        "SAS signature": signature,
        "SAS signature (decoded)": unquote(signature),
        "SAS connection string": sas_connection,
        "key connection string": azurite,
        "fake SAS signature": "RETRAINFAKESIGNATURE",
        "key variable": FAKE_KEY,
        "STORAGE_CONN": planted["STORAGE_CONN"],
        "PREFECT_API_KEY": planted["PREFECT_API_KEY"],
        "proxy password": f"proxy-pw-{unique}",
        "database password": f"db-pw-{unique}",
    }
    run_id = next(
        line.split()[1].rstrip(":") for line in cli.out.splitlines() if line.startswith("run ")
    )
    flow_run_id = _flow_run_id(run_id)
    task_runs, artifacts = task_runs_and_artifacts(flow_run_id)
    places: dict[str, str] = {
        "CLI output": cli.out + cli.err,
        "logs": flow_run_logs(flow_run_id),
        "artifacts": json.dumps([a.data for a in artifacts], default=str),
        "flow run parameters": json.dumps(_flow_run(flow_run_id).parameters, default=str),
        "task run inputs": json.dumps([r.task_inputs for r in task_runs.values()], default=str),
        "Prefect database (every row: events, artifacts, runs, logs)": _database_rows(flow_run_id),
        "task command lines": "\n".join(cmd for cmd, _ in processes.values()),
        "task environments": "\n".join(env for _, env in processes.values()),
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
    # The links are plain addresses of the outputs: the gateway's, then the blob path.
    links_url = config.output.links_url
    assert f"outputs: {links_url}/runs/{run_id}/\n" in cli.out
    links = [a.data for a in artifacts if isinstance(a.data, str) and a.data.startswith("[")]
    assert f"({links_url}/runs/{run_id}/model.pt)" in "".join(links)
    report.record(
        "secrets",
        "local flow from the CLI: account key, SAS connection string, fake SAS and key "
        "variables, STORAGE_CONN, PREFECT_API_KEY, proxy URL with a password, DATABASE_URL",
        "0 hits",
        places_scanned=", ".join(places),
        task_processes=len(processes),
        files_scanned=len(local),
        output_blobs=len(list(outputs.list_blobs())),
        hits=0,
    )


def test_relay_secret_is_in_no_log_and_no_event(tmp_path: Path) -> None:
    """The relay as documented (`python -m servers.relay`, uvicorn's access log on): Event
    Grid puts the shared secret in the endpoint's query string (`?key=`). Deliveries, the
    validation handshake and wrong guesses must leave it out of the relay's output, and out of
    the events and flow runs it causes."""
    import subprocess
    import sys
    import time
    import uuid

    import requests

    from tests.conftest import ROOT, child_env, prefect_api_env

    secret = f"relay-{uuid.uuid4().hex}"
    guesses = [f"guess-{uuid.uuid4().hex}" for _ in range(3)] + [secret[:-1]]
    container = f"relaysecret{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {
        **child_env(),
        **prefect_api_env(),
        "RETRAIN_RELAY_WATCH": f"{container}/images",
        "RETRAIN_RELAY_SECRET": secret,
    }
    log_path = tmp_path / "relay.log"
    with log_path.open("w") as log_file:
        relay = subprocess.Popen(
            [sys.executable, "-m", "servers.relay", "--host", "127.0.0.1", "--port", str(port)],
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
            ] + [  # the secret in spellings the authenticator does not take, logged as sent
                requests.post(f"{url}?KEY={secret}", json=[marker], timeout=30),
                requests.post(f"{url}?x=1;key={secret}", json=[marker], timeout=30),
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
    assert "POST /events?query=REDACTED" in relay_log  # the access log is on, and was scanned
    report.record(
        "secrets",
        "relay shared secret (?key=) over 6 deliveries, 4 wrong guesses and 2 odd spellings",
        "0 hits",
        places_scanned=", ".join(places),
        hits=0,
    )


def test_task_environment_is_an_allow_list(
    azurite: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A task gets what a Batch node has, on the local cluster and on the (fake) Batch node:
    none of the orchestrator's credentials, whatever their names."""
    from backends.local.cluster import LocalCluster
    from backends.taskspec import TaskSpec
    from tests.fakes.node import PoolNodes
    from tests.nodes_helpers import NODES, require_emulated_nodes

    unique = base64.b32encode(os.urandom(10)).decode()
    planted = {
        "AZURE_STORAGE_CONNECTION_STRING": azurite,
        "STORAGE_CONN": f"storage-conn-{unique}",
        "PREFECT_API_KEY": f"pnu_{unique}",
        "HTTPS_PROXY": f"http://retrain:proxy-pw-{unique}@proxy.invalid:3128",
        "DATABASE_URL": f"postgresql://retrain:db-pw-{unique}@db.invalid/prefect",
        "MY_APP_CONFIG": f"anything-{unique}",
    }
    for name, value in planted.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "WARNING")  # tuning a node's image may carry
    outputs = container_client(make_config(tmp_path).output, create=True)
    cluster = LocalCluster(tmp_path / "work", "p", 1, tmp_path / "nfs", tmp_path / "share", outputs)
    cluster.ensure_pool()
    lines: list[str] = []
    spec = TaskSpec("env", "/bin/bash -c env", environment={"FROM_THE_SPEC": "1"})
    assert cluster.run_task(spec, lines.append).exit_code == 0
    require_emulated_nodes()
    with PoolNodes(tmp_path / "node", NODES[:1], tmp_path / "node-nfs", lambda _: None) as node:
        body = {"id": "env", "commandLine": "/bin/bash -c env"}
        run = node.start(body, "job", env={"FROM_THE_SPEC": "1"})
        assert run.wait(timeout=120) == 0
        on_node = run.primary.stdout()
    for where, text in (("local cluster", "\n".join(lines)), ("Batch node", on_node)):
        seen = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        leaked = [name for name, value in planted.items() if value in text]
        assert leaked == [] and unique not in text, f"{where} passed {leaked}"
        assert seen["FROM_THE_SPEC"] == "1" and "AZ_BATCH_NODE_MOUNTS_DIR" in seen
    # The local cluster keeps what a node image would set for Horovod, and the user's home.
    local = dict(line.split("=", 1) for line in lines if "=" in line)
    assert local["HOROVOD_LOG_LEVEL"] == "WARNING" and local["HOME"] == os.environ["HOME"]
    report.record(
        "secrets",
        "task environment: an allow-list (local cluster and Batch node)",
        "0 hits",
        planted=", ".join(planted),
        hits=0,
    )
