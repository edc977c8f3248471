"""A List Blobs endpoint on loopback, for the listing's tests: it answers what each test
writes, so a test can cut a body short, refuse a page, or hold a page back."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from xml.sax.saxutils import escape

from azure.storage.blob import ContainerClient

from staging.blob import API_VERSION
from staging.listing import PinnedBlob

# Azurite's published development account: the server below does not check signatures.
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@contextlib.contextmanager
def serving(
    answer: Callable[[BaseHTTPRequestHandler, int], None],
) -> Iterator[tuple[int, list[str]]]:
    """A List Blobs endpoint on loopback: ``answer(handler, call)`` writes the reply to each
    request (``call`` counts from 1); yields its port and the paths asked for."""
    calls: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            calls.append(self.path)
            answer(self, len(calls))

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port, calls
    finally:
        server.shutdown()
        server.server_close()


def reply_headers(handler: BaseHTTPRequestHandler, status: int, body: bytes = b"") -> None:
    """The status line and headers of a reply whose body is ``body``."""
    handler.send_response(status)
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()


def data_client(port: int) -> ContainerClient:
    return ContainerClient.from_connection_string(
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
        f"AccountKey={KEY};BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;",
        "data",
        api_version=API_VERSION,
    )


def page(blobs: Iterable[PinnedBlob], marker: str = "") -> bytes:
    """A List Blobs page holding ``blobs`` (names, ETags, sizes, MD5s), as the service
    writes one: every value escaped, ``marker`` as its NextMarker."""
    entries = "".join(
        f"<Blob><Name>{escape(b.name)}</Name><Properties>"
        f"<Etag>{escape(b.etag, {chr(34): '&quot;'})}</Etag>"
        f"<Content-Length>{b.size}</Content-Length>"
        + (f"<Content-MD5>{b.md5}</Content-MD5>" if b.md5 else "")
        + "</Properties></Blob>"
        for b in blobs
    )
    return (
        '<?xml version="1.0" encoding="utf-8"?><EnumerationResults><Blobs>'
        f"{entries}</Blobs><NextMarker>{escape(marker)}</NextMarker></EnumerationResults>"
    ).encode()
