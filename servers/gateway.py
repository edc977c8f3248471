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
SVG cannot read the other outputs through the gateway).
"""

from __future__ import annotations

import asyncio
import html
import logging
import mimetypes
import socket
import threading
import unicodedata
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import TYPE_CHECKING
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


def create_app(container: ContainerClient, prefix: str, hosts: set[str]) -> ASGIApp:
    """The gateway as an ASGI application: ``container`` below ``prefix``, to requests whose
    Host header is one of ``hosts`` (lower-case ``host:port``)."""
    return RequestLog(ReadOnly(HostCheck(OutputsApp(container, prefix), hosts)))


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11) with two things uvicorn lacks: a deadline for a
    request to arrive (a client that sends half a request line, or opens a connection and
    waits, would hold it for good), and the safety headers on the answer uvicorn writes itself
    to a malformed request (every other answer gets them from its ``headers`` setting)."""

    request_timeout = 30.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._deadline()

    def _deadline(self) -> None:
        """Close the connection unless another request has begun by then."""
        waiting_since = self.cycle

        def drop() -> None:
            if self.cycle is waiting_since and not self.transport.is_closing():
                self.transport.close()

        self.loop.call_later(self.request_timeout, drop)

    def send_400_response(self, msg: str) -> None:
        import h11

        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"connection", b"close"),
            *((k.lower().encode(), v.encode()) for k, v in SAFETY_HEADERS.items()),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=msg.encode("ascii")),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()


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
) -> Gateway:
    """A started-on-demand server (call ``serve_forever``); port 0 picks a free port, which
    ``server_address`` then tells."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    bound = int(sock.getsockname()[1])
    app = create_app(container, prefix, host_names(host, bound, links_url))
    protocol = type("GatewayProtocol", (_Protocol,), {"request_timeout": request_timeout})
    config = uvicorn.Config(
        app,
        http=protocol,
        ws="none",
        lifespan="off",
        loop="asyncio",
        log_config=None,  # the process's own logging stays as it is
        access_log=False,  # each request is logged by the app, escaped
        server_header=False,
        headers=list(SAFETY_HEADERS.items()),  # on every answer, errors included
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
