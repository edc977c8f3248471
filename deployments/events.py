"""The one event that starts a retrain on new data, and the ledger that makes it idempotent.

Both the Event Grid relay and the polling sensor report a data version as ready with
``retrain.data.ready``; the ``retrain/on-new-data`` deployment's trigger turns it into a flow
run. Each data version has a key (container, prefix, version), recorded in a Prefect Variable
before the event is sent, so a replayed Event Grid delivery, a relay restart or the sensor
seeing what the relay already reported starts nothing new.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

EVENT = "retrain.data.ready"
LEDGER = "retrain-data-versions-seen"
LEDGER_SIZE = 500  # keys kept; older versions are not replayed months later
_NAMESPACE = uuid.UUID("6f1b7c52-9a53-4c0e-9b7e-1d0f3c2a8e11")
_lock = threading.Lock()


@dataclass(frozen=True)
class DataReady:
    container: str
    prefix: str
    data_version: str
    source: str  # "event-grid", "cloudevents" or "sensor"
    blob: str = ""  # the blob that completed the version, when there is one

    @property
    def key(self) -> str:
        return f"{self.container}/{self.prefix}@{self.data_version}"

    def event(self) -> dict[str, Any]:
        return {
            "id": str(uuid.uuid5(_NAMESPACE, self.key)),
            "occurred": datetime.now(UTC).isoformat(),
            "event": EVENT,
            "resource": {
                "prefect.resource.id": f"retrain.data.{self.container}",
                "prefect.resource.name": f"{self.container}/{self.prefix}",
            },
            "payload": asdict(self),
        }


def _seen() -> list[str]:
    from prefect.variables import Variable

    value = Variable.get(LEDGER, default=None)
    return [str(k) for k in value] if isinstance(value, list) else []


def claim(key: str) -> bool:
    """True the first time a key is seen (and records it); False for every repeat."""
    from prefect.variables import Variable

    with _lock:
        seen = _seen()
        if key in seen:
            return False
        Variable.set(LEDGER, [*seen, key][-LEDGER_SIZE:], overwrite=True)
        return True


def _unclaim(key: str) -> None:
    from prefect.variables import Variable

    with _lock:
        Variable.set(LEDGER, [k for k in _seen() if k != key], overwrite=True)


def emit(ready: DataReady) -> bool:
    """Send ``retrain.data.ready`` once per data version; False when it was sent before."""
    from prefect.client.orchestration import get_client

    if not claim(ready.key):
        return False
    try:
        with get_client(sync_client=True) as client:
            client.request("POST", "/events", json=[ready.event()]).raise_for_status()
    except Exception:
        _unclaim(ready.key)  # not sent: the next delivery or poll must be able to send it
        raise
    return True
