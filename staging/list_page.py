"""One List Blobs page: its blobs (the four fields staging pins) and the marker of the next.

Read with the C XML parser for only those fields: the storage SDK's own iterator builds a model
object per blob through its generic deserializer, many times the CPU of a parse
(docs/performance.md, the gate at ImageNet scale).
"""

from __future__ import annotations

from urllib.parse import unquote
from xml.etree import ElementTree

from staging.listing import PinnedBlob


def next_marker(body: bytes) -> str:
    """A page's ``NextMarker`` ("" on the last page), read from the end of the body without
    parsing the rest, so the next page can be asked for while this one is read: the element
    follows the blobs, and a ``<`` in any name or marker is escaped, so the last
    ``<NextMarker`` in the body is the element."""
    at = body.rfind(b"<NextMarker")
    if at < 0:
        return ""
    close = body.find(b"</NextMarker>", at)
    element = body[at : close + len(b"</NextMarker>")] if close >= 0 else b""
    if close < 0 and (end := body.find(b">", at)) >= 0:
        element = body[at : end + 1]  # <NextMarker />
    try:
        return ElementTree.fromstring(element).text or ""
    except ElementTree.ParseError:
        raise ValueError("a List Blobs page ends in a malformed NextMarker") from None


def blobs(body: bytes) -> list[PinnedBlob]:
    """The blobs of one page, with the four fields staging needs: the parser's error when the
    page is not well-formed (``ElementTree.ParseError``) or a length is not a number
    (``ValueError``)."""
    pinned = []
    for blob in ElementTree.fromstring(body).iterfind("Blobs/Blob"):
        name_el = blob.find("Name")
        props = blob.find("Properties")
        if name_el is None or props is None:
            continue
        name = name_el.text or ""
        if name_el.get("Encoded") == "true":  # names with characters XML cannot carry
            name = unquote(name)
        md5 = props.findtext("Content-MD5") or None
        size = int(props.findtext("Content-Length") or 0)
        pinned.append(PinnedBlob(name, props.findtext("Etag") or "", size, md5))
    return pinned
