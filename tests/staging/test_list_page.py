"""The List Blobs page scanner against the XML parser, its ground truth: for every page, what
the scanner reads is what the parser reads, or it declines and the parser reads the page (or
raises, as it always did). Pages are written as the service writes them (the element order,
empty elements and escaping of the service's own List Blobs answers, as recorded in
Azure/azure-sdk-for-js sdk/storage/storage-blob/recordings/*/special_naming_tests), with
hostile names, then damaged in the ways a body on the wire or an odd writer could be."""

from __future__ import annotations

import random
from collections.abc import Callable
from urllib.parse import quote
from xml.etree import ElementTree

import pytest

from staging.list_page import blobs, next_marker, parsed, scan
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


def _outcome(read: Callable[[bytes], list[PinnedBlob]], body: bytes) -> object:
    try:
        return read(body)
    except Exception as exc:  # the parser's error is part of its answer
        return type(exc)


def test_the_scanner_reads_every_page_of_the_services_form_as_the_parser_does() -> None:
    """Hostile names included: escaped characters, quotes, URL characters, multi-byte UTF-8,
    tabs and newlines, and names the service percent-encodes (Encoded="true")."""
    for listed, marker, bom in PAGES:
        body = _page(listed, marker, bom)
        assert parsed(body) == listed  # the page says what it was written to say
        assert scan(body) == listed, body  # and the scanner read it, not the parser
        assert next_marker(body) == marker
    assert sum(b.name != b.name.strip() or "&" in b.name for p, _, _ in PAGES for b in p) > 50
    assert sum(any(c in b.name for c in UNCARRIED) for p, _, _ in PAGES for b in p) > 20
    assert sum(b.size % 2 == 1 for p, _, _ in PAGES for b in p) > 20  # versions, replication


def _at(rng: random.Random, body: bytes, what: bytes) -> bytes:
    """``what`` inside a random name's text, or anywhere when the page has none."""
    names = [i for i in range(len(body)) if body.startswith(b"<Name>", i)]
    at = rng.choice(names) + 6 if names else rng.randrange(len(body))
    return body[:at] + what + body[at:]


def _lost(rng: random.Random, body: bytes) -> bytes:
    at = rng.randrange(len(body))
    return body[:at] + body[at + 1 :]


def _twice(rng: random.Random, body: bytes) -> bytes:
    """A run of the body's own bytes again, up to two blobs' length."""
    at = rng.randrange(len(body))
    return body[:at] + body[at : at + rng.randint(1, 1500)] + body[at:]


def _blob_again(rng: random.Random, body: bytes) -> bytes:
    """The bytes from inside one blob to inside the next, again: each copy is a blob's worth
    of fields, the page breaks only where the copy ends (a reviewer's case: a name then
    stood beside the fields of the blob before it)."""
    starts = [i for i in range(len(body)) if body.startswith(b"<Blob>", i)]
    if len(starts) < 2:
        return body
    k = rng.randrange(len(starts) - 1)
    begin = body.index(b"</Name>", starts[k])
    end = body.index(b"<Properties>", starts[k + 1]) + 5
    return body[:end] + body[begin:end] + body[end:]


def _between(rng: random.Random, body: bytes, what: bytes) -> bytes:
    """``what`` between two blobs, or after the only one."""
    ends = [i + 7 for i in range(len(body)) if body.startswith(b"</Blob>", i)]
    at = rng.choice(ends) if ends else rng.randrange(len(body))
    return body[:at] + what + body[at:]


def _field(body: bytes, tag: bytes, nested: bytes) -> bytes:
    """The first element ``tag`` holding ``nested`` after its text."""
    at = body.find(b"</%s>" % tag)
    return body if at < 0 else body[:at] + nested + body[at:]


# Damage on the wire, markup another writer could use that the scanner does not read, and
# pages the parser reads in a form the service never writes.
DAMAGE: dict[str, Callable[[random.Random, bytes], bytes]] = {
    "cut short": lambda r, b: b[: r.randrange(len(b))],
    "one byte lost": lambda r, b: _lost(r, b),
    "a slice twice": lambda r, b: _twice(r, b),
    "a blob's bytes again": lambda r, b: _blob_again(r, b),
    "an element between blobs": lambda r, b: _between(r, b, b"</Oops>&lt;"),
    "text between blobs": lambda r, b: _between(r, b, b"x"),
    "a carriage return": lambda r, b: _at(r, b, b"a\r\nb\rc"),
    "a control character": lambda r, b: _at(r, b, bytes([r.choice([1, 8, 11, 12, 31])])),
    "a noncharacter": lambda r, b: _at(r, b, r.choice(["\uffff", "\ufffe"]).encode()),
    "a CDATA end": lambda r, b: _at(r, b, b"a]]>b"),
    "a character reference": lambda r, b: _at(r, b, b"&#65;&#x26;"),
    "an unknown entity": lambda r, b: _at(r, b, b"&bogus;"),
    "a bare ampersand": lambda r, b: _at(r, b, b"a & b"),
    "CDATA": lambda r, b: _at(r, b, b"<![CDATA[a<b>&c]]>"),
    "a comment": lambda r, b: _at(r, b, b"<!-- x -->"),
    "a processing instruction": lambda r, b: _at(r, b, b"<?pi x?>"),
    "a child element": lambda r, b: _at(r, b, b"<i>x</i>"),
    "an internal entity": lambda r, b: b.replace(
        b"<EnumerationResults",
        b'<!DOCTYPE EnumerationResults [<!ENTITY e "x">]><EnumerationResults',
        1,
    ).replace(b"<Name>", b"<Name>&e;", 1),
    "an attribute default": lambda r, b: b.replace(
        b"<EnumerationResults",
        b'<!DOCTYPE EnumerationResults [<!ATTLIST Name Encoded CDATA "true">]><EnumerationResults',
        1,
    ),
    "a name inside a name": lambda r, b: _field(b, b"Name", b"<Name>p/other</Name>"),
    "an ETag inside an ETag": lambda r, b: _field(b, b"Etag", b"<Etag>0x2</Etag>"),
    "a length inside a length": lambda r, b: _field(b, b"Content-Length", b"<L>9</L>"),
    "an MD5 element inside the MD5": lambda r, b: _field(b, b"Content-MD5", b"<Content-MD5 />"),
    "a name inside another element": lambda r, b: b.replace(
        b"<Blob><Name>", b"<Blob><Wrapped><Name>", 1
    ).replace(b"</Name>", b"</Name></Wrapped><Name>p/second</Name>", 1),
    "a blob without properties": lambda r, b: b.replace(b"<Properties>", b"<Gone>", 1).replace(
        b"</Properties>", b"</Gone>", 1
    ),
    "properties twice": lambda r, b: b.replace(b"</Properties>", b"</Properties><Properties />", 1),
    "no Blobs element": lambda r, b: b.replace(b"<Blobs>", b"<Set>").replace(
        b"</Blobs>", b"</Set>"
    ),
    "two Blobs elements": lambda r, b: b.replace(b"<Blobs>", b"<Blobs></Blobs><Blobs>", 1),
    # A reviewer's: blobs in a Blobs element that is not the root's, beside one that is.
    "blobs nested, an empty Blobs before": lambda r, b: b.replace(
        b"<Blobs>", b"<Blobs/><W><Blobs>", 1
    ).replace(b"</Blobs>", b"</Blobs></W>", 1),
    "blobs nested, an empty Blobs after": lambda r, b: b.replace(
        b"<Blobs>", b"<W><Blobs>", 1
    ).replace(b"</Blobs>", b"</Blobs></W><Blobs></Blobs>", 1),
    "blobs nested, text in the root's Blobs": lambda r, b: b.replace(
        b"<Blobs>", b"<Blobs>text</Blobs><X><Blobs>", 1
    ).replace(b"</Blobs>", b"</Blobs></X>", 1),
    "blobs in a namespace, the root's Blobs empty": lambda r, b: b.replace(
        b"<EnumerationResults ", b'<EnumerationResults xmlns="u" ', 1
    ).replace(b"</Blobs>", b'</Blobs><Blobs xmlns=""/>', 1),
    "the placeholder's name in the page": lambda r, b: b.replace(
        b"<Prefix>", b"<Prefix>scanned-blobs", 1
    ),
    "a namespace": lambda r, b: b.replace(
        b"<EnumerationResults ", b'<EnumerationResults xmlns="u" '
    ),
    "an empty name": lambda r, b: b.replace(b"<Name>", b"<Name/><Gone>", 1),
    "another attribute": lambda r, b: b.replace(b"<Name>", b'<Name Encoded="false">', 1),
    "a second attribute": lambda r, b: b.replace(
        b'<Name Encoded="true">', b'<Name x="1" Encoded="true">', 1
    ),
    "a length not a number": lambda r, b: b.replace(b"<Content-Length>", b"<Content-Length> ", 1),
    "a length empty": lambda r, b: b.replace(
        b"<Content-Length>", b"<Content-Length></Content-Length><Was>", 1
    ).replace(b"</Content-Length>", b"</Was>", 2),
    "an attribute on another element": lambda r, b: b.replace(
        b"<OrMetadata>", b'<OrMetadata a="1">', 1
    ).replace(b"<Content-Type>", b'<Content-Type a="/>">', 1),
    "a blob with attributes": lambda r, b: b.replace(b"<Blob>", b'<Blob x="1">', 1),
    "a length element empty": lambda r, b: b.replace(b"<Content-MD5 />", b"<Content-Length />", 1),
    "latin-1 declared": lambda r, b: b.replace(b'encoding="utf-8"', b'encoding="iso-8859-1"'),
    "utf-16": lambda r, b: (
        b.decode("utf-8-sig").replace('encoding="utf-8"', 'encoding="utf-16"').encode("utf-16")
    ),
    "invalid utf-8": lambda r, b: _at(r, b, b"\xff\xfe"),
    "invalid utf-8 outside the fields": lambda r, b: b.replace(
        b"application/octet-stream", b"application/\xffoctet", 1
    ),
    "pretty-printed": lambda r, b: b.replace(b"><", b">\n  <"),
}


# Damage the scanner sees wherever it lies: it declines every page of blobs so changed (a
# page of none it may read as the parser does, []). The rest can leave a page it reads as
# the parser does: a whole blob repeated, say, or an empty Blobs element beside the blobs'.
SEEN_ANYWHERE = set(DAMAGE) - {
    "one byte lost",
    "a slice twice",
    "a child element",
    "two Blobs elements",
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_page_of_another_form_is_the_parsers_to_read_or_refuse(damage: str) -> None:
    """A page the parser reads: the scanner's answer is the parser's, or none. A page the
    parser refuses: the scanner declines, and the listing raises the parser's error. Damage
    to the page's form the scanner sees wherever it lies: it declines every page of blobs
    so changed."""
    changed = with_blobs = declined = 0
    for seed, (listed, marker, bom) in enumerate(PAGES[:120]):
        page = _page(listed, marker, bom)
        body = DAMAGE[damage](random.Random(seed), page)
        if body == page:
            continue  # nothing of what this damage touches on this page
        changed += 1
        truth = _outcome(parsed, body)
        scanned = scan(body)
        if isinstance(truth, list):
            assert scanned is None or scanned == truth, (damage, body)
        else:
            assert scanned is None, (damage, body)
        assert _outcome(blobs, body) == truth
        if listed:
            with_blobs += 1
            declined += scanned is None
    assert changed > 20
    if damage in SEEN_ANYWHERE:
        assert declined == with_blobs > 0, damage


def test_a_page_the_parser_refuses_is_refused() -> None:
    body = _page(PAGES[1][0], "", False)
    with pytest.raises(ElementTree.ParseError):
        blobs(body.replace(b"</Blobs>", b"</Blob"))
