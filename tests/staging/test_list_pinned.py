"""The listing staging and the gate pin: a page whose body is cut off on the way is asked for
again, as the SDK pipeline's own retries do for a body they read (the listing reads its pages
as streams, so the pipeline does not parse each one into an element tree it never returns)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from azure.storage.blob import ContainerClient

from staging.blob import API_VERSION, list_pinned
from staging.listing import PinnedBlob

PAGE = (
    b'<?xml version="1.0" encoding="utf-8"?><EnumerationResults><Blobs>'
    b"<Blob><Name>p/a.png</Name><Properties><Etag>&quot;0x1&quot;</Etag>"
    b"<Content-Length>3</Content-Length><Content-MD5>rL0Y20zC+Fzt72VPzMSk2A==</Content-MD5>"
    b"</Properties></Blob></Blobs><NextMarker /></EnumerationResults>"
)
# Azurite's published development account: the server below does not check signatures.
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@pytest.fixture
def cut_once() -> Iterator[tuple[int, list[str]]]:
    """A List Blobs endpoint whose first answer stops 50 bytes into the page."""
    calls: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            calls.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(PAGE)))
            self.end_headers()
            if len(calls) == 1:
                self.wfile.write(PAGE[:50])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            self.wfile.write(PAGE)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port, calls
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_cut_off_on_the_way_is_asked_for_again(cut_once: tuple[int, list[str]]) -> None:
    port, calls = cut_once
    container = ContainerClient.from_connection_string(
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
        f"AccountKey={KEY};BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;",
        "data",
        api_version=API_VERSION,
    )
    assert list_pinned(container, "p") == [
        PinnedBlob("p/a.png", '"0x1"', 3, "rL0Y20zC+Fzt72VPzMSk2A==")
    ]
    assert len(calls) == 2 and all("comp=list" in c and "prefix=p%2F" in c for c in calls)
