"""The one event that starts a retrain on new data, and the ledger that makes it start once.

Both the Event Grid relay and the polling sensor report a data version as ready with
``retrain.data.ready``; the ``retrain/on-new-data`` deployment's trigger turns it into a flow
run. The event names the data root (``container``, ``prefix``) and the version below it
(``data_version``: the folder's name, "" for a root without versions), as
``core.data_versions`` defines them, so the run it starts trains exactly that version; the
trigger in prefect.yaml templates these three fields into the run's parameters of the same
names. Each report of a version has a key (the version's folder and its ``revision``: its
marker's ETag, so a version completed again is a new report) and, in the ledger, a record of
its own: a Prefect Variable named for the key's hash. One record per version keeps the ledger
unbounded (a Variable holds at most 5,000 characters, so one list of keys fills up after a few
dozen versions), and a claim is the record's creation, which the server does atomically (a
second create of the same name is refused with 409), so two reporters racing on one version
cannot both win. The record says ``sending`` while its owner sends the event and ``sent`` once
the server took it; a failed send deletes it, so the next delivery or poll sends again. A claim
whose owner died mid-send is taken over after ``LEASE_SECONDS`` by deleting that record by its
id (only one taker can) and claiming afresh. Every report of a version carries the same event
id, so a version sent again by such a takeover is also dropped by the server's trigger service,
which remembers the ids it processed for 30 minutes (longer than the lease).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from core.data_versions import DataRoot

EVENT = "retrain.data.ready"
RECORD_PREFIX = "retrain-data-version-"  # + sha256 of the key: 85 characters, [a-z0-9-]
RECORD_TAG = "retrain-data-version"
LEGACY_LEDGER = "retrain-data-versions-seen"  # the one-Variable list older releases kept
LEASE_SECONDS = 600.0  # a `sending` record older than this lost its owner
log = logging.getLogger("retrain.events")
_NAMESPACE = uuid.UUID("6f1b7c52-9a53-4c0e-9b7e-1d0f3c2a8e11")

# What ``emit`` says about a version.
STARTED = "started"
ALREADY = "version already started"
BUSY = "version being started by another reporter"  # try again later: it may yet fail


@dataclass(frozen=True)
class DataReady:
    container: str
    prefix: str  # the data root
    data_version: str  # the version's folder below the root; "" for a root without versions
    source: str  # "event-grid", "cloudevents" or "sensor"
    blob: str = ""  # the blob that completed the version, when there is one
    # Which completion of the version: its marker's ETag; in quiet-period mode (no markers) a
    # hash of the root's listing.
    revision: str = ""

    @property
    def folder(self) -> str:
        return DataRoot(self.container, self.prefix).folder(self.data_version or None)

    @property
    def key(self) -> str:
        # The same key earlier releases gave a version (its folder and marker ETag, or a root
        # and its listing's hash), so their ledger records still hold.
        return f"{self.container}/{self.folder}@{self.revision}"

    def event(self) -> dict[str, Any]:
        return {
            # The same id for every report of a version: the server may drop repeats too.
            "id": str(uuid.uuid5(_NAMESPACE, self.key)),
            "occurred": datetime.now(UTC).isoformat(),
            "event": EVENT,
            "resource": {
                "prefect.resource.id": f"retrain.data.{self.container}",
                "prefect.resource.name": f"{self.container}/{self.folder}",
            },
            "payload": asdict(self),
        }


def normalize_etag(etag: Any) -> str:
    """An ETag as both sources see it: listings and Event Grid quote it, or not."""
    return str(etag or "").strip().strip('"')


def listing_version(blobs: Iterable[tuple[str, Any]]) -> str:
    """The version of the data under a prefix: a hash of its blob names and ETags."""
    listing = sorted((name, normalize_etag(etag)) for name, etag in blobs)
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]


def quiet_version(container: Any, prefix: str) -> tuple[str, datetime] | None:
    """(revision, newest blob's time) of everything under ``prefix``; None when it is empty.

    The one definition of a quiet-period revision (a data root without markers, so without
    versions), used by the relay (when its quiet period ends) and the sensor (on each poll):
    the same data has one revision however it was noticed, so relay and sensor together start
    one run. It is the whole listing, not the blobs one burst of events named, since the run
    trains on the whole root."""
    from backends.blob import folder

    blobs = list(container.list_blobs(name_starts_with=folder(prefix)))
    if not blobs:
        return None
    newest = max(b.last_modified for b in blobs)
    return listing_version((b.name, b.etag) for b in blobs), newest


def record_name(key: str) -> str:
    return RECORD_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def _value(key: str, state: str) -> dict[str, str]:
    return {"key": key[:2000], "state": state, "since": datetime.now(UTC).isoformat()}


def _stale(record: Any) -> bool:
    try:
        since = datetime.fromisoformat(str(record.value.get("since")))
    except (AttributeError, TypeError, ValueError):
        return True  # not a record this code wrote: whoever made it is not sending
    return (datetime.now(UTC) - since).total_seconds() > LEASE_SECONDS


def _claim(client: Any, key: str) -> tuple[str, Any]:
    """(STARTED, the new record's id) when this caller now owns the version; ALREADY or BUSY
    (and None) when another report sent it or is sending it."""
    from prefect.client.schemas.actions import VariableCreate
    from prefect.exceptions import ObjectAlreadyExists

    name = record_name(key)
    for _ in range(5):
        try:
            mine = client.create_variable(
                VariableCreate(name=name, value=_value(key, "sending"), tags=[RECORD_TAG])
            )
            return STARTED, mine.id
        except ObjectAlreadyExists:
            pass
        record = client.read_variable_by_name(name)
        if record is None:
            continue  # its owner's send failed and released it: claim again
        state = record.value.get("state") if isinstance(record.value, dict) else None
        if state == "sent":
            return ALREADY, None
        if not _stale(record):
            return BUSY, None
        # Its owner died mid-send. Deleting by id removes only that record: of two takers,
        # the second finds it gone (404) and then the first one's new claim.
        _delete(client, record.id)
    return BUSY, None


def _delete(client: Any, record_id: Any) -> None:
    import httpx

    try:
        client.request("DELETE", "/variables/{id}", path_params={"id": record_id})
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code != 404:
            raise


def post_event(client: Any, ready: DataReady) -> None:
    client.request("POST", "/events", json=[ready.event()]).raise_for_status()


def emit(
    ready: DataReady,
    post: Callable[[Any, DataReady], None] = post_event,
    client: Any = None,
) -> str:
    """Send ``retrain.data.ready`` once per data version: STARTED when this call sent it,
    ALREADY when it was sent before, BUSY while another reporter is sending it. A failed send
    raises and leaves no record, so the next delivery or poll sends it. ``client``: an open
    sync Prefect client to reuse (opening one costs more than a claim)."""
    if client is None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as own:
            return emit(ready, post, own)
    outcome, record_id = _claim(client, ready.key)
    if outcome != STARTED:
        return outcome
    try:
        post(client, ready)
    except BaseException:
        try:
            _delete(client, record_id)
        except Exception:  # the server is unreachable: the lease frees the claim
            log.warning("could not release the claim on %s", ready.key, exc_info=True)
        raise
    _mark_sent(client, record_id, ready.key)
    return STARTED


def _mark_sent(client: Any, record_id: Any, key: str) -> None:
    """The event is out: failing now would make the caller send it again, so a server that
    does not answer is asked again, and at worst the record stays ``sending``. Then another
    reporter takes it over after the lease and sends the same event id once more, which the
    server's trigger service drops (it remembers processed ids for 30 minutes)."""
    for attempt in range(4):
        try:
            client.request(
                "PATCH",
                "/variables/{id}",
                path_params={"id": record_id},
                json={"value": _value(key, "sent")},
            )
            return
        except Exception:
            if attempt == 3:
                log.warning("sent %s but could not record it", key, exc_info=True)
                return
            time.sleep(2**attempt)


def already_sent(keys: Iterable[str], client: Any = None) -> set[str]:
    """The keys among ``keys`` whose version was sent: a few requests for any number of them
    (the sensor sees every version it ever reported on each poll)."""
    if client is None:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as own:
            return already_sent(keys, own)
    names = {record_name(k): k for k in keys}
    todo = list(names)
    found: set[str] = set()
    for start in range(0, len(todo), 200):  # the API's page size
        page = todo[start : start + 200]
        reply = client.request(
            "POST",
            "/variables/filter",
            json={"variables": {"name": {"any_": page}}, "limit": len(page)},
        )
        for record in reply.json():
            value = record.get("value")
            if isinstance(value, dict) and value.get("state") == "sent":
                found.add(names[record["name"]])
    return found


def migrate_legacy_ledger() -> int:
    """Turn the one-Variable ledger of older releases into records (as sent), then drop it,
    so versions reported before an upgrade are not reported again. Returns how many."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        legacy = client.read_variable_by_name(LEGACY_LEDGER)
        if legacy is None:
            return 0
        keys = [str(k) for k in legacy.value] if isinstance(legacy.value, list) else []
        for key in keys:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_variable(
                    VariableCreate(
                        name=record_name(key), value=_value(key, "sent"), tags=[RECORD_TAG]
                    )
                )
        _delete(client, legacy.id)
    return len(keys)
