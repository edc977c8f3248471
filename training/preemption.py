"""Azure's Scheduled Events, watched off the training thread for a ``Preempt`` notice.

A Spot VM that Azure reclaims gets a ``Preempt`` event from the instance metadata service at
least 30 s before it goes (Microsoft's "Azure Metadata Service: Scheduled Events for Linux VMs"):
``GET http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01`` with the header
``Metadata: true`` answers ``{"DocumentIncarnation": n, "Events": [{"EventId", "EventType",
"ResourceType", "Resources", "EventStatus", "NotBefore", ...}]}``. The trainer's first process on
each node polls it in a daemon thread (``RETRAIN_SCHEDULED_EVENTS_URL``, set by the task spec for
pools with Spot nodes; the emulated nodes point it at a local endpoint) and the checkpoint policy
(``training.checkpoint_policy``) turns a notice into an emergency checkpoint on every rank.

Every ``Preempt`` event counts, whichever VMs its ``Resources`` name: events reach every VM of a
scale set's placement group, a Batch node's name is not its VM's, and a preempted node of the
job requeues the whole multi-node task; an extra checkpoint costs seconds, a missed one up to the
checkpoint interval. An endpoint that is down, slow or answers nonsense stops nothing: the thread
logs it once (and once when it answers again) and training goes on, its checkpoints by time
still holding.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("training")

AZURE_URL = "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01"
URL_VARIABLE = "RETRAIN_SCHEDULED_EVENTS_URL"
POLL_SECONDS = 1.0  # a notice is at least 30 s ahead: a second's delay leaves most of it
# The first request enables the service for the VM and may take up to two minutes to answer
# (the same documentation); a request that takes longer is given up and made again.
TIMEOUT_SECONDS = 150.0
EVENT_FIELDS = ("EventId", "EventType", "ResourceType", "Resources", "EventStatus", "NotBefore")


class EventsDocumentError(ValueError):
    """The endpoint answered something other than a Scheduled Events document."""


@dataclass(frozen=True)
class Notice:
    """A ``Preempt`` event as this node saw it first."""

    event_id: str
    resources: tuple[str, ...]
    status: str  # Scheduled, or Started once approved or past NotBefore
    not_before: str  # as the service wrote it (an HTTP date; empty once Started)
    seen_at: float  # time.time() when the watcher read it

    def describe(self) -> str:
        where = ", ".join(self.resources) or "no resource named"
        when = f", not before {self.not_before}" if self.not_before else ""
        return f"Preempt event {self.event_id} ({where}; {self.status}{when})"


def preempt_notices(document: Any, seen_at: float) -> list[Notice]:
    """The ``Preempt`` events of a Scheduled Events document, which is checked against the
    documented shape (a field missing or of the wrong type is named)."""
    if not isinstance(document, dict):
        raise EventsDocumentError("the answer is not a JSON object")
    if not isinstance(document.get("DocumentIncarnation"), int):
        raise EventsDocumentError("DocumentIncarnation is missing or not an integer")
    events = document.get("Events")
    if not isinstance(events, list):
        raise EventsDocumentError("Events is missing or not a list")
    notices = []
    for index, event in enumerate(events):
        if not isinstance(event, dict):
            raise EventsDocumentError(f"Events[{index}] is not an object")
        missing = [name for name in EVENT_FIELDS if name not in event]
        if missing:
            raise EventsDocumentError(f"Events[{index}] lacks {', '.join(missing)}")
        resources = event["Resources"]
        if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
            raise EventsDocumentError(f"Events[{index}].Resources is not a list of names")
        if event["EventType"] != "Preempt":
            continue
        notices.append(
            Notice(
                str(event["EventId"]),
                tuple(resources),
                str(event["EventStatus"]),
                str(event["NotBefore"] or ""),
                seen_at,
            )
        )
    return notices


def read_events(url: str, timeout: float) -> Any:
    """One request to the endpoint, with the header it requires; the decoded document."""
    request = urllib.request.Request(url, headers={"Metadata": "true"})
    # A link-local address: a proxy configured for the machine must not be asked for it.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout) as response:
        return json.loads(response.read())


class PreemptionWatcher:
    """Polls the Scheduled Events endpoint in a daemon thread; :meth:`take` hands each new
    ``Preempt`` notice over once."""

    def __init__(
        self, url: str, poll_seconds: float = POLL_SECONDS, timeout: float = TIMEOUT_SECONDS
    ) -> None:
        self.url, self.poll_seconds, self.timeout = url, poll_seconds, timeout
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._pending: list[Notice] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failing: str | None = None  # why the last request failed, while it does
        self.polls = 0  # answers read (for tests and the log)

    @classmethod
    def from_environment(cls) -> PreemptionWatcher | None:
        url = os.environ.get(URL_VARIABLE, "").strip()
        return cls(url) if url else None

    def start(self) -> PreemptionWatcher:
        self._thread = threading.Thread(target=self._run, name="scheduled-events", daemon=True)
        self._thread.start()
        log.info("watching %s for Preempt notices", self.url)
        return self

    def stop(self) -> None:
        self._stop.set()

    def take(self) -> Notice | None:
        """The oldest notice not handed over yet, or None."""
        with self._lock:
            return self._pending.pop(0) if self._pending else None

    def poll_once(self) -> None:
        """One request; new ``Preempt`` events become pending notices. Never raises."""
        try:
            notices = preempt_notices(read_events(self.url, self.timeout), time.time())
        except (OSError, ValueError, http.client.HTTPException) as exc:
            why = f"{type(exc).__name__}: {exc}"
            if self.failing is None:
                log.warning(
                    "scheduled events at %s: %s; training goes on, checkpoints by time still hold",
                    self.url,
                    why,
                )
            self.failing = why
            return
        if self.failing is not None:
            log.info("scheduled events at %s answer again", self.url)
            self.failing = None
        self.polls += 1
        with self._lock:
            for notice in notices:
                if notice.event_id not in self._seen:
                    self._seen.add(notice.event_id)
                    self._pending.append(notice)
                    log.warning("node notified: %s", notice.describe())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.poll_seconds)
