"""Event Grid relay: Blob-created events in, one ``retrain.data.ready`` per data version out.

A small HTTP service to point an Event Grid subscription (webhook) at, because the self-hosted
Prefect server has no webhooks. It answers both handshakes (the Event Grid schema's
SubscriptionValidationEvent, the CloudEvents OPTIONS abuse-protection request), accepts
``Microsoft.Storage.BlobCreated`` in both schemas, keeps the blobs under the watched container
and prefix, and authenticates every request: a shared secret (``?key=`` in the subscription's
endpoint URL, or an ``X-Relay-Key`` delivery header) or an Entra ID token issued to the
subscription for this relay's app.

Debounce, so 5,000 blobs landing make one retrain:
- marker (default): a version is ready when its completion marker (``_SUCCESS``) is written;
  the version is the folder holding the marker, so data goes in ``<prefix>/<version>/...``.
- quiet period (``RETRAIN_RELAY_MARKER=``): a version is ready when no new blob has arrived
  under the watched prefix for ``RETRAIN_RELAY_QUIET_SECONDS``.

``python -m deployments.relay --port 8080``; settings come from the environment (see
``RelaySettings.from_env``). It reports to the Prefect API named by ``PREFECT_API_URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deployments.events import DataReady, emit

log = logging.getLogger("retrain.relay")
BLOB_CREATED = "Microsoft.Storage.BlobCreated"
VALIDATION = "Microsoft.EventGrid.SubscriptionValidationEvent"


class RelayConfigError(ValueError):
    """The relay is not configured to authenticate or to watch anything."""


@dataclass(frozen=True)
class Watch:
    container: str
    prefix: str  # "" for the whole container


@dataclass
class RelaySettings:
    watches: list[Watch]
    marker: str | None = "_SUCCESS"
    quiet_seconds: float = 300.0
    shared_secret: str | None = None
    entra_audience: str | None = None
    entra_tenant: str | None = None
    jwks_url: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RelaySettings:
        """RETRAIN_RELAY_WATCH="container/prefix,..." RETRAIN_RELAY_MARKER (empty: quiet period)
        RETRAIN_RELAY_QUIET_SECONDS RETRAIN_RELAY_SECRET RETRAIN_RELAY_ENTRA_AUDIENCE
        RETRAIN_RELAY_ENTRA_TENANT RETRAIN_RELAY_JWKS_URL."""
        env = dict(os.environ if env is None else env)
        watches = []
        for item in filter(
            None, (w.strip() for w in env.get("RETRAIN_RELAY_WATCH", "").split(","))
        ):
            container, _, prefix = item.partition("/")
            watches.append(Watch(container, prefix.strip("/")))
        tenant = env.get("RETRAIN_RELAY_ENTRA_TENANT") or None
        settings = cls(
            watches=watches,
            marker=env.get("RETRAIN_RELAY_MARKER", "_SUCCESS") or None,
            quiet_seconds=float(env.get("RETRAIN_RELAY_QUIET_SECONDS", "300")),
            shared_secret=env.get("RETRAIN_RELAY_SECRET") or None,
            entra_audience=env.get("RETRAIN_RELAY_ENTRA_AUDIENCE") or None,
            entra_tenant=tenant,
            jwks_url=env.get("RETRAIN_RELAY_JWKS_URL")
            or (
                f"https://login.microsoftonline.com/{tenant}/discovery/v2.0/keys"
                if tenant
                else None
            ),
        )
        settings.check()
        return settings

    def check(self) -> None:
        if not self.watches:
            raise RelayConfigError("RETRAIN_RELAY_WATCH names no container/prefix to watch")
        if not self.shared_secret and not self.entra_audience:
            raise RelayConfigError(
                "the relay must authenticate its callers: set RETRAIN_RELAY_SECRET, or "
                "RETRAIN_RELAY_ENTRA_AUDIENCE and RETRAIN_RELAY_ENTRA_TENANT"
            )
        if self.entra_audience and not (self.entra_tenant and self.jwks_url):
            raise RelayConfigError("RETRAIN_RELAY_ENTRA_AUDIENCE needs RETRAIN_RELAY_ENTRA_TENANT")


@dataclass(frozen=True)
class BlobCreated:
    id: str
    container: str
    name: str
    etag: str
    schema: str


def parse_subject(subject: str) -> tuple[str, str] | None:
    """'/blobServices/default/containers/<c>/blobs/<name>' -> (c, name)."""
    parts = subject.split("/", 6)
    shape = ["", "blobServices", "default", "containers", None, "blobs"]
    if len(parts) == 7 and all(w in (None, g) for w, g in zip(shape, parts[:6], strict=True)):
        return (parts[4], parts[6]) if parts[4] and parts[6] else None
    return None


class Debouncer:
    """Turns accepted blob events into data versions, per the marker or quiet-period rule."""

    def __init__(self, settings: RelaySettings, send: Callable[[DataReady], bool]) -> None:
        self.settings, self.send = settings, send
        self.pending: dict[Watch, dict[str, Any]] = {}
        self.seen_ids: OrderedDict[str, None] = OrderedDict()

    def watch_for(self, container: str, name: str) -> Watch | None:
        for watch in self.settings.watches:
            if watch.container == container and (
                not watch.prefix or name.startswith(f"{watch.prefix}/")
            ):
                return watch
        return None

    def accept(self, event: BlobCreated) -> str:
        if event.id in self.seen_ids:
            return "duplicate delivery"
        self.seen_ids[event.id] = None
        while len(self.seen_ids) > 10_000:
            self.seen_ids.popitem(last=False)
        watch = self.watch_for(event.container, event.name)
        if watch is None:
            return "not watched"
        marker = self.settings.marker
        if marker:
            folder, _, base = event.name.rpartition("/")
            if base != marker:
                return "waiting for the marker"
            ready = DataReady(event.container, folder, event.etag, event.schema, event.name)
            return "started" if self.send(ready) else "version already started"
        group = self.pending.setdefault(watch, {"blobs": {}, "last": 0.0, "schema": event.schema})
        group["blobs"][event.name] = event.etag
        group["last"] = time.monotonic()
        return "waiting for quiet"

    def flush(self, now: float | None = None) -> list[DataReady]:
        """Versions whose quiet period has passed; called periodically."""
        now = time.monotonic() if now is None else now
        sent = []
        for watch, group in list(self.pending.items()):
            if now - group["last"] < self.settings.quiet_seconds:
                continue
            del self.pending[watch]
            digest = hashlib.sha256(json.dumps(sorted(group["blobs"].items())).encode())
            ready = DataReady(
                watch.container, watch.prefix, digest.hexdigest()[:16], group["schema"]
            )
            if self.send(ready):
                sent.append(ready)
        return sent


class Authenticator:
    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        self._jwks: Any = None

    def __call__(self, query: dict[str, str], headers: dict[str, str]) -> bool:
        secret = self.settings.shared_secret
        given = query.get("key") or headers.get("x-relay-key")
        if secret and given and hmac.compare_digest(given.encode(), secret.encode()):
            return True
        auth = headers.get("authorization", "")
        if self.settings.entra_audience and auth.lower().startswith("bearer "):
            return self._valid_token(auth[7:].strip())
        return False

    def _valid_token(self, token: str) -> bool:
        import jwt

        tenant = self.settings.entra_tenant
        try:
            if self._jwks is None:
                self._jwks = jwt.PyJWKClient(str(self.settings.jwks_url))
            key = self._jwks.get_signing_key_from_jwt(token).key
            jwt.decode(
                token,
                key,
                algorithms=["RS256"],
                audience=self.settings.entra_audience,
                issuer=[
                    f"https://login.microsoftonline.com/{tenant}/v2.0",
                    f"https://sts.windows.net/{tenant}/",
                ],
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.PyJWTError as exc:
            log.warning("refused a bearer token: %s", exc)
            return False
        return True


def _events(body: Any, content_type: str) -> tuple[str, list[dict[str, Any]]]:
    items = body if isinstance(body, list) else [body]
    if not all(isinstance(i, dict) for i in items):
        raise ValueError("the body is not an event or a list of events")
    cloud = "cloudevents" in content_type or any("specversion" in i for i in items)
    return ("cloudevents" if cloud else "event-grid"), items


def _blob_created(item: dict[str, Any], schema: str) -> BlobCreated | None:
    kind = item.get("type") if schema == "cloudevents" else item.get("eventType")
    if kind != BLOB_CREATED:
        return None
    where = parse_subject(str(item.get("subject", "")))
    if where is None:
        raise ValueError(f"event {item.get('id')}: subject {item.get('subject')!r} is not a blob")
    data = item.get("data") or {}
    etag = str(data.get("eTag") or data.get("etag") or "").strip('"')
    return BlobCreated(str(item.get("id")), where[0], where[1], etag, schema)


def create_app(settings: RelaySettings, send: Callable[[DataReady], bool] = emit) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    settings.check()
    debouncer = Debouncer(settings, send)
    authenticate = Authenticator(settings)

    def allowed(request: Request) -> bool:
        headers = {k.lower(): v for k, v in request.headers.items()}
        return authenticate(dict(request.query_params), headers)

    async def options(request: Request) -> Response:
        # CloudEvents webhook validation: echo the origin to allow its deliveries.
        if not allowed(request):
            return Response(status_code=401)
        origin = request.headers.get("webhook-request-origin", "")
        return Response(
            status_code=200, headers={"WebHook-Allowed-Origin": origin, "WebHook-Allowed-Rate": "*"}
        )

    async def post(request: Request) -> Response:
        if not allowed(request):
            return JSONResponse({"error": "unauthenticated"}, status_code=401)
        try:
            schema, items = _events(await request.json(), request.headers.get("content-type", ""))
            if schema == "event-grid" and items and items[0].get("eventType") == VALIDATION:
                code = (items[0].get("data") or {}).get("validationCode")
                if not code:
                    raise ValueError("validation event without data.validationCode")
                return JSONResponse({"validationResponse": code})
            events = [e for e in (_blob_created(i, schema) for i in items) if e]
        except (ValueError, json.JSONDecodeError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        outcomes = await asyncio.to_thread(lambda: [debouncer.accept(e) for e in events])
        return JSONResponse({"accepted": len(events), "outcomes": outcomes})

    async def quiet_loop() -> None:
        while True:
            await asyncio.sleep(min(1.0, max(0.05, settings.quiet_seconds / 10)))
            try:
                await asyncio.to_thread(debouncer.flush)
            except Exception:  # the relay keeps serving; the next flush tries again
                log.exception("could not report a data version")

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        task = asyncio.create_task(quiet_loop()) if not settings.marker else None
        yield
        if task:
            task.cancel()

    app = Starlette(
        routes=[
            Route("/events", post, methods=["POST"]),
            Route("/events", options, methods=["OPTIONS"]),
            Route("/health", lambda _: JSONResponse({"ok": True}), methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.debouncer = debouncer
    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(
        prog="python -m deployments.relay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    args = p.parse_args(argv)
    try:
        settings = RelaySettings.from_env()
    except RelayConfigError as exc:
        print(f"error: {exc}")
        return 2
    uvicorn.run(create_app(settings), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
