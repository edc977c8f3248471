"""The listing staging and the gate pin: a page whose body is cut off on the way is asked for
again, as the SDK pipeline's own retries do for a body they read (the listing reads its pages
as streams, so the pipeline does not parse each one into an element tree it never returns)."""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest
from azure.storage.blob import ContainerClient

from staging.blob import API_VERSION, list_pinned
from staging.list_page import blobs as read_page
from staging.listing import PinnedBlob
from tests.staging.list_server import data_client, page, reply_headers, serving

PAGE = (
    b'<?xml version="1.0" encoding="utf-8"?><EnumerationResults><Blobs>'
    b"<Blob><Name>p/a.png</Name><Properties><Etag>&quot;0x1&quot;</Etag>"
    b"<Content-Length>3</Content-Length><Content-MD5>rL0Y20zC+Fzt72VPzMSk2A==</Content-MD5>"
    b"</Properties></Blob></Blobs><NextMarker /></EnumerationResults>"
)


@pytest.fixture
def cut_once() -> Iterator[tuple[int, list[str]]]:
    """A List Blobs endpoint whose first answer stops 50 bytes into the page."""

    def answer(handler: BaseHTTPRequestHandler, call: int) -> None:
        reply_headers(handler, 200, PAGE)
        if call == 1:
            handler.wfile.write(PAGE[:50])
            handler.wfile.flush()
            handler.connection.shutdown(socket.SHUT_RDWR)
            handler.close_connection = True
            return
        handler.wfile.write(PAGE)

    with serving(answer) as served:
        yield served


@pytest.mark.processes
def test_a_page_cut_off_on_the_way_is_asked_for_again(cut_once: tuple[int, list[str]]) -> None:
    port, calls = cut_once
    assert list_pinned(data_client(port), "p") == [
        PinnedBlob("p/a.png", '"0x1"', 3, "rL0Y20zC+Fzt72VPzMSk2A==")
    ]
    assert len(calls) == 2 and all("comp=list" in c and "prefix=p%2F" in c for c in calls)


# Names a folder walk could get wrong: a blob and a folder of one name, a name ending in "/"
# (a folder marker, as Storage Explorer and ADLS tools write), an empty segment, characters
# URLs and XML escape, non-ASCII and deep nesting; and names beside the prefix, not below it.
HOSTILE = [
    "p/a.png",
    "p/x",
    "p/x/y.png",
    "p/marker/",
    "p/marker/inside.png",
    "p//double.png",
    "p/sp ace/+plus%2Fslash&amp;.png",
    "p/q<u>o\"t'e]]>.png",
    "p/tab\tand\nnewline.png",
    "p/ü/ß 猫.png",
    "p/d1/d2/d3/d4/deep.png",
    *[f"p/wide/c{k:02d}/i{j}.png" for k in range(12) for j in range(3)],
    "p0/beside.png",
    "pp/beside.png",
    "q/elsewhere.png",
]


@pytest.fixture(scope="module")
def hostile(azurite: str) -> ContainerClient:
    from tests.pipeline_helpers import new_container

    container = new_container(azurite, "walk")
    for k, name in enumerate(HOSTILE):
        container.upload_blob(name, name.encode() * (k + 1))
    return container


@pytest.mark.parametrize("page_size", [5000, 3])
@pytest.mark.parametrize("prefix", ["p", ""])
def test_the_listing_is_what_the_sdk_lists_page_after_page(
    hostile: ContainerClient,
    azurite: str,
    monkeypatch: pytest.MonkeyPatch,
    prefix: str,
    page_size: int,
) -> None:
    """Ground truth: the SDK's own iterator, each blob pinned as the gate pins it, and the XML
    parser on each page Azurite sent. With three blobs a page, each page's marker (taken
    from the end of its body, escaped names and all) asks for the next while the page is
    read."""
    import math

    import staging.blob
    from staging.listing import pin

    monkeypatch.setattr(staging.blob, "PAGE_SIZE", page_size)
    pages: list[bytes] = []
    queries: list[str] = []
    fetch = staging.blob._page

    def recorded(client: object, name: str, url: str) -> bytes:
        queries.append(url)
        pages.append(fetch(client, name, url))
        return pages[-1]

    monkeypatch.setattr(staging.blob, "_page", recorded)
    client = ContainerClient.from_connection_string(
        azurite, hostile.container_name, api_version=API_VERSION
    )
    listed = list_pinned(client, prefix)
    expected = [
        pin(b) for b in hostile.list_blobs(name_starts_with=f"{prefix}/" if prefix else None)
    ]
    assert listed == expected
    assert len(listed) == (len(HOSTILE) - 3 if prefix else len(HOSTILE))
    assert len(queries) == math.ceil(len(listed) / page_size)
    assert sum("marker=" in q for q in queries) == len(queries) - 1
    # Each page Azurite sent, read on its own, holds its share of the listing.
    assert pages and sum(len(read_page(p)) for p in pages) == len(listed)


@contextlib.contextmanager
def _two_pages(first: bytes) -> Iterator[tuple[int, list[str]]]:
    """A List Blobs endpoint whose first page is ``first`` and names a next one, which it
    refuses; yields its port and the paths asked for."""

    def answer(handler: BaseHTTPRequestHandler, call: int) -> None:
        if "marker=" in handler.path:
            reply_headers(handler, 403)
            return
        body = first.replace(b"<NextMarker />", b"<NextMarker>p/a.png&amp;1</NextMarker>")
        reply_headers(handler, 200, body)
        handler.wfile.write(body)

    with serving(answer) as served:
        yield served


@pytest.mark.processes
def test_a_next_page_refused_fails_the_listing_naming_the_container() -> None:
    with _two_pages(PAGE) as (port, calls):
        with pytest.raises(ValueError, match=r"container 'data': listing .* refused with HTTP 403"):
            list_pinned(data_client(port), "p")
        # The marker, unescaped and quoted (the SAS a shared key signs follows it).
        assert re.search(r"&marker=p%2Fa\.png%261(&|$)", calls[1]), calls[1]


@pytest.mark.processes
def test_the_next_page_is_asked_for_before_this_one_is_parsed() -> None:
    """A first page whose blobs cannot be parsed, with a good marker at its end: the next
    page was asked for before parsing found the damage."""
    damaged = PAGE.replace(b"<Content-Length>3</Content-Length>", b"<Content-Length>3</Con")
    with _two_pages(damaged) as (port, calls):
        with pytest.raises(SyntaxError):
            list_pinned(data_client(port), "p")
        assert len(calls) == 2 and "marker=" in calls[1]


@pytest.mark.parametrize("md5", [None, "rL0Y20zC+Fzt72VPzMSk2A=="])
def test_a_page_is_read_without_the_collector_walking_the_process(md5: str | None) -> None:
    """A 5,000-blob page becomes some 80,000 objects in the XML parser's tree: with the cyclic
    collector running, each page set off about a hundred collections, some walking every
    object of the process (145 ms of a page's 183 ms with Prefect imported). None runs while
    a page is read (blobs with an MD5 and without one); the collector is running again
    afterwards, and its first allocation sets off one collection (the count of allocations
    made in the pause is over its threshold)."""
    import gc

    from staging.blob import _blobs

    blobs = [PinnedBlob(f"p/c{i % 20}/{i}.png", f'"0x{i:X}"', i, md5) for i in range(5000)]
    body = page(blobs)
    collections: list[int] = []

    def counted(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    assert gc.isenabled()
    gc.callbacks.append(counted)
    try:
        parsed = _blobs(body)
    finally:
        gc.callbacks.remove(counted)
    assert parsed == blobs
    assert len(collections) <= 1
    assert gc.isenabled()


def test_a_collector_paused_by_the_caller_stays_paused_and_an_error_restarts_it() -> None:
    import gc

    from staging.blob import paused_gc

    with paused_gc() as pause:
        assert not gc.isenabled()
        with pause.resumed():  # reads step out of the pause
            assert gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc() as pause:
            assert not gc.isenabled()
            with pause.resumed():
                assert not gc.isenabled()  # not the caller's own pause
        assert not gc.isenabled()  # the caller's pause is the caller's to end
    finally:
        gc.enable()
    from staging.blob import _blobs

    with pytest.raises(SyntaxError):
        _blobs(PAGE.replace(b"</Blobs>", b"</Blob"))  # a page that does not parse
    assert gc.isenabled()
