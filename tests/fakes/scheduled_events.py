"""Azure's Scheduled Events endpoint (the instance metadata service's), emulated on this machine.

What a VM's ``http://169.254.169.254/metadata/scheduledevents`` answers, as Microsoft documents
it ("Azure Metadata Service: Scheduled Events for Linux VMs"): requests without the header
``Metadata: true`` or with an unknown ``api-version`` are refused with 400; a GET answers
``{"DocumentIncarnation": n, "Events": [...]}``, each event with ``EventId``, ``EventType``,
``ResourceType``, ``Resources``, ``EventStatus`` (``Scheduled``, then ``Started``) and
``NotBefore`` (an HTTP date, empty once started), and from 2020-07-01 ``Description``,
``EventSource`` and ``DurationInSeconds``; the incarnation goes up whenever the events change; a
POST of ``{"StartRequests": [{"EventId": ...}]}`` approves an event, which then starts. A
``Preempt`` event is scheduled at least 30 s ahead on Azure; a test gives the notice it wants.

Served by uvicorn on a free loopback port, in a thread; the emulated Batch nodes reach it as
they reach Azurite (``tests/fakes/hosts.py`` forwards the port into each node). ``delay`` makes
every answer slow and ``failing`` makes it an error, for the cases of an endpoint that is slow
or down.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

PATH = "/metadata/scheduledevents"
VERSIONS = ("2017-11-01", "2019-01-01", "2019-08-01", "2020-07-01")
MINIMUM_NOTICE = {"Freeze": 900, "Reboot": 900, "Redeploy": 600, "Preempt": 30}


class ScheduledEvents:
    """The endpoint and its events; ``url`` is what a node's ``RETRAIN_SCHEDULED_EVENTS_URL``
    is set to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.incarnation = 1
        self.events: dict[str, dict[str, Any]] = {}
        self.delay = 0.0  # seconds every answer waits: a slow endpoint
        self.failing: int | None = None  # an HTTP status every answer has: an endpoint down
        self.requests = 0
        self.approved: list[str] = []
        app = Starlette(routes=[Route(PATH, self._handle, methods=["GET", "POST"])])
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(
            app, lifespan="off", loop="asyncio", log_config=None, access_log=False, ws="none"
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def url(self, version: str = "2020-07-01") -> str:
        return f"http://127.0.0.1:{self.port}{PATH}?api-version={version}"

    def __enter__(self) -> ScheduledEvents:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.start()
        deadline = datetime.now(UTC) + timedelta(seconds=20)
        while not self._server.started:
            if datetime.now(UTC) > deadline:
                raise RuntimeError("the Scheduled Events endpoint did not start")
            threading.Event().wait(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._socket.close()

    # -- what Azure does ---------------------------------------------------------------------
    def schedule(
        self, event_type: str, resources: list[str], notice_seconds: float | None = None
    ) -> str:
        """A new event, ``notice_seconds`` ahead (the type's documented minimum by default)."""
        ahead = MINIMUM_NOTICE.get(event_type, 0) if notice_seconds is None else notice_seconds
        event_id = str(uuid.uuid4()).upper()
        with self._lock:
            self.events[event_id] = {
                "EventId": event_id,
                "EventStatus": "Scheduled",
                "EventType": event_type,
                "ResourceType": "VirtualMachine",
                "Resources": list(resources),
                "NotBefore": format_datetime(
                    datetime.now(UTC) + timedelta(seconds=ahead), usegmt=True
                ),
                "Description": "",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            }
            self.incarnation += 1
        return event_id

    def preempt(self, resources: list[str], notice_seconds: float | None = None) -> str:
        """Spot capacity is taken back from these VMs (``Preempt``, 30 s ahead on Azure)."""
        return self.schedule("Preempt", resources, notice_seconds)

    def start(self, event_id: str) -> None:
        """The event starts (approved, or its NotBefore passed)."""
        with self._lock:
            event = self.events.get(event_id)
            if event is not None and event["EventStatus"] != "Started":
                event.update({"EventStatus": "Started", "NotBefore": ""})
                self.incarnation += 1

    def finish(self, event_id: str) -> None:
        """The event is over: no longer listed (no Completed status exists)."""
        with self._lock:
            if self.events.pop(event_id, None) is not None:
                self.incarnation += 1

    # -- the endpoint -------------------------------------------------------------------------
    def document(self, version: str = "2020-07-01") -> dict[str, Any]:
        newer = version >= "2020-07-01"
        fields = ("Description", "EventSource", "DurationInSeconds")
        with self._lock:
            events = [
                {k: v for k, v in e.items() if newer or k not in fields}
                for e in self.events.values()
            ]
            return {"DocumentIncarnation": self.incarnation, "Events": events}

    async def _handle(self, request: Request) -> Response:
        self.requests += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.failing is not None:
            return JSONResponse({"error": "Internal server error"}, status_code=self.failing)
        if request.headers.get("Metadata", "").lower() != "true":
            return JSONResponse(
                {"error": "Bad request. Required metadata header not specified"}, status_code=400
            )
        version = request.query_params.get("api-version", "")
        if version not in VERSIONS:
            return JSONResponse(
                {"error": "Bad request. api-version is invalid or was not specified"},
                status_code=400,
                headers={"newest-versions": ",".join(reversed(VERSIONS))},
            )
        if request.method == "POST":
            body = await request.json()
            for start in body.get("StartRequests", []):
                self.approved.append(str(start.get("EventId")))
                self.start(str(start.get("EventId")))
            return Response(status_code=200)
        return JSONResponse(self.document(version))
