"""Deployments on a real Prefect server: prefect.yaml deployed with the CLI, the Event Grid relay
over HTTP, the polling sensor, and the automations the server runs from the triggers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from backends.blob import container_client
from backends.local.ports import free_port
from core.config import BlobLocation
from core.data_versions import DataRoot
from deployments.sensor import find_versions, watch_new_data
from servers.relay import RelaySettings, create_app
from tests.conftest import ROOT, child_env, prefect_api_env

pytestmark = pytest.mark.usefixtures("prefect_api")
SECRET = "relay-shared-secret-for-tests"


def _runs_for(deployment_id: Any, container: str) -> list[Any]:
    async def read() -> list[Any]:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

        async with get_client() as client:
            runs = await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
            )
        return [r for r in runs if r.parameters.get("data_container") == container]

    return asyncio.run(read())


def _wait_for_runs(deployment_id: Any, container: str, count: int) -> list[Any]:
    """Until ``count`` runs exist (automations take a few seconds), then a while longer to see
    that no extra one follows."""
    deadline = time.monotonic() + 60
    while len(runs := _runs_for(deployment_id, container)) < count:
        assert time.monotonic() < deadline, f"{len(runs)} of {count} runs after 60 s"
        time.sleep(0.5)
    time.sleep(4)
    return _runs_for(deployment_id, container)


@contextlib.contextmanager
def serving_relay(settings: RelaySettings) -> Iterator[tuple[str, Any]]:
    """The relay as `python -m servers.relay` serves it (uvicorn, over HTTP): its events
    URL, and the app."""
    import uvicorn

    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/events", app
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def relay(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    settings = getattr(request, "param", None) or RelaySettings(
        watches=[DataRoot("landing", "images")], shared_secret=SECRET
    )
    if settings.marker is None:  # quiet-period mode lists the watched prefix: on Azurite
        azurite = request.getfixturevalue("azurite")
        request.getfixturevalue("monkeypatch").setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    with serving_relay(settings) as served:
        yield served


def _eg_event(container: str, name: str, etag: str = "0x8DC1", event_id: str | None = None) -> dict:
    """Microsoft.Storage.BlobCreated in the Event Grid schema, as Event Grid delivers it."""
    return {
        "topic": "/subscriptions/s/resourceGroups/g/providers/Microsoft.Storage/storageAccounts/a",
        "subject": f"/blobServices/default/containers/{container}/blobs/{name}",
        "eventType": "Microsoft.Storage.BlobCreated",
        "id": event_id or str(uuid.uuid4()),
        "data": {
            "api": "PutBlob",
            "eTag": f'"{etag}"',
            "contentType": "image/png",
            "contentLength": 524,
            "blobType": "BlockBlob",
            "url": f"https://a.blob.core.windows.net/{container}/{name}",
            "sequencer": "00000000000004420000000000028963",
        },
        "dataVersion": "",
        "metadataVersion": "1",
        "eventTime": "2026-11-22T01:00:00.0000000Z",
    }


def _cloud_event(container: str, name: str, etag: str) -> dict:
    event = _eg_event(container, name, etag)
    return {
        "specversion": "1.0",
        "type": event["eventType"],
        "source": event["topic"],
        "id": event["id"],
        "time": event["eventTime"],
        "subject": event["subject"],
        "data": event["data"],
    }


# How long a test waits for the relay's answer: a bound on a hang, not a speed check. The relay
# answers a marker through the Prefect API (its ledger, the run), whose SQLite server took more
# than Event Grid's 30 s on a machine loaded to 5 runnable processes per core; Event Grid would
# then deliver again, which the ledger answers as a duplicate (tested below).
ANSWER_WITHIN = 120


def _post(url: str, body: Any, key: str | None = SECRET, **headers: str) -> requests.Response:
    params = {"key": key} if key else None
    return requests.post(
        url,
        params=params,
        json=body,
        timeout=ANSWER_WITHIN,
        headers={"aeg-event-type": "Notification", **headers},
    )


def test_prefect_yaml_deployments(deployed: dict[str, Any]) -> None:
    nightly = deployed["retrain/nightly"]
    (schedule,) = nightly.schedules
    assert schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone == "UTC"
    follow = {"overrides": ["training.follow_champion=true"]}
    for name, extra in (
        ("retrain/manual", {}),
        ("retrain/nightly", follow),
        ("retrain/on-new-data", follow),
    ):
        d = deployed[name]
        assert d.parameters == {"config_path": "configs/local.yaml", **extra}
        assert d.work_pool_name == "retrain-workers"
        assert d.global_concurrency_limit.limit == 1
        assert d.concurrency_options.collision_strategy == "ENQUEUE"
    assert deployed["watch-new-data/poll"].schedules[0].schedule.interval.total_seconds() == 600
    labelling = deployed["label-images/manual"]
    assert labelling.parameters == {"config_path": "configs/local.yaml"}
    assert labelling.parameter_openapi_schema["required"] == ["container"]
    # The trigger in prefect.yaml is the one the server holds as an automation.
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    (trigger,) = next(d for d in spec["deployments"] if d["name"] == "on-new-data")["triggers"]
    assert trigger["expect"] == ["retrain.data.ready"]


def test_one_run_at_a_time_and_a_cancelled_run_gives_its_slot_back(
    deployed: dict[str, Any],
) -> None:
    """What the service's one-at-a-time rests on, and what each test's clean-up relies on: a
    second run of a deployment is refused a slot while the first is Pending, and a run that is
    cancelled with no process behind it (the UI's cancel of an orphaned run) gives it back."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Pending

    from tests.pipeline_helpers import cancel_runs_left_unfinished

    first, second = (run_deployment("retrain/on-new-data", timeout=0) for _ in range(2))
    with get_client(sync_client=True) as client:
        assert client.set_flow_run_state(first.id, Pending()).status.value == "ACCEPT"
        refused = client.set_flow_run_state(second.id, Pending())
        assert refused.status.value == "REJECT"
        assert "concurrency limit" in str(refused.details)
        cancelled = cancel_runs_left_unfinished([first.deployment_id], "orphaned")
        assert {r.id for r in cancelled} == {first.id, second.id}
        assert client.read_flow_run(first.id).state_type.value == "CANCELLED"
        third = run_deployment("retrain/on-new-data", timeout=0)
        assert client.set_flow_run_state(third.id, Pending()).status.value == "ACCEPT"


def _defaults(schema: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """Every field's default in a form section, nested sections followed through their $ref."""
    values = {}
    for name, field in schema["properties"].items():
        ref = field.get("$ref") or next(
            (a["$ref"] for a in field.get("anyOf", []) if "$ref" in a), None
        )
        if ref is not None and "default" not in field:
            values[name] = _defaults(definitions[ref.rsplit("/", 1)[1]], definitions)
        else:
            values[name] = field["default"]  # a field without one would start empty
    return values


def test_the_run_form_starts_from_what_a_person_changes(deployed: dict[str, Any]) -> None:
    from core.config import load_config

    # The deployment's parameter schema, as the server holds it and the UI renders it.
    schema = deployed["retrain/manual"].parameter_openapi_schema
    fields = schema["properties"]
    order = sorted(fields, key=lambda name: fields[name]["position"])
    assert order[:6] == [
        "epochs",
        "model",
        "data_container",
        "data_prefix",
        "data_version",
        "force",
    ]
    assert order[-1] == "config"
    for name, field in fields.items():
        assert len(field.get("description") or "") > 30, f"{name} is not described"
    assert fields["force"]["default"] is False
    assert fields["model"]["enum"] == ["cnn", "resnet18", "resnet50"]
    # Optional fields are of one plain type with no default: the UI shows them without a type
    # toggle and leaves an untouched one out of the run (a null default it would send, and a
    # plain type refuse). The advanced section keeps its toggle: it says whether it is used.
    plain = {name: field for name, field in fields.items() if name != "config"}
    for name, field in plain.items():
        assert "anyOf" not in field and field.get("type") != "null", name
        assert field.get("default", "absent") is not None, name
    assert {f["type"] for f in plain.values()} == {"integer", "string", "boolean", "array"}
    assert [a.get("type") for a in fields["config"]["anyOf"]] == [None, "null"]
    assert "section.field=value" in fields["overrides"]["description"]
    assert "training.lr=0.1" in fields["overrides"]["description"]
    assert fields["data_version"]["description"].startswith("The data version to train")
    assert fields["config"]["description"].startswith("Advanced")
    # The advanced section starts from the shipped config, every field of it; nothing in it
    # is required (data and output containers included).
    definitions = schema["definitions"]
    form = definitions["PipelineConfig"]
    shipped = load_config(ROOT / "configs" / "local.yaml").model_dump(mode="json")
    assert _defaults(form, definitions) == shipped
    assert not form.get("required")
    assert not any(d.get("required") for d in definitions.values())


def test_validation_handshakes_are_answered(relay: tuple[str, Any]) -> None:
    url, _ = relay
    validation = [
        {
            "id": "2d1781af-3a4c-4d7c-bd0c-e34b19da4e66",
            "topic": "/subscriptions/s/resourceGroups/g/providers/Microsoft.Storage/"
            "storageAccounts/a",
            "subject": "",
            "data": {
                "validationCode": "512d38b6-c7b8-40c8-89fe-f46f9e9622b6",
                "validationUrl": "https://rp-eastus2.eventgrid.azure.net/...",
            },
            "eventType": "Microsoft.EventGrid.SubscriptionValidationEvent",
            "eventTime": "2026-11-22T01:00:00Z",
            "metadataVersion": "1",
            "dataVersion": "1",
        }
    ]
    reply = _post(url, validation, **{"aeg-event-type": "SubscriptionValidation"})
    assert reply.status_code == 200
    assert reply.json() == {"validationResponse": "512d38b6-c7b8-40c8-89fe-f46f9e9622b6"}
    options = requests.options(
        url,
        params={"key": SECRET},
        timeout=ANSWER_WITHIN,
        headers={"WebHook-Request-Origin": "eventgrid.azure.net"},
    )
    assert options.status_code == 200
    assert options.headers["WebHook-Allowed-Origin"] == "eventgrid.azure.net"


def test_requests_without_valid_credentials_are_refused_and_start_nothing(
    deployed: dict[str, Any], relay: tuple[str, Any]
) -> None:
    url, app = relay
    events = [_eg_event("landing", "images/v9/_SUCCESS", "0xBAD")]
    assert _post(url, events, key=None).status_code == 401
    assert _post(url, events, key="wrong-secret").status_code == 401
    assert (
        requests.post(
            url, json=events, timeout=ANSWER_WITHIN, headers={"Authorization": "Bearer not-a-token"}
        ).status_code
        == 401
    )
    assert requests.options(url, timeout=30).status_code == 401
    assert not app.state.debouncer.seen_ids
    time.sleep(3)
    assert _runs_for(deployed["retrain/on-new-data"].id, "landing") == []


def test_a_burst_for_one_version_starts_exactly_one_run(
    prefect_database: str, deployed: dict[str, Any], relay: tuple[str, Any]
) -> None:
    url, _ = relay
    container = "landing"
    blobs = [f"images/v1/train/{i % 10}/img{i:04d}.png" for i in range(300)]
    for start in range(0, len(blobs), 50):  # Event Grid delivers in batches
        reply = _post(url, [_eg_event(container, b) for b in blobs[start : start + 50]])
        assert reply.status_code == 200
        assert set(reply.json()["outcomes"]) == {"waiting for the marker"}
    marker = _eg_event(container, "images/v1/_SUCCESS", "0x8DCF00D")
    assert _post(url, [marker]).json()["outcomes"] == ["started"]
    assert _post(url, [marker]).json()["outcomes"] == ["duplicate delivery"]  # a retry
    replay = {**marker, "id": str(uuid.uuid4())}  # the same blob version, another event
    assert _post(url, [replay]).json()["outcomes"] == ["version already started"]
    # Other containers and prefixes are not this relay's business.
    assert _post(url, [_eg_event("other", "images/v1/_SUCCESS")]).json()["outcomes"] == [
        "not watched"
    ]

    (run,) = _wait_for_runs(deployed["retrain/on-new-data"].id, container, 1)
    # The data root and the version below it: the run trains exactly that version.
    assert run.parameters == {
        "config_path": "configs/local.yaml",
        "overrides": ["training.follow_champion=true"],
        "data_container": "landing",
        "data_prefix": "images",
        "data_version": "v1",
    }


def test_cloudevents_schema_and_a_new_version_start_a_second_run(
    deployed: dict[str, Any], relay: tuple[str, Any]
) -> None:
    url, _ = relay
    container = "landing"
    body = [_cloud_event(container, "images/v2/_SUCCESS", "0x8DC2222")]
    reply = _post(url, body, **{"Content-Type": "application/cloudevents-batch+json"})
    assert reply.status_code == 200 and reply.json()["outcomes"] == ["started"]
    runs = _wait_for_runs(deployed["retrain/on-new-data"].id, container, 2)
    assert {(r.parameters["data_prefix"], r.parameters["data_version"]) for r in runs} == {
        ("images", "v1"),
        ("images", "v2"),
    }


@pytest.mark.parametrize(
    "relay",
    [
        RelaySettings(
            watches=[DataRoot("quiet-landing", "")],
            marker=None,
            quiet_seconds=1.0,
            shared_secret=SECRET,
        )
    ],
    indirect=True,
)
def test_quiet_period_mode_reports_a_burst_once(
    deployed: dict[str, Any], relay: tuple[str, Any]
) -> None:
    url, _ = relay
    container = container_client(BlobLocation(container="quiet-landing"), create=True)
    etags = [
        container.upload_blob(f"batch/{i}.png", b"png").get_blob_properties().etag
        for i in range(200)
    ]
    for start in range(0, 200, 50):  # Event Grid reports them in batches
        events = [
            _eg_event("quiet-landing", f"batch/{i}.png", etags[i]) for i in range(start, start + 50)
        ]
        assert set(_post(url, events).json()["outcomes"]) == {"waiting for quiet"}
    (run,) = _wait_for_runs(deployed["retrain/on-new-data"].id, "quiet-landing", 1)
    (sensed,) = find_versions(container, "", None, quiet_seconds=0)
    assert run.parameters["data_prefix"] == "" and run.parameters["data_version"] == ""
    from deployments.events import already_sent

    assert already_sent([sensed.key]) == {sensed.key}  # the relay reported the sensor's key


def test_entra_token_is_accepted_and_a_wrong_audience_refused(tmp_path: Path) -> None:
    import jwt
    from cryptography.hazmat.primitives.asymmetric import rsa
    from starlette.testclient import TestClient

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig"}]}))
    tenant = "11111111-2222-3333-4444-555555555555"
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    keys_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=keys_server.serve_forever, daemon=True).start()
    settings = RelaySettings(
        watches=[DataRoot("landing", "images")],
        entra_audience="api://retrain-relay",
        entra_tenant=tenant,
        jwks_url=f"http://127.0.0.1:{keys_server.server_address[1]}/keys.json",
    )

    def token(audience: str) -> str:
        claims = {
            "aud": audience,
            "iss": f"https://login.microsoftonline.com/{tenant}/v2.0",
            "exp": int(time.time()) + 600,
            "appid": "eventgrid",
        }
        return jwt.encode(claims, key, algorithm="RS256", headers={"kid": "k1"})

    sent: list[Any] = []
    client = TestClient(create_app(settings, send=lambda r: sent.append(r) or "started"))
    marker = [_eg_event("landing", "images/v5/_SUCCESS", "0xE")]
    good = client.post(
        "/events", json=marker, headers={"Authorization": f"Bearer {token('api://retrain-relay')}"}
    )
    assert good.status_code == 200 and [r.key for r in sent] == ["landing/images/v5@0xE"]
    bad = client.post(
        "/events", json=marker, headers={"Authorization": f"Bearer {token('api://someone-else')}"}
    )
    assert bad.status_code == 401 and len(sent) == 1
    keys_server.shutdown()


def test_relay_refuses_to_start_without_authentication() -> None:
    from servers.relay import RelayConfigError

    with pytest.raises(RelayConfigError, match="RETRAIN_RELAY_SECRET"):
        RelaySettings.from_env({"RETRAIN_RELAY_WATCH": "landing/images"})
    with pytest.raises(RelayConfigError, match="name no data root"):
        RelaySettings.from_env({"RETRAIN_RELAY_SECRET": "x"})


def test_the_relay_watches_the_data_roots_its_configs_name(tmp_path: Path) -> None:
    """RETRAIN_RELAY_CONFIG: the relay watches the data root a run of that config trains from,
    and reports a version only for a marker directly below it."""
    from starlette.testclient import TestClient

    from servers.relay import RelayConfigError

    config = tmp_path / "team.yaml"
    base = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    config.write_text(yaml.safe_dump({**base, "data": {**base["data"], "prefix": "images"}}))
    env = {"RETRAIN_RELAY_CONFIG": str(config), "RETRAIN_RELAY_SECRET": SECRET}
    settings = RelaySettings.from_env(env)
    assert settings.watches == [DataRoot("training-data", "images")]
    with pytest.raises(RelayConfigError, match="_SUCCESS marker"):
        RelaySettings.from_env({**env, "RETRAIN_RELAY_MARKER": "DONE"})
    with pytest.raises(RelayConfigError, match="does not exist"):
        RelaySettings.from_env({**env, "RETRAIN_RELAY_CONFIG": str(tmp_path / "none.yaml")})

    sent: list[Any] = []
    client = TestClient(create_app(settings, send=lambda r: sent.append(r) or "started"))
    blobs = ["images/v3/train/0/a.png", "images/v3/deep/_SUCCESS", "images/v3/_SUCCESS"]
    reply = client.post(
        "/events",
        params={"key": SECRET},
        json=[_eg_event("training-data", b, f"0xE{i}") for i, b in enumerate(blobs)],
    )
    assert reply.json()["outcomes"] == [
        "waiting for the marker",
        "not a version marker: versions are folders directly below the root",
        "started",
    ]
    (ready,) = sent
    assert (ready.container, ready.prefix, ready.data_version) == ("training-data", "images", "v3")
    assert ready.key == "training-data/images/v3@0xE2"
    assert ready.event()["payload"]["revision"] == "0xE2"


def test_the_sensor_reports_complete_versions_and_refuses_a_mixed_root(
    azurite: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.data_versions import DataVersionError

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    container = container_client(
        BlobLocation(container=f"mixed-{uuid.uuid4().hex[:8]}"), create=True
    )
    for name in ("images/v1/train/0/a.png", "images/v2/train/0/a.png", "images/v3/test/0/b.png"):
        container.upload_blob(name, b"png")
    container.upload_blob("images/v2/_SUCCESS", b"")
    time.sleep(1.1)  # Last-Modified counts seconds: markers of one second go by name
    container.upload_blob("images/v1/_SUCCESS", b"")  # completed after v2
    container.upload_blob("images/v1/deep/_SUCCESS", b"")  # completes nothing of this root
    found = find_versions(container, "images", "_SUCCESS", 0)
    assert [(r.prefix, r.data_version) for r in found] == [("images", "v2"), ("images", "v1")]
    assert [r.blob for r in found] == ["images/v2/_SUCCESS", "images/v1/_SUCCESS"]
    container.upload_blob("images/train/0/loose.png", b"png")
    with pytest.raises(DataVersionError, match=r"loose files \(train/\) and data versions"):
        find_versions(container, "images", "_SUCCESS", 0)


def test_polling_sensor_fires_once_per_new_data_version(
    deployed: dict[str, Any], azurite: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    name = f"sensed-{uuid.uuid4().hex[:8]}"
    container = container_client(BlobLocation(container=name), create=True)
    config = tmp_path / "sensor.yaml"
    base = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    base["data"] = {**base["data"], "container": name, "prefix": "images"}
    config.write_text(yaml.safe_dump(base))

    for i in range(20):
        container.upload_blob(f"images/v1/train/{i % 2}/{i}.png", b"png")
    assert watch_new_data(config_path=str(config)) == []  # no marker yet: not ready
    container.upload_blob("images/v1/_SUCCESS", b"")
    first = watch_new_data(config_path=str(config))
    assert len(first) == 1 and first[0].startswith(f"{name}/images/v1@")
    assert watch_new_data(config_path=str(config)) == []  # the watermark holds it
    container.upload_blob("images/v2/train/0/a.png", b"png")
    container.upload_blob("images/v2/_SUCCESS", b"")
    second = watch_new_data(config_path=str(config))
    assert len(second) == 1 and second[0].startswith(f"{name}/images/v2@")

    runs = _wait_for_runs(deployed["retrain/on-new-data"].id, name, 2)
    assert sorted(r.parameters["data_version"] for r in runs) == ["v1", "v2"]
    assert {r.parameters["data_prefix"] for r in runs} == {"images"}


def test_the_relay_listens_on_loopback_unless_told_otherwise(tmp_path: Path) -> None:
    """Event Grid reaches it through a TLS proxy on the same machine: listening on every
    interface by default would offer the plain-HTTP endpoint to the whole network."""
    import psutil

    from tests.conftest import child_env

    port = free_port()
    env = {**child_env(), "RETRAIN_RELAY_WATCH": "landing/images", "RETRAIN_RELAY_SECRET": SECRET}
    relay = subprocess.Popen(
        [sys.executable, "-m", "servers.relay", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).ok:
                    break
            except requests.ConnectionError:
                pass
            assert relay.poll() is None and time.monotonic() < deadline, "the relay did not start"
            time.sleep(0.2)
        listening = {
            c.laddr.ip
            for c in psutil.Process(relay.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        }
        assert listening == {"127.0.0.1"}
    finally:
        relay.terminate()
        relay.wait(timeout=30)


def test_a_scheduled_run_trains_the_config_the_deployments_were_registered_with(
    deployed: dict[str, Any], azurite: str, tmp_path: Path
) -> None:
    """Registered with RETRAIN_FORM_CONFIG (as `make azure-up` and `make service --config`
    register them), the nightly's scheduled run, started as the worker starts it, trains that
    config. Before, prefect.yaml gave every deployment configs/local.yaml, whatever config the
    deployments were registered with: a nightly registered for Azure trained the local target."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.states import Scheduled

    from tests.deployments.test_new_data_path import _service_config
    from tests.pipeline_helpers import execute_as_worker, flow_run_logs

    registered = _service_config(tmp_path)
    config = yaml.safe_load(registered.read_text())
    # Data this config alone names, behind a variable no one sets: the run stops at the gate.
    missing = f"RETRAIN_REGISTERED_ONLY_{uuid.uuid4().hex[:8].upper()}"
    config["data"] = {**config["data"], "connection_string_env": missing}
    registered.write_text(yaml.safe_dump(config))
    nightly = deployed["retrain/nightly"]
    env = {**prefect_api_env(), "RETRAIN_FORM_CONFIG": str(registered)}
    deploy = [str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deploy"]
    proc = subprocess.run(
        [*deploy, "--name", "retrain/nightly"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        with get_client(sync_client=True) as client:
            assert client.read_deployment(nightly.id).parameters == {
                "config_path": str(registered),
                "overrides": ["training.follow_champion=true"],
            }
            # What the server's scheduler does each loop, asked for now: the cron's next runs.
            client.request("POST", "/deployments/{id}/schedule", path_params={"id": nightly.id})
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    deployment_id=FlowRunFilterDeploymentId(any_=[nightly.id])
                )
            )
        scheduled = [r for r in runs if r.auto_scheduled and r.state_name == "Scheduled"]
        assert scheduled, [(r.name, r.state_name) for r in runs]
        run = scheduled[0]
        assert run.parameters["config_path"] == str(registered)
        # Its time has come (the server would not let it run before 02:00): then the worker
        # starts it.
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(
                run.id, Scheduled(scheduled_time=datetime.now(UTC)), force=True
            )
        worker_env = {**child_env(), **env, "AZURE_STORAGE_CONNECTION_STRING": azurite}
        state, output = execute_as_worker(run, worker_env)
        logs = flow_run_logs(run.id)
        assert f"config: the config file {registered};" in logs, output + logs
        assert state.is_failed() and missing in (state.message or "") + logs, output + logs
    finally:
        with get_client(sync_client=True) as client:
            client.update_deployment(nightly.id, DeploymentUpdate(parameters=nightly.parameters))
