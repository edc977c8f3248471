"""A List Blobs page read back to what it was written to say. Pages are written as the service
writes them (the element order, empty elements and escaping of the service's own List Blobs
answers, as recorded in Azure/azure-sdk-for-js
sdk/storage/storage-blob/recordings/*/special_naming_tests), with hostile names."""

from __future__ import annotations

import random
from urllib.parse import quote
from xml.etree import ElementTree

import pytest

from staging.list_page import blobs, next_marker
from staging.listing import PinnedBlob

# Characters a blob name may hold, hostile ones weighted in: what XML escapes, what URLs
# escape, multi-byte UTF-8, whitespace XML keeps, and characters XML cannot carry at all
# (the service percent-encodes those names and marks them Encoded="true").
PLAIN = "abcXYZ019/._-"
HOSTILE = " ~!@#$%^&*()+`={}|[]:\";'<>?,\\&&<<>>\t\n\u0085\u2028ßü猫汉字😀"
UNCARRIED = "\x01\x08\x0b\x1f\r\ufffe\uffff"


def _name(rng: random.Random, carried_only: bool = False) -> str:
    uncarried = not carried_only and rng.random() < 0.2
    alphabet = PLAIN * 3 + HOSTILE + (UNCARRIED if uncarried else "")
    return "p/" + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))


def _escape(text: str) -> str:
    """As the service escapes element text: ``&``, ``<`` and ``>``; quotes stay."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _entry(b: PinnedBlob) -> str:
    if any(c in b.name for c in UNCARRIED):
        name = f'<Name Encoded="true">{quote(b.name, safe="/")}</Name>'
    else:
        name = f"<Name>{_escape(b.name)}</Name>"
    md5 = f"<Content-MD5>{b.md5}</Content-MD5>" if b.md5 else "<Content-MD5 />"
    # As the service lists a blob of an account with versioning on, and of a container that
    # object replication copies from (by the blob's size, so that pages mix the forms).
    version = (
        "<VersionId>2020-07-03T06:02:12.1234567Z</VersionId><IsCurrentVersion>true"
        "</IsCurrentVersion>"
        if b.size % 2
        else ""
    )
    replicated = (
        "<OrMetadata><or-003ca702_9a53f315>complete</or-003ca702_9a53f315></OrMetadata>"
        if b.size == 1
        else ""
    )
    return (
        f"<Blob>{name}{version}<Properties>"
        "<Creation-Time>Wed, 26 Jun 2019 00:13:21 GMT</Creation-Time>"
        "<Last-Modified>Wed, 26 Jun 2019 00:13:21 GMT</Last-Modified>"
        f"<Etag>{_escape(b.etag)}</Etag><Content-Length>{b.size}</Content-Length>"
        "<Content-Type>application/octet-stream</Content-Type><Content-Encoding />"
        f"<Content-Language /><Content-CRC64 />{md5}<Cache-Control /><Content-Disposition />"
        "<BlobType>BlockBlob</BlobType><AccessTier>Hot</AccessTier>"
        "<LeaseStatus>unlocked</LeaseStatus><ServerEncrypted>true</ServerEncrypted>"
        f"</Properties>{replicated}</Blob>"
    )


def _page(listed: list[PinnedBlob], marker: str, bom: bool) -> bytes:
    body = (
        '<?xml version="1.0" encoding="utf-8"?><EnumerationResults ServiceEndpoint='
        '"https://account.blob.core.windows.net/" ContainerName="data"><Prefix>p/</Prefix>'
        f"<MaxResults>5000</MaxResults><Blobs>{''.join(_entry(b) for b in listed)}</Blobs>"
        + (f"<NextMarker>{_escape(marker)}</NextMarker>" if marker else "<NextMarker />")
        + "</EnumerationResults>"
    ).encode()
    return b"\xef\xbb\xbf" + body if bom else body


def _listed(rng: random.Random) -> list[PinnedBlob]:
    return [
        PinnedBlob(
            _name(rng),
            rng.choice(["0x8D6F9CB19665D79", '"0x1&2"', "0x8DA70795F911843"]),
            rng.choice([0, 1, 20715, 2**40]),
            rng.choice([None, "f8VicOenD6gaWTW3Lqy+KQ==", "1B2M2Y8AsgTpgAmY7PhCfg=="]),
        )
        for _ in range(rng.randint(0, 12))
    ]


PAGES = [
    (_listed(rng), _name(rng, carried_only=True) if rng.random() < 0.5 else "", rng.random() < 0.3)
    for rng in [random.Random(seed) for seed in range(300)]
]


def test_every_page_of_the_services_form_reads_as_it_was_written() -> None:
    """Hostile names included: escaped characters, quotes, URL characters, multi-byte UTF-8,
    tabs and newlines, and names the service percent-encodes (Encoded="true")."""
    for listed, marker, bom in PAGES:
        body = _page(listed, marker, bom)
        assert blobs(body) == listed
        assert next_marker(body) == marker
    assert sum(b.name != b.name.strip() or "&" in b.name for p, _, _ in PAGES for b in p) > 50
    assert sum(any(c in b.name for c in UNCARRIED) for p, _, _ in PAGES for b in p) > 20
    assert sum(b.size % 2 == 1 for p, _, _ in PAGES for b in p) > 20  # versions, replication


def test_a_page_the_parser_refuses_is_refused() -> None:
    body = _page(PAGES[1][0], "", False)
    with pytest.raises(ElementTree.ParseError):
        blobs(body.replace(b"</Blobs>", b"</Blob"))
    with pytest.raises(ValueError, match="malformed NextMarker"):
        next_marker(body.replace(b"<NextMarker />", b"<NextMarker>a&b</NextMarker>"))
