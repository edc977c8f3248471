"""One reporter of data versions, run as its own process by tests/reliability/test_ledger.py.

``python -m tests.ledger_claimer OUT.json GO_FILE CONTAINER VERSIONS FAIL_MOD FAIL_REM``
reports versions ``v0000``.. of ``CONTAINER/datasets/cifar10/daily`` through
``deployments.events.emit`` against the Prefect API named by PREFECT_API_URL, as the relay or
the sensor would, and the way they retry: a version that raised, or that another reporter was
sending, is tried again on the next pass (Event Grid's redelivery, the sensor's next poll).

Events never reach the server's trigger (the test would otherwise start a thousand flow
runs): this process's HTTP transport answers ``POST /events`` itself, failing the first send
of every version whose number is FAIL_REM modulo FAIL_MOD with HTTP 500, and recording every
event it accepts. Everything else (the ledger's Variables) goes to the real server.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any

PREFIX = "datasets/cifar10/daily"  # keys of a realistic length: about 90 fitted in one Variable
REVISION = "0x8DCF00DBA5E1234"  # every version's marker ETag, as Azure spells one


def main(argv: list[str]) -> int:
    out, go, container = Path(argv[0]), Path(argv[1]), argv[2]
    count, fail_mod, fail_rem = int(argv[3]), int(argv[4]), int(argv[5])
    import httpx

    delivered: list[str] = []  # data versions of the events the "server" accepted
    failed_once: set[str] = set()
    real = httpx.HTTPTransport.handle_request

    def handle(self: httpx.HTTPTransport, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path.endswith("/events"):
            versions = [e["payload"]["data_version"] for e in json.loads(request.content)]
            for v in versions:
                if int(v[1:]) % fail_mod == fail_rem and v not in failed_once:
                    failed_once.add(v)
                    return httpx.Response(500, request=request, json={"detail": "injected"})
            delivered.extend(versions)
            return httpx.Response(204, request=request)
        return real(self, request)

    httpx.HTTPTransport.handle_request = handle  # type: ignore[method-assign]

    from prefect.client.orchestration import get_client

    from deployments.events import DataReady, emit

    reuse = "client" in inspect.signature(emit).parameters
    outcomes: dict[str, list[str]] = {}
    errors: list[str] = []
    raised: dict[str, int] = {}
    pending = [f"v{i:04d}" for i in range(count)]
    while not go.exists():
        time.sleep(0.01)
    started = time.monotonic()
    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 300  # another reporter's server retries can take a while
        while True:
            retry = []
            for version in pending:
                ready = DataReady(container, PREFIX, version, "test", revision=REVISION)
                try:
                    kwargs: dict[str, Any] = {"client": client} if reuse else {}
                    outcome = str(emit(ready, **kwargs))
                except Exception as exc:
                    outcome = "error"
                    raised[version] = raised.get(version, 0) + 1
                    if raised[version] > (version in failed_once):  # more than the injected one
                        errors.append(f"{version}: {type(exc).__name__}: {exc}"[:300])
                    retry.append(version)
                else:
                    if "another reporter" in outcome:
                        retry.append(version)
                outcomes.setdefault(version, []).append(outcome)
            pending = retry
            if not retry or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    out.write_text(
        json.dumps(
            {
                "delivered": delivered,
                "failed_once": sorted(failed_once),
                "outcomes": outcomes,
                "errors": errors,
                "left": pending,
                "seconds": time.monotonic() - started,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
