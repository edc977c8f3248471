"""One List Blobs page: its blobs (the four fields staging pins) and the marker of the next.

Why a scanner beside the XML parser: a 5,000-blob page is 3.3 MB of XML, which the C parser
turns into some 110,000 elements to read four fields of each blob: 40-48 ms of CPU per page,
a tenth of a re-sync's time and, at ImageNet's 266 pages, most of the gate's listing CPU.
Scanning for the four fields' elements takes under half of that.

Why it reads what the parser reads: in the service's answer every blob name is escaped
(``&lt;`` for ``<``), or percent-encoded with ``Encoded="true"`` where XML cannot carry a
character, so nothing a name holds can open or close an element; each field is text between
its own start and end tags, with no ``<`` inside. The scanner reads a page only when it is of
the plain form the service writes: UTF-8, complete, with no markup it does not read (CDATA,
comments, a DTD, processing instructions), no character reference, no character XML forbids
or rewrites, and as many of each field as there are blobs. Any other page goes to the XML
parser, which reads it or raises as it always did. What the scanner takes on trust is the
service's own format, which nothing in a blob's name or content can change: where the fields
are (each blob's own, once, in its Properties), and that what it does not read is
well-formed (the body has arrived whole, by its length, and over TLS from Azure). The page
around the blobs is parsed (it is small); a page damaged inside a blob element, outside the
fields the scanner reads, is still read, where the parser would refuse it.
"""

from __future__ import annotations

import re
from urllib.parse import unquote
from xml.etree import ElementTree

from staging.listing import PinnedBlob

_NAME = re.compile(rb'<Name( Encoded="true")?>([^<]*)</Name>')
_ETAG = re.compile(rb"<Etag>([^<]*)</Etag>")
_LENGTH = re.compile(rb"<Content-Length>([0-9]{1,19})</Content-Length>")
_MD5 = re.compile(rb"<Content-MD5(?: ?/>|>([^<]*)</Content-MD5>)")
_DECLARATION = re.compile(
    rb'(?:\xef\xbb\xbf)?(<\?xml version="1\.0" encoding="utf-8"(?: standalone="yes")?\?>)?'
    rb"<EnumerationResults[ >]",
    re.IGNORECASE,
)
# Bytes XML forbids in a document (control characters but tab, newline and carriage return),
# and carriage returns, which a parser turns into newlines.
_NOT_PLAIN = bytes(range(0, 9)) + b"\x0b\x0c\r" + bytes(range(14, 32))
_NONCHARACTER = re.compile(b"\xef\xbf[\xbe\xbf]")  # U+FFFE and U+FFFF, which XML forbids too
_ENTITY = re.compile(rb"&(amp|lt|gt|quot|apos);")
_CHARS = {b"amp": b"&", b"lt": b"<", b"gt": b">", b"quot": b'"', b"apos": b"'"}


def next_marker(body: bytes) -> str:
    """A page's ``NextMarker`` ("" on the last page), read from the end of the body without
    parsing the rest: the element follows the blobs, and a ``<`` in any name or marker is
    escaped, so the last ``<NextMarker`` in the body is the element."""
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
    """The blobs of one page, with the four fields staging needs; the XML parser's error
    (``ElementTree.ParseError``) when the page is not well-formed."""
    scanned = scan(body)
    return scanned if scanned is not None else parsed(body)


def parsed(body: bytes) -> list[PinnedBlob]:
    """The blobs of one page as the XML parser reads it: any page the service may send."""
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


def scan(body: bytes) -> list[PinnedBlob] | None:
    """The blobs of a page of the plain form the service writes, read without building its
    element tree; None for any other page (see the module's docstring for what qualifies)."""
    if not _plain(body):
        return None
    first, last = body.find(b"<Blob>"), body.rfind(b"</Blob>")
    try:  # the page around its blobs, which the patterns do not read, is well-formed
        envelope = body[:first] + body[last + len(b"</Blob>") :] if 0 <= first < last else body
        ElementTree.fromstring(envelope)
    except ElementTree.ParseError:
        return None
    names, etags = _NAME.findall(body), _ETAG.findall(body)
    lengths, md5s = _LENGTH.findall(body), _MD5.findall(body)
    # One of each field per blob: an element the patterns passed over (another attribute,
    # an empty name, a length that is not a plain number, markup inside) leaves one short.
    if not body.count(b"<Blob>") == len(names) == len(etags) == len(lengths) == len(md5s):
        return None
    try:
        texts = _texts([name for _, name in names])
        etag_texts, md5_texts = _texts(etags), _texts(md5s)
    except UnicodeDecodeError:
        return None  # not UTF-8: the parser raises
    named = [unquote(t) if encoded else t for (encoded, _), t in zip(names, texts, strict=True)]
    return list(
        map(PinnedBlob, named, etag_texts, map(int, lengths), [m or None for m in md5_texts])
    )


def _plain(body: bytes) -> bool:
    """Whether a page is of the plain form the scanner reads: UTF-8 as declared (or with no
    declaration), complete, with no character XML forbids or rewrites, no markup but
    elements (no comment, CDATA or DTD, which could define entities; no processing
    instruction after the declaration), and every ampersand the start of one of the five
    entities XML predefines (so no character reference). Each test looks first for a byte
    that is rare in a listing, so a page that has none costs a pass at memory speed."""
    declared = _DECLARATION.match(body)
    if not declared or len(body.translate(None, _NOT_PLAIN)) != len(body):
        return False
    if not body.rstrip(b" \t\n").endswith(b"</EnumerationResults>"):
        return False  # cut short: the parser raises
    after = declared.end(1) if declared.group(1) else 0
    return not (
        (b"!" in body and b"<!" in body)
        or (b"&" in body and body.count(b"&") != len(_ENTITY.findall(body)))
        or (body.find(b"?", after) >= 0 and body.find(b"<?", after) >= 0)
        or (b"\xbf" in body and _NONCHARACTER.search(body))
    )


def _texts(raw: list[bytes]) -> list[str]:
    """Elements' texts, their entities (every ampersand starts one of the five XML
    predefines, :func:`_plain` saw to it) replaced, UTF-8 decoded: all at once, joined by a
    byte no page the scanner reads holds."""
    if not raw:
        return []
    joined = b"\x00".join(raw)
    if b"&" in joined:
        joined = _ENTITY.sub(_entity, joined)
    return joined.decode().split("\x00")


def _entity(found: re.Match[bytes]) -> bytes:
    return _CHARS[found[1]]
