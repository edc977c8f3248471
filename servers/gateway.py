"""The outputs gateway: links to a run's outputs that open in a browser, with no secret in them.

Output blobs are private, so a plain blob URL answers a browser 403, and a SAS in a link would
put a credential into the Prefect database, where anyone who can read a run can copy it. The
gateway is a small read-only HTTP server that the person (or the worker's machine) runs with
the same credentials as ``python -m cli.models``; the links in a run's artifacts point at it
when ``output.links_url`` names it. Access is decided where it runs: it listens on loopback
unless told otherwise, and answers only requests addressed to the host names it was given, so
a web page cannot reach it through DNS rebinding.

It serves the output container below ``output.prefix`` only: files (the model, metrics, logs,
the gate's Data Docs, whose relative links keep working because a folder is served as a
folder) and folder listings. GET and HEAD only; every answer is sandboxed (a stored page or
SVG cannot read the other outputs through the gateway). Given a credential (``user:password``,
``RETRAIN_GATEWAY_AUTH_STRING``: ``make service`` sets one), it answers only requests that carry
it (HTTP basic auth: a browser asks for it once), 401 otherwise; loopback alone does not keep
the other users of the machine out.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import html
import logging
import mimetypes
import os
import socket
import threading
import unicodedata
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlsplit

import uvicorn
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import HTMLResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from backends.blob import join
from core.links import DEFAULT_PORT

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient, ContentSettings


# The most of a request's line and headers buffered before they are complete.
MAX_REQUEST_HEAD = 65536
AUTH_ENV = "RETRAIN_GATEWAY_AUTH_STRING"  # user:password the gateway asks for, when set
REALM = "retrain outputs"
LOG = logging.getLogger(__name__)
_HTML = "text/html; charset=utf-8"
# On every answer. Whatever a stored file is (a page, an SVG, a type set by whoever wrote the
# blob), it runs in an origin of its own: it cannot read other outputs through the gateway.
SAFETY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "sandbox allow-scripts allow-popups",
}


class BadPath(ValueError):
    """A request path that does not name a place below the served prefix."""


def target_path(request_target: str) -> str:
    """The path of an origin-form request target, still encoded. Not ``urlsplit``: it reads a
    leading ``//b/x`` as a host name and would quietly serve ``/x``."""
    return request_target.split("#", 1)[0].split("?", 1)[0]


def blob_name(prefix: str, request_path: str) -> str:
    """The blob (or folder, ending with ``/``) a request path names, below ``prefix``.

    Decoded once; empty segments, segments ending with ``.`` (``.``, ``..``, and ``...`` or
    ``x.``: Blob storage drops a segment's trailing dots, so on Azure such a path names another
    blob than it spells), backslashes (which Azure reads as ``/``) and control characters are
    refused rather than normalised, so no spelling of a path reaches outside ``prefix``."""
    path = unquote(target_path(request_path))
    if not path.startswith("/"):
        raise BadPath("the path must start with /")
    relative = path[1:]
    if any(unicodedata.category(c) == "Cc" or c == "\\" for c in relative):
        raise BadPath("control characters and backslashes are not allowed")
    segments = relative.split("/")
    inner = segments[:-1] if segments[-1] == "" else segments
    if relative and any(s == "" or s.endswith(".") for s in inner):
        raise BadPath("empty segments and segments ending with '.' are not allowed")
    return join(prefix, relative) if relative else (f"{prefix.strip('/')}/" if prefix else "")


def printable(text: str) -> str:
    """``text`` with its control characters escaped, for a log line: a request line is the
    client's, and a terminal would act on escape sequences in it."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


# What a run's outputs hold, by extension. Python's own table comes second, in its built-in
# form only: ``mimetypes.guess_type`` also reads the machine's /etc/mime.types, where ``.pt`` is
# a Super NES page table (the model was served as application/vnd.snesdev-page-table) and
# ``.woff2`` may be missing, so the same blob went out as another type on another machine.
_TEXT = "text/plain; charset=utf-8"
OUTPUT_TYPES = {
    ".pt": "application/octet-stream",  # a PyTorch checkpoint: downloaded, not shown
    ".onnx": "application/octet-stream",  # the same model as ONNX (training/onnx_export.py)
    ".json": "application/json",
    ".txt": _TEXT,
    ".log": _TEXT,
    ".yaml": _TEXT,
    ".yml": _TEXT,
    ".md": _TEXT,
    ".csv": "text/csv; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
    ".svg": "image/svg+xml",
    ".ico": "image/vnd.microsoft.icon",
    ".woff2": "font/woff2",
    ".woff": "font/woff",
    ".ttf": "font/ttf",
    ".otf": "font/otf",
}
_BUILT_IN_TYPES = mimetypes.MimeTypes()  # the module's defaults, no system file


def content_type(name: str, stored: str | None) -> str:
    """The stored type, unless it is the generic one uploads get by default; then the
    extension's (Data Docs' pages must open as pages, their fonts load as fonts)."""
    if stored and stored != "application/octet-stream":
        return stored
    suffix = PurePosixPath(name).suffix.lower()
    guessed, _ = _BUILT_IN_TYPES.guess_type(name)
    return OUTPUT_TYPES.get(suffix) or guessed or "application/octet-stream"


def listing_html(container: ContainerClient, folder: str) -> str | None:
    """A folder's entries as a page of relative links; None when the folder is empty."""
    rows = []
    for item in container.walk_blobs(name_starts_with=folder, delimiter="/"):
        entry = item.name[len(folder) :]
        rows.append(f'<li><a href="{html.escape(quote(entry))}">{html.escape(entry)}</a></li>')
    if not rows and folder:
        return None
    title = html.escape(f"/{folder}")
    return (
        f"<!doctype html><title>{title}</title><h1>{title}</h1>"
        f'<ul><li><a href="../">../</a></li>{"".join(rows)}</ul>'
    )


class BlobStream(StreamingResponse):
    """A blob's bytes as stored, its length announced. A storage failure once the status and
    length are out (a blob deleted or overwritten while it streams) cannot become an error
    answer, which would land inside the file: the response ends short of its length, and the
    connection closes, which is what tells the client the download failed."""

    def __init__(self, name: str, chunks: Iterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(chunks, 200, headers)
        self.name = name

    async def stream_response(self, send: Send) -> None:
        from azure.core.exceptions import AzureError

        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except AzureError as exc:
            # The exception's text can hold the storage request; only its kind is logged.
            LOG.warning(
                "storage error while sending %s: %s", printable(self.name), type(exc).__name__
            )
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _text(status: int, text: str) -> Response:
    return PlainTextResponse(text, status)


class OutputsApp:
    """The gateway's answers: ``container`` below ``prefix``, GET and HEAD only. Storage is
    read in a worker thread (the storage SDK blocks)."""

    def __init__(self, container: ContainerClient, prefix: str) -> None:
        self.container, self.prefix = container, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        target = _request_target(scope)
        response = await run_in_threadpool(self.answer, target, scope["method"] == "HEAD")
        await response(scope, receive, send)

    def answer(self, target: str, head: bool) -> Response:
        from azure.core.exceptions import AzureError, ResourceNotFoundError

        try:
            name = blob_name(self.prefix, target)
            if name.endswith("/") or not name:
                return self._folder(name, head)
            return self._file(name, target, head)
        except BadPath as exc:
            return _text(400, f"bad path: {exc}\n")
        except ResourceNotFoundError:
            return _text(404, "no such output\n")
        except AzureError as exc:
            # The exception's text can hold the storage request; only its kind goes out.
            kind = type(exc).__name__
            LOG.warning("storage error for %s: %s", printable(target), kind)
            return _text(502, f"Blob storage failed ({kind})\n")

    def _folder(self, name: str, head: bool) -> Response:
        if head:  # whether it exists: one entry of its listing, not all of them
            entries = self.container.walk_blobs(
                name_starts_with=name, delimiter="/", results_per_page=1
            )
            if next(iter(entries), None) is None and name:
                return _text(404, "no such output\n")
            found = Response(status_code=200, media_type=_HTML)
            del found.headers["content-length"]  # the page's length is not known without it
            return found
        page = listing_html(self.container, name)
        if page is None:
            return _text(404, "no such output\n")
        return HTMLResponse(page)

    def _file(self, name: str, target: str, head: bool) -> Response:
        from azure.core.exceptions import ResourceNotFoundError

        blob = self.container.get_blob_client(name)
        if not blob.exists():
            if next(iter(self.container.list_blobs(name_starts_with=f"{name}/")), None):
                # A folder asked for without its slash: its page's relative links need it.
                return Response(status_code=301, headers={"Location": f"{target_path(target)}/"})
            raise ResourceNotFoundError("no such blob")
        if head:
            props = blob.get_blob_properties()
            return Response(
                status_code=200, headers=_file_headers(name, props.content_settings, props.size)
            )
        # Stored bytes as they are: a blob written gzip-compressed (Content-Encoding) goes out
        # compressed with its encoding named, as Blob storage itself would send it; the SDK's
        # decompressing would make the body longer than the length announced.
        stream = blob.download_blob(decompress=False)
        headers = _file_headers(name, stream.properties.content_settings, stream.size)
        return BlobStream(name, stream.chunks(), headers)


def _file_headers(name: str, settings: ContentSettings, size: int) -> dict[str, str]:
    headers = {
        "Content-Type": content_type(name, settings.content_type),
        "Content-Length": str(size),
    }
    if settings.content_encoding:
        headers["Content-Encoding"] = settings.content_encoding
    return headers


def _request_target(scope: Scope) -> str:
    """The request's path and query as the client sent them (still encoded). A leading ``//``
    is one ``/``: never read as a host name."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    target = path.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
    return "/" + target.lstrip("/") if target.startswith("//") else target


class RequestLog:
    """Logs each request line, its control characters escaped (a terminal would act on an
    escape sequence in it), with its status, as the answer starts."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        target, method = _request_target(scope), scope["method"]
        client = (scope.get("client") or ("-", 0))[0]

        async def logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                LOG.info("%s %s %s %s", client, method, printable(target), message["status"])
            await send(message)

        await self.app(scope, receive, logged)


class ReadOnly:
    """GET and HEAD only, whoever asks: 501 for any other method."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD"):
            response = _text(501, "this gateway only reads: GET and HEAD\n")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class HostCheck:
    """Answers only requests addressed to the gateway's own host names (``host:port``, lower
    case), so a web page cannot reach it through DNS rebinding: 421 otherwise. Starlette's
    TrustedHostMiddleware compares the name alone, without the port (another port of an
    allowed name would pass) and misreads a bracketed IPv6 host, hence this one."""

    def __init__(self, app: ASGIApp, hosts: set[str]) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and Headers(scope=scope).get("host", "").lower() not in self.hosts
        ):
            response = _text(421, "this gateway does not answer for that host name\n")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# Files below a Data Docs folder's static/ (the gate writes there copies of public packages'
# styles, scripts and fonts, and Great Expectations' images: nothing of a run) are served
# without the credential. Every page is sandboxed (an opaque origin), and a browser sends the
# basic-auth credentials it keeps for the gateway with navigations only, not with an opaque
# origin's subresource requests: with them refused, a run's Data Docs lost their styles and
# the scripts that draw their tables.
PUBLIC_ASSETS = "/data_docs/static/"


def public_asset(request_target: str) -> bool:
    """Whether the request names a file of a Data Docs folder's static assets (never a
    folder: no listing). Only the path's spelling is read here: the application still refuses
    any path that leaves the served prefix (``..``, empty segments) whatever this says."""
    path = unquote(target_path(request_target))
    return PUBLIC_ASSETS in f"/{path.lstrip('/')}" and not path.endswith("/")


class BasicAuth:
    """Only requests carrying ``user:password`` (HTTP basic auth) reach the gateway: 401, with
    the challenge a browser answers by asking the person once, otherwise; Data Docs' static
    assets excepted (``public_asset``). Compared in constant time; the header never reaches
    the log (the request line alone is logged)."""

    def __init__(self, app: ASGIApp, credential: str) -> None:
        self.app, self.credential = app, credential.encode()

    def _allowed(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            given = base64.b64decode(token.strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        return hmac.compare_digest(given, self.credential)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and not public_asset(_request_target(scope))
            and not self._allowed(Headers(scope=scope).get("authorization", ""))
        ):
            response = PlainTextResponse(
                "this gateway asks for its user and password (make service says where they are)\n",
                401,
                headers={"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(
    container: ContainerClient, prefix: str, hosts: set[str], credential: str | None = None
) -> ASGIApp:
    """The gateway as an ASGI application: ``container`` below ``prefix``, to requests whose
    Host header is one of ``hosts`` (lower-case ``host:port``) and, when ``credential`` is
    given, that carry it."""
    app: ASGIApp = OutputsApp(container, prefix)
    if credential:
        app = BasicAuth(app, credential)
    return RequestLog(ReadOnly(HostCheck(app, hosts)))


class RequestDeadline:
    """A deadline for each request to arrive, which uvicorn lacks: a client that opens a
    connection and sends nothing, or half a request line, would hold it for good (uvicorn's
    keep-alive timeout only runs between requests it has parsed, and from the first only).
    Each connection is closed unless a request has begun on it within ``seconds`` of its
    opening or of its last answer's end.

    Built on public interfaces only: the protocol's asyncio callbacks (``connection_made``,
    ``connection_lost``) register each connection's transport by its peer address, and this
    application, the outermost, sees each request begin and its answer end by the ASGI
    scope's ``client``, the same address. uvicorn takes the protocol class through its
    ``http`` setting."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app, self.seconds = app, seconds
        self.connections: dict[tuple[str, int], list[Any]] = {}  # peer: [transport, requests]

    def protocol(self) -> type[asyncio.Protocol]:
        """uvicorn's HTTP/1.1 protocol, telling this deadline of each connection."""
        deadline = self

        class DeadlineProtocol(H11Protocol):
            deadline_peer: tuple[str, int] | None = None

            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(transport)
                self.deadline_peer = deadline.opened(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                deadline.closed(self.deadline_peer)
                super().connection_lost(exc)

        return DeadlineProtocol

    def opened(self, transport: asyncio.BaseTransport) -> tuple[str, int] | None:
        """A new connection: its deadline armed; its peer address."""
        peer = _peer(transport.get_extra_info("peername"))
        if peer is not None:
            self.connections[peer] = [transport, 0]
            self._arm(peer)
        return peer

    def closed(self, peer: tuple[str, int] | None) -> None:
        if peer is not None:
            self.connections.pop(peer, None)

    def _arm(self, peer: tuple[str, int]) -> None:
        entry = self.connections.get(peer)
        if entry is None:
            return
        transport, requests = entry

        def drop() -> None:
            now = self.connections.get(peer)
            if now is not None and now[0] is transport and now[1] == requests:
                transport.close()  # closing twice is a no-op

        asyncio.get_running_loop().call_later(self.seconds, drop)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        peer = _peer(scope.get("client")) if scope["type"] == "http" else None
        entry = self.connections.get(peer) if peer else None
        if entry is None or peer is None:
            await self.app(scope, receive, send)
            return
        entry[1] += 1
        begun = peer

        async def watched(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self._arm(begun)

        await self.app(scope, receive, watched)


def _peer(address: Any) -> tuple[str, int] | None:
    """A peer address as (host, port): an IPv6 peername has two more fields."""
    if isinstance(address, (tuple, list)) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None


def _host_headers(hostname: str, port: int, default: int) -> set[str]:
    """The Host headers that name ``hostname:port``: browsers leave a scheme's default port out,
    and write an IPv6 address in brackets."""
    name = f"[{hostname}]" if ":" in hostname else hostname
    return {f"{name}:{port}", *([name] if port == default else [])}


def host_names(host: str, port: int, links_url: str | None) -> set[str]:
    """The Host headers the gateway answers: its own address, loopback's names when it listens
    there, and the host of ``links_url`` (a reverse proxy in front of it)."""
    loopback = {"127.0.0.1", "localhost", "::1"}
    names: set[str] = set()
    for name in loopback if host in loopback else {host}:
        names |= _host_headers(name, port, 80)
    if links_url:
        parts = urlsplit(links_url)
        default = 443 if parts.scheme == "https" else 80
        names |= _host_headers(parts.hostname or "", parts.port or default, default)
    return {n.lower() for n in names}


def serve(
    container: ContainerClient,
    prefix: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    links_url: str | None = None,
    request_timeout: float = 30.0,
    credential: str | None = None,
) -> Gateway:
    """A started-on-demand server (call ``serve_forever``); port 0 picks a free port, which
    ``server_address`` then tells. ``credential`` (``user:password``; default
    ``RETRAIN_GATEWAY_AUTH_STRING``, when set) is asked of every request."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    bound = int(sock.getsockname()[1])
    credential = credential or os.environ.get(AUTH_ENV) or None
    app = create_app(container, prefix, host_names(host, bound, links_url), credential)
    deadline = RequestDeadline(app, request_timeout)
    config = uvicorn.Config(
        deadline,
        http=deadline.protocol(),
        ws="none",
        lifespan="off",
        loop="asyncio",
        log_config=None,  # the process's own logging stays as it is
        access_log=False,  # each request is logged by the app, escaped
        server_header=False,
        # The client's address is the connection's (RequestDeadline finds each connection by
        # it): a header of the client's own never replaces it, behind a proxy or not.
        proxy_headers=False,
        # On every answer of the application, errors included. uvicorn's own 400 to a request
        # it cannot parse goes without them: a fixed text of its own, declared text/plain,
        # carrying nothing of the client's for a browser to run.
        headers=list(SAFETY_HEADERS.items()),
        h11_max_incomplete_event_size=MAX_REQUEST_HEAD,
        timeout_graceful_shutdown=5,
    )
    return Gateway(uvicorn.Server(config), sock)


class Gateway:
    """The gateway's server: ``serve_forever`` runs it (in the calling thread) until
    ``shutdown`` (from any thread) or Ctrl-C."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket) -> None:
        self.server, self.socket = server, sock
        self.server_address = sock.getsockname()
        self._running = threading.Event()
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        self._running.set()
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serving, and return once ``serve_forever`` has."""
        self.server.should_exit = True
        if self._running.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
