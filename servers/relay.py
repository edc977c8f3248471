"""Event Grid relay: Blob-created events in, one ``retrain.data.ready`` per data version out.

A small HTTP service to point an Event Grid subscription (webhook) at, because the self-hosted
Prefect server has no webhooks. It answers both handshakes (the Event Grid schema's
SubscriptionValidationEvent, the CloudEvents OPTIONS abuse-protection request), accepts
``Microsoft.Storage.BlobCreated`` in both schemas, keeps the blobs under the watched data roots
(``core.data_versions``: the data roots of the configs in ``RETRAIN_RELAY_CONFIG``, or the
``container/prefix`` items of ``RETRAIN_RELAY_WATCH``), and authenticates every request: a
shared secret (``?key=`` in the subscription's endpoint URL, or an ``X-Relay-Key`` delivery
header) or an Entra ID token issued to the subscription for this relay's app.

Debounce, so 5,000 blobs landing make one retrain:
- marker (default): a version is ready when its marker ``<root>/<version>/_SUCCESS`` is
  written; the event names the root and the version, and the run it starts trains that one.
- quiet period (``RETRAIN_RELAY_MARKER=``, for a root without versions): the root is ready
  when no new blob has arrived under it for ``RETRAIN_RELAY_QUIET_SECONDS``.

``python -m servers.relay --port 8080`` (on loopback; ``--host`` for another address);
settings come from the environment (see
``RelaySettings.from_env``). It reports to the Prefect API named by ``PREFECT_API_URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.data_versions import MARKER, DataRoot
from deployments.events import BUSY, DataReady, emit, normalize_etag, quiet_version

log = logging.getLogger("retrain.relay")
BLOB_CREATED = "Microsoft.Storage.BlobCreated"
VALIDATION = "Microsoft.EventGrid.SubscriptionValidationEvent"
NOT_REPORTED = "not reported (the Prefect API failed); retry"


class RelayConfigError(ValueError):
    """The relay is not configured to authenticate or to watch anything."""


@dataclass
class RelaySettings:
    watches: list[DataRoot]  # the data roots whose versions it reports
    marker: str | None = MARKER  # None: quiet-period mode
    quiet_seconds: float = 300.0
    shared_secret: str | None = None
    entra_audience: str | None = None
    entra_tenant: str | None = None
    jwks_url: str | None = None
    # Quiet-period mode lists the watched prefix when it goes quiet (see events.quiet_version).
    account_url: str | None = None
    connection_string_env: str | None = "AZURE_STORAGE_CONNECTION_STRING"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RelaySettings:
        """RETRAIN_RELAY_CONFIG="configs/azure.yaml,..." (each config's data root) and/or
        RETRAIN_RELAY_WATCH="container/prefix,..." (data roots), RETRAIN_RELAY_MARKER (empty:
        quiet period) RETRAIN_RELAY_QUIET_SECONDS RETRAIN_RELAY_SECRET
        RETRAIN_RELAY_ENTRA_AUDIENCE RETRAIN_RELAY_ENTRA_TENANT RETRAIN_RELAY_JWKS_URL; in
        quiet-period mode, read access to the watched containers: RETRAIN_RELAY_ACCOUNT_URL
        (DefaultAzureCredential) or a connection string in AZURE_STORAGE_CONNECTION_STRING."""
        env = dict(os.environ if env is None else env)
        watches = [
            *_config_roots(env.get("RETRAIN_RELAY_CONFIG", "")),
            *_watch_roots(env.get("RETRAIN_RELAY_WATCH", "")),
        ]
        tenant = env.get("RETRAIN_RELAY_ENTRA_TENANT") or None
        settings = cls(
            watches=list(dict.fromkeys(watches)),
            marker=env.get("RETRAIN_RELAY_MARKER", MARKER) or None,
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
            account_url=env.get("RETRAIN_RELAY_ACCOUNT_URL") or None,
        )
        settings.check(env)
        return settings

    def check(self, env: dict[str, str] | None = None, storage: bool = True) -> None:
        """Refuse settings that cannot work; ``storage``: whether the relay lists containers
        itself (quiet-period mode), rather than through a lister it was given."""
        env = dict(os.environ if env is None else env)
        if not self.watches:
            raise RelayConfigError(
                "RETRAIN_RELAY_CONFIG and RETRAIN_RELAY_WATCH name no data root to watch"
            )
        if self.marker not in (None, MARKER):
            raise RelayConfigError(
                f"RETRAIN_RELAY_MARKER is {self.marker!r}: a data version is complete once its "
                f"{MARKER} marker is written (core/data_versions.py); set it empty for the "
                "quiet-period mode of a root without versions"
            )
        if not self.shared_secret and not self.entra_audience:
            raise RelayConfigError(
                "the relay must authenticate its callers: set RETRAIN_RELAY_SECRET, or "
                "RETRAIN_RELAY_ENTRA_AUDIENCE and RETRAIN_RELAY_ENTRA_TENANT"
            )
        if self.entra_audience and not (self.entra_tenant and self.jwks_url):
            raise RelayConfigError("RETRAIN_RELAY_ENTRA_AUDIENCE needs RETRAIN_RELAY_ENTRA_TENANT")
        readable = self.account_url or env.get(self.connection_string_env or "")
        if storage and not self.marker and not readable:
            raise RelayConfigError(
                "quiet-period mode versions the whole listing of the watched prefix: set "
                f"RETRAIN_RELAY_ACCOUNT_URL or {self.connection_string_env}"
            )

    def container(self, name: str) -> Any:
        from backends.blob import container_client
        from core.config import BlobLocation

        return container_client(
            BlobLocation(
                container=name,
                account_url=self.account_url,
                connection_string_env=self.connection_string_env,
            )
        )


def _config_roots(paths: str) -> list[DataRoot]:
    """The data root of each config file named (the one a run of that config trains from)."""
    from core.config import ConfigError, load_config

    roots = []
    for path in filter(None, (p.strip() for p in paths.split(","))):
        try:
            roots.append(load_config(path).data.root)
        except ConfigError as exc:
            raise RelayConfigError(f"RETRAIN_RELAY_CONFIG: {exc}") from None
    return roots


def _watch_roots(items: str) -> list[DataRoot]:
    roots = []
    for item in filter(None, (w.strip() for w in items.split(","))):
        container, _, prefix = item.partition("/")
        roots.append(DataRoot(container, prefix.strip("/")))
    return roots


@dataclass(frozen=True)
class BlobCreated:
    id: str | None  # None: an event without one, which no other delivery can be told apart from
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
    """Turns accepted blob events into data versions, per the marker or quiet-period rule.

    Nothing is taken as handled before it was: a delivery's id is remembered (to answer Event
    Grid's retries without asking the ledger) only once its outcome is final, and a quiet
    group is dropped only once its version was sent. Requests are served on several threads,
    so the state is guarded by a lock; sends happen outside it."""

    def __init__(
        self,
        settings: RelaySettings,
        send: Callable[[DataReady], str],
        list_version: Callable[[DataRoot], tuple[str, Any] | None] | None = None,
    ) -> None:
        self.settings, self.send = settings, send
        self.list_version = list_version or (
            lambda w: quiet_version(settings.container(w.container), w.prefix)
        )
        self.pending: dict[DataRoot, dict[str, Any]] = {}
        self.seen_ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def watch_for(self, container: str, name: str) -> DataRoot | None:
        for watch in self.settings.watches:
            if watch.container == container and watch.holds(name):
                return watch
        return None

    def accept(self, event: BlobCreated) -> str:
        """The event's outcome; raises when its version could not be sent (nothing recorded:
        Event Grid's retry of the same delivery is handled afresh)."""
        with self._lock:
            if event.id is not None and event.id in self.seen_ids:
                return "duplicate delivery"
        outcome = self._handle(event)
        if event.id is not None and outcome != BUSY:
            with self._lock:
                self.seen_ids[event.id] = None
                while len(self.seen_ids) > 10_000:
                    self.seen_ids.popitem(last=False)
        return outcome

    def _handle(self, event: BlobCreated) -> str:
        watch = self.watch_for(event.container, event.name)
        if watch is None:
            return "not watched"
        if self.settings.marker:
            version = watch.version_of_marker(event.name)
            if version is None:
                if event.name.rpartition("/")[2] == MARKER:
                    return "not a version marker: versions are folders directly below the root"
                return "waiting for the marker"
            return self.send(
                DataReady(
                    event.container, watch.prefix, version, event.schema, event.name, event.etag
                )
            )
        with self._lock:
            group = self.pending.setdefault(watch, {"schema": event.schema})
            group["last"] = time.monotonic()
        return "waiting for quiet"

    def flush(self, now: float | None = None) -> list[DataReady]:
        """Versions whose quiet period has passed; called periodically. A group whose version
        could not be sent stays, and the next flush tries again."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [
                (watch, dict(group))
                for watch, group in self.pending.items()
                if now - group["last"] >= self.settings.quiet_seconds
            ]
        sent = []
        for watch, group in due:
            found = self.list_version(watch)
            ready = None
            if found is not None:
                ready = DataReady(
                    watch.container, watch.prefix, "", group["schema"], revision=found[0]
                )
                if self.send(ready) == BUSY:
                    continue
                sent.append(ready)
            with self._lock:  # done, unless a blob arrived meanwhile: that is newer data
                if self.pending.get(watch, {}).get("last") == group["last"]:
                    del self.pending[watch]
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


def _data(item: dict[str, Any]) -> dict[str, Any]:
    data = item.get("data")
    if not isinstance(data, dict):
        raise ValueError(f"event {_event_id(item)}: data must be an object")
    return data


def _event_id(item: dict[str, Any]) -> str | None:
    value = item.get("id")
    return str(value)[:200] if isinstance(value, (str, int)) and str(value) else None


def _blob_created(item: dict[str, Any], schema: str) -> BlobCreated | None:
    kind = item.get("type") if schema == "cloudevents" else item.get("eventType")
    if kind != BLOB_CREATED:
        return None
    subject = item.get("subject")
    where = parse_subject(subject) if isinstance(subject, str) else None
    if where is None:
        raise ValueError(f"event {_event_id(item)}: subject is not a blob")
    etag = _data(item).get("eTag") or _data(item).get("etag")
    if not isinstance(etag, str) or not normalize_etag(etag):
        raise ValueError(f"event {_event_id(item)}: data.eTag must be a non-empty string")
    return BlobCreated(_event_id(item), where[0], where[1], normalize_etag(etag), schema)


def _hide_key(app: Any) -> Any:
    """Take the shared secret out of the request's query string before anything sees it.

    Access logs (uvicorn's, and any server's that logs the request line from the ASGI scope)
    print the path with its query; Event Grid puts the secret there (``?key=``), so every
    delivery and every wrong guess would write it to the log. The value moves to the scope's
    ``state`` for the authenticator, and the whole query becomes ``query=REDACTED``: a sender
    may spell the secret under another name, case or separator (``?KEY=``, ``?x=1;key=``), and
    the relay reads nothing else from the query."""
    from urllib.parse import parse_qsl

    async def hidden(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("query_string"):
            pairs = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
            given = [v for k, v in pairs if k == "key" and v]
            if given:
                scope.setdefault("state", {})["relay_key"] = given[-1]
            scope["query_string"] = b"query=REDACTED"
        await app(scope, receive, send)

    return hidden


def create_app(
    settings: RelaySettings,
    send: Callable[[DataReady], str] = emit,
    list_version: Callable[[DataRoot], tuple[str, Any] | None] | None = None,
) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    settings.check(storage=list_version is None)
    debouncer = Debouncer(settings, send, list_version)
    authenticate = Authenticator(settings)

    def allowed(request: Request) -> bool:
        headers = {k.lower(): v for k, v in request.headers.items()}
        key = request.scope.get("state", {}).get("relay_key")
        return authenticate({"key": key} if key else {}, headers)

    async def options(request: Request) -> Response:
        # CloudEvents webhook validation: echo the origin to allow its deliveries.
        if not await asyncio.to_thread(allowed, request):
            return Response(status_code=401)
        origin = request.headers.get("webhook-request-origin", "")
        return Response(
            status_code=200, headers={"WebHook-Allowed-Origin": origin, "WebHook-Allowed-Rate": "*"}
        )

    async def post(request: Request) -> Response:
        # In a thread: checking a token may fetch the tenant's signing keys (and import the
        # JWT and crypto libraries) the first time, which held every other request up.
        if not await asyncio.to_thread(allowed, request):
            return JSONResponse({"error": "unauthenticated"}, status_code=401)
        try:
            schema, items = _events(await request.json(), request.headers.get("content-type", ""))
            if schema == "event-grid" and items and items[0].get("eventType") == VALIDATION:
                code = _data(items[0]).get("validationCode")
                if not code or not isinstance(code, str):
                    raise ValueError("validation event without data.validationCode")
                return JSONResponse({"validationResponse": code})
            events = [e for e in (_blob_created(i, schema) for i in items) if e]
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            message = str(exc) if not isinstance(exc, RecursionError) else "nested too deeply"
            return JSONResponse({"error": message}, status_code=400)
        outcomes = await asyncio.to_thread(lambda: [_outcome(debouncer, e) for e in events])
        if any(o in (BUSY, NOT_REPORTED) for o in outcomes):
            # Event Grid retries a failed delivery; the events already handled are answered
            # from the delivery ids (or the ledger) when it does.
            return JSONResponse(
                {"accepted": len(events), "outcomes": outcomes},
                status_code=503,
                headers={"Retry-After": "30"},
            )
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

    app: Any = Starlette(
        routes=[
            Route("/events", post, methods=["POST"]),
            Route("/events", options, methods=["OPTIONS"]),
            Route("/health", lambda _: JSONResponse({"ok": True}), methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.debouncer = debouncer
    hidden = _hide_key(app)
    hidden.state = app.state
    return hidden


def _outcome(debouncer: Debouncer, event: BlobCreated) -> str:
    try:
        return debouncer.accept(event)
    except Exception as exc:
        log.warning("could not report %s/%s: %s", event.container, event.name, exc)
        return NOT_REPORTED


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(
        prog="python -m servers.relay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default: loopback only; Event Grid reaches the relay "
        "through a TLS reverse proxy on this machine, or pass 0.0.0.0 to listen on all)",
    )
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
