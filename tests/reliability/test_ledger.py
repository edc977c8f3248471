"""The data-version ledger and the relay's delivery handling, on the real Prefect server.

Two reporter processes race on the same versions while sends fail once; every version must be
sent exactly once. The relay must not take a delivery as handled before its send succeeded,
nor drop a quiet-period group whose send failed, and it must version quiet data as the sensor
does."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from core.data_versions import DataRoot
from deployments.events import (
    ALREADY,
    BUSY,
    LEGACY_LEDGER,
    STARTED,
    DataReady,
    already_sent,
    emit,
    migrate_legacy_ledger,
    post_event,
    record_name,
)
from deployments.sensor import find_versions
from servers.relay import BlobCreated, Debouncer, RelaySettings, create_app
from tests.conftest import ROOT, child_env, prefect_api_env
from tests.ledger_claimer import PREFIX, REVISION
from tests.reliability import report

pytestmark = pytest.mark.usefixtures("prefect_api")
SECRET = "ledger-test-secret"


def _marker(container: str, folder: str, etag: str, event_id: str | None = None) -> dict:
    event = {
        "subject": f"/blobServices/default/containers/{container}/blobs/{folder}/_SUCCESS",
        "eventType": "Microsoft.Storage.BlobCreated",
        "data": {"api": "PutBlob", "eTag": f'"{etag}"', "contentLength": 0},
        "eventTime": "2026-11-22T01:00:00Z",
        "dataVersion": "",
        "metadataVersion": "1",
    }
    if event_id:
        event["id"] = event_id
    return event


class FailOnce:
    """The real send, failing the first time for each version (the server unreachable)."""

    def __init__(self) -> None:
        self.failed: set[str] = set()
        self.sent: Counter[str] = Counter()

    def __call__(self, client: Any, ready: DataReady) -> None:
        if ready.key not in self.failed:
            self.failed.add(ready.key)
            raise ConnectionError("injected: the Prefect API did not answer")
        post_event(client, ready)
        self.sent[ready.key] += 1


@pytest.mark.parametrize("versions", [120, pytest.param(1000, marks=pytest.mark.slow)])
def test_two_reporters_racing_send_each_version_exactly_once(versions: int, tmp_path: Path) -> None:
    """120 versions are past what one Variable held (about 90 such keys in 5,000 characters);
    `make reliability` runs 1,000."""
    container = f"race-{uuid.uuid4().hex[:8]}"
    go = tmp_path / "go"
    env = {**child_env(), **prefect_api_env()}
    procs = []
    for name, remainder in (("a", 0), ("b", 1)):
        out = tmp_path / f"{name}.json"
        args = [str(out), str(go), container, str(versions), "5", str(remainder)]
        command = [sys.executable, "-m", "tests.ledger_claimer", *args]
        procs.append((out, subprocess.Popen(command, cwd=ROOT, env=env)))
    go.touch()  # both wait for it after importing Prefect, so their claims overlap
    for _, proc in procs:
        assert proc.wait(timeout=1200) == 0
    results = [json.loads(out.read_text()) for out, _ in procs]

    delivered = Counter(v for r in results for v in r["delivered"])
    everything = [f"v{i:04d}" for i in range(versions)]
    assert [r["errors"] for r in results] == [[], []]
    assert [r["left"] for r in results] == [[], []]
    assert sorted(delivered) == everything, "a version was never sent"
    assert set(delivered.values()) == {1}, "a version was sent twice"
    injected = sum(len(r["failed_once"]) for r in results)
    assert injected >= versions // 10, "the failing sends did not happen"
    keys = [DataReady(container, PREFIX, v, "test", revision=REVISION).key for v in everything]
    assert already_sent(keys) == set(keys)
    both_claimed = sum(1 for v in everything if all(v in r["outcomes"] for r in results))
    report.record(
        "adversarial",
        f"ledger: {versions} versions, two reporter processes, every 5th send fails once",
        "each version sent exactly once",
        versions=versions,
        sends_failed_once=injected,
        versions_both_tried=both_claimed,
        duplicates=sum(n - 1 for n in delivered.values()),
        lost=versions - len(delivered),
        seconds=round(max(r["seconds"] for r in results), 1),
    )


def test_a_failed_send_is_sent_on_redelivery_and_starts_one_run(deployed: dict[str, Any]) -> None:
    from tests.deployments.test_deployments import _wait_for_runs

    container = f"redeliver-{uuid.uuid4().hex[:6]}"
    post = FailOnce()
    settings = RelaySettings(watches=[DataRoot(container, "images")], shared_secret=SECRET)
    client = TestClient(create_app(settings, send=lambda r: emit(r, post)))
    delivery = [_marker(container, "images/v1", "0x8DC1", event_id=str(uuid.uuid4()))]

    first = client.post("/events", params={"key": SECRET}, json=delivery)
    assert first.status_code == 503 and first.headers["Retry-After"]
    again = client.post("/events", params={"key": SECRET}, json=delivery)  # Event Grid retries
    assert again.status_code == 200 and again.json()["outcomes"] == [STARTED]
    third = client.post("/events", params={"key": SECRET}, json=delivery)
    assert third.json()["outcomes"] == ["duplicate delivery"]

    (run,) = _wait_for_runs(deployed["retrain/on-new-data"].id, container, 1)
    assert (run.parameters["data_prefix"], run.parameters["data_version"]) == ("images", "v1")
    assert post.sent == Counter({f"{container}/images/v1@0x8DC1": 1})
    report.record(
        "adversarial",
        "relay: the send fails once, Event Grid redelivers the same event",
        "503 then started; one run",
        runs=1,
    )


def test_events_without_an_id_are_each_handled() -> None:
    container = f"noid-{uuid.uuid4().hex[:6]}"
    sent: list[DataReady] = []
    settings = RelaySettings(watches=[DataRoot(container, "images")], shared_secret=SECRET)
    client = TestClient(create_app(settings, send=lambda r: sent.append(r) or STARTED))
    for version in ("v1", "v2"):
        reply = client.post(
            "/events",
            params={"key": SECRET},
            json=[_marker(container, f"images/{version}", version)],
        )
        assert reply.json()["outcomes"] == [STARTED]
    assert [r.folder for r in sent] == ["images/v1", "images/v2"]
    report.record("adversarial", "relay: two events without an id", "both versions reported")


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ("a string", "data must be an object"),
        (["a", "list"], "data must be an object"),
        (None, "data must be an object"),
        ({"api": "PutBlob"}, "data.eTag"),
        ({"eTag": 17}, "data.eTag"),
    ],
)
def test_malformed_event_data_is_refused_with_400_naming_the_field(data: Any, named: str) -> None:
    sent: list[DataReady] = []
    settings = RelaySettings(watches=[DataRoot("landing", "images")], shared_secret=SECRET)
    client = TestClient(create_app(settings, send=lambda r: sent.append(r) or STARTED))
    event = {**_marker("landing", "images/v1", "0x1", "e1"), "data": data}
    for body in (event, [event]):
        reply = client.post("/events", params={"key": SECRET}, json=body)
        assert reply.status_code == 400 and named in reply.json()["error"]
    validation = {
        "id": "v",
        "eventType": "Microsoft.EventGrid.SubscriptionValidationEvent",
        "data": data,
    }
    reply = client.post("/events", params={"key": SECRET}, json=[validation])
    assert reply.status_code == 400
    assert sent == []
    report.record("adversarial", f"relay: event data {data!r}", f"HTTP 400 ({named})")


def test_quiet_period_relay_and_sensor_agree_and_a_failed_send_keeps_the_group(
    azurite: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from backends.blob import container_client
    from core.config import BlobLocation

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    name = f"quiet-{uuid.uuid4().hex[:8]}"
    container = container_client(BlobLocation(container=name), create=True)
    for i in range(6):  # what was there before this burst: the run trains on it too
        container.upload_blob(f"images/old/{i}.png", b"old")
    post = FailOnce()
    settings = RelaySettings(
        watches=[DataRoot(name, "images")], marker=None, quiet_seconds=0.5, shared_secret=SECRET
    )
    debouncer = Debouncer(settings, lambda r: emit(r, post))
    for i in range(10):  # the burst: Event Grid reports only these
        blob = container.upload_blob(f"images/new/{i}.png", b"new %d" % i)
        etag = blob.get_blob_properties().etag
        event = BlobCreated(f"id-{i}", name, f"images/new/{i}.png", etag, "event-grid")
        assert debouncer.accept(event) == "waiting for quiet"

    later = time.monotonic() + 3600  # any time after the quiet period
    with pytest.raises(ConnectionError):
        debouncer.flush(now=later)
    assert debouncer.pending, "the group was dropped although its version was never sent"
    (relayed,) = debouncer.flush(now=later)
    assert not debouncer.pending

    (sensed,) = find_versions(container, "images", None, quiet_seconds=0)
    assert sensed.key == relayed.key, "relay and sensor version the same data differently"
    assert emit(sensed) == ALREADY  # the sensor, polling afterwards, starts nothing
    assert sum(post.sent.values()) == 1
    report.record(
        "adversarial",
        "quiet period: send fails once; relay and sensor see the same data",
        "group kept, sent on the next flush; one version, reported once",
        relay_version=relayed.revision,
        sensor_version=sensed.revision,
    )


def test_long_keys_stale_claims_and_the_old_ledger() -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate

    tag = uuid.uuid4().hex[:8]
    sent: list[str] = []

    def post(client: Any, ready: DataReady) -> None:
        sent.append(ready.key)

    # A prefix as long as a blob name may be: the record's name stays a valid Variable name.
    long = DataReady(f"c-{tag}", "p" * 1024, "0x1", "test")
    assert len(record_name(long.key)) <= 255
    assert emit(long, post) == STARTED and emit(long, post) == ALREADY

    # A claim whose owner died before sending is taken over after the lease; a fresh one is not.
    stale, fresh = (DataReady(f"c-{tag}", "images", v, "test") for v in ("stale", "fresh"))
    with get_client(sync_client=True) as client:
        for ready, age in ((stale, timedelta(hours=2)), (fresh, timedelta(0))):
            since = (datetime.now(UTC) - age).isoformat()
            client.create_variable(
                VariableCreate(
                    name=record_name(ready.key),
                    value={"key": ready.key, "state": "sending", "since": since},
                )
            )
    assert emit(stale, post) == STARTED
    assert emit(fresh, post) == BUSY

    # The single-Variable ledger of earlier releases is carried over, then removed; its keys
    # (a root and its listing's hash, a version's folder and its marker's ETag) are still the
    # keys of the same reports.
    old = [f"c-{tag}/images@v{i}" for i in range(3)] + [f"c-{tag}/images/v7@0x7"]
    with get_client(sync_client=True) as client:
        client.create_variable(VariableCreate(name=LEGACY_LEDGER, value=old))
    assert migrate_legacy_ledger() == 4
    assert emit(DataReady(f"c-{tag}", "images", "", "test", revision="v1"), post) == ALREADY
    assert emit(DataReady(f"c-{tag}", "images", "v7", "test", revision="0x7"), post) == ALREADY
    assert migrate_legacy_ledger() == 0
    assert sent == [long.key, stale.key]
