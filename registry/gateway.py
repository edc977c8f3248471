"""The outputs gateway: links to a run's outputs that open in a browser, with no secret in them.

Output blobs are private, so a plain blob URL answers a browser 403, and a SAS in a link would
put a credential into the Prefect database, where anyone who can read a run can copy it. The
gateway is a small read-only HTTP server that the person (or the worker's machine) runs with
the same credentials as ``python -m flows.models``; the links in a run's artifacts point at it
when ``output.links_url`` names it. Access is decided where it runs: it listens on loopback
unless told otherwise, and answers only requests addressed to the host names it was given, so
a web page cannot reach it through DNS rebinding.

It serves the output container below ``output.prefix`` only: files (the model, metrics, logs,
the gate's Data Docs, whose relative links keep working because a folder is served as a
folder) and folder listings. GET and HEAD only; every answer is sandboxed (a stored page or
SVG cannot read the other outputs through the gateway).
"""

from __future__ import annotations

import html
import logging
import mimetypes
import socket
import unicodedata
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlsplit

from backends.blob import blob_link, join

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient, ContentSettings

    from core.config import OutputLocation

DEFAULT_PORT = 4280
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


def output_link(location: OutputLocation, container: ContainerClient, name: str) -> str:
    """The address people open for the blob ``name`` (a folder when it ends with ``/``): the
    gateway's when ``links_url`` is set and the blob is below ``prefix`` (all the gateway
    serves), else the blob's own (which needs a sign-in)."""
    relative = name.strip("/")
    base = location.prefix.strip("/")
    below = not base or relative == base or relative.startswith(f"{base}/")
    if not location.links_url or not below:
        # A gateway link to a blob outside the prefix would open prefix/<name>: another file.
        return blob_link(container, name)
    relative = relative[len(base) :].lstrip("/")
    folder = name.endswith("/") and relative
    return f"{location.links_url}/{quote(relative)}{'/' if folder else ''}"


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


def make_handler(
    container: ContainerClient, prefix: str, hosts: set[str]
) -> type[BaseHTTPRequestHandler]:
    """A request handler serving ``container`` below ``prefix`` to requests whose Host header
    is one of ``hosts`` (lower-case ``host:port``)."""
    from azure.core.exceptions import AzureError, ResourceNotFoundError

    class Handler(BaseHTTPRequestHandler):
        server_version = "retrain-outputs"
        sys_version = ""
        head_sent = False  # whether this answer's status line and headers are out

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            self.head_sent = False
            if (self.headers.get("Host") or "").lower() not in hosts:
                self._text(421, "this gateway does not answer for that host name\n", body)
                return
            try:
                name = blob_name(prefix, self.path)
                if name.endswith("/") or not name:
                    self._folder(name, body)
                else:
                    self._file(name, body)
            except BadPath as exc:
                self._text(400, f"bad path: {exc}\n", body)
            except AzureError as exc:
                # The exception's text can hold the storage request; only its kind goes out.
                kind = type(exc).__name__
                if self.head_sent:
                    # A blob deleted or overwritten while it streams: the status and length are
                    # out, so an error answer would land inside the file. Closing the connection
                    # short of the length is what tells the client the download failed.
                    LOG.warning("storage error while sending %s: %s", printable(self.path), kind)
                    self.close_connection = True
                elif isinstance(exc, ResourceNotFoundError):
                    self._text(404, "no such output\n", body)
                else:
                    LOG.warning("storage error for %s: %s", printable(self.path), kind)
                    self._text(502, f"Blob storage failed ({kind})\n", body)

        def _folder(self, name: str, body: bool) -> None:
            if not body:  # whether it exists: one entry of its listing, not all of them
                entries = container.walk_blobs(
                    name_starts_with=name, delimiter="/", results_per_page=1
                )
                found = next(iter(entries), None)
                if found is None and name:
                    self._text(404, "no such output\n", body)
                else:  # the page's length is not known without the page: none is sent
                    self._head(200, _HTML, None)
                return
            page = listing_html(container, name)
            if page is None:
                self._text(404, "no such output\n", body)
                return
            self._send(200, _HTML, page.encode(), body)

        def _file(self, name: str, body: bool) -> None:
            blob = container.get_blob_client(name)
            if not blob.exists():
                if next(iter(container.list_blobs(name_starts_with=f"{name}/")), None):
                    # A folder asked for without its slash: its page's relative links need it.
                    self.send_response(301)
                    self.send_header("Location", f"{target_path(self.path)}/")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                raise ResourceNotFoundError("no such blob")
            if not body:
                props = blob.get_blob_properties()
                self._file_head(name, props.content_settings, props.size)
                return
            # Stored bytes as they are: a blob written gzip-compressed (Content-Encoding) goes
            # out compressed with its encoding named, as Blob storage itself would send it; the
            # SDK's decompressing would make the body longer than the length announced.
            stream = blob.download_blob(decompress=False)
            self._file_head(name, stream.properties.content_settings, stream.size)
            for chunk in stream.chunks():
                self.wfile.write(chunk)

        def _file_head(self, name: str, settings: ContentSettings, size: int) -> None:
            encoding = {"Content-Encoding": settings.content_encoding}
            self._head(200, content_type(name, settings.content_type), size, encoding)

        def _text(self, status: int, text: str, body: bool) -> None:
            self._send(status, "text/plain; charset=utf-8", text.encode(), body)

        def _send(self, status: int, kind: str, data: bytes, body: bool) -> None:
            self._head(status, kind, len(data))
            if body:
                self.wfile.write(data)

        def _head(
            self,
            status: int,
            kind: str,
            length: int | None,
            extra: dict[str, str | None] | None = None,
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            if length is not None:
                self.send_header("Content-Length", str(length))
            for header, value in (extra or {}).items():
                if value:
                    self.send_header(header, value)
            self.end_headers()
            self.head_sent = True

        def end_headers(self) -> None:
            """Every answer's headers end here, http.server's own included (its error pages for
            a malformed request line, an unsupported method, a URI too long, and redirects)."""
            for header, value in SAFETY_HEADERS.items():
                self.send_header(header, value)
            super().end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            LOG.info("%s %s", self.address_string(), printable(format % args))

    return Handler


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


def listen_address(
    links_url: str | None, host: str | None = None, port: int | None = None
) -> tuple[str, int]:
    """Where the gateway listens: as asked, else where ``links_url`` says when that is this
    machine's loopback (anything else is a proxy in front of it), else loopback:4280."""
    parts = urlsplit(links_url or "")
    local = parts.hostname in ("127.0.0.1", "localhost", "::1")
    default_port = (parts.port or (443 if parts.scheme == "https" else 80)) if local else None
    return host or (parts.hostname if local and parts.hostname else "127.0.0.1"), (
        port or default_port or DEFAULT_PORT
    )


def serve(
    container: ContainerClient,
    prefix: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    links_url: str | None = None,
    request_timeout: float = 30.0,
) -> ThreadingHTTPServer:
    """A started-on-demand server (call ``serve_forever``); port 0 picks a free port, which
    ``server.server_address`` then tells."""
    server_class = _IPv6Server if ":" in host else ThreadingHTTPServer
    server = server_class((host, port), BaseHTTPRequestHandler)
    bound = server.server_address[1]
    handler = make_handler(container, prefix, host_names(host, int(bound), links_url))
    # A client that never finishes its request would hold its thread for good without it.
    handler.timeout = request_timeout
    server.RequestHandlerClass = handler
    server.daemon_threads = True
    return server


class _IPv6Server(ThreadingHTTPServer):
    """``links_url`` may name ``[::1]``: the server must then listen on an IPv6 socket."""

    address_family = socket.AF_INET6
