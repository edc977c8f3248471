"""One List Blobs page: its blobs (the four fields staging pins) and the marker of the next.

Why a scanner beside the XML parser: a 5,000-blob page is 3.3 MB of XML, which the C parser
turns into some 80,000 elements to read four fields of each blob: 40-48 ms of CPU per page,
a tenth of a re-sync's time and, at ImageNet's 266 pages, most of the gate's listing CPU.
The scanner takes about half of that, its checks included.

Why it reads what the parser reads: it reads a page only when the page is well-formed XML of
a plain form the service writes (that of a listing asked for with no ``include``), and
proves that with no tree built:

* the blobs, as one run of text, match a grammar of that form: each ``Blob`` holds its
  ``Name`` (attribute ``Encoded="true"`` or none), elements of text only (a version's id,
  on an account that keeps versions), then ``Properties`` holding, in the service's order
  and once each, ``Etag``, ``Content-Length`` (a plain number) and ``Content-MD5`` among
  elements of text only, then elements of text only or holding only such elements (object
  replication's ``OrMetadata``); every other element has no attribute and is closed by its
  own name. So each field is the one the parser finds, in its own blob;
* the page is parsed with a placeholder where the blobs were (a few hundred bytes): the
  placeholder must be all that one ``Blobs`` element of the root holds, and every other
  such element (whose blobs the parser would read too) must be empty;
* the whole body is UTF-8 (and declared so, or not declared), holds no character XML
  forbids or rewrites (control characters, carriage returns, U+FFFE, U+FFFF), no ``]]>`` in
  text, no ``<!`` (comment, CDATA, a DTD, which could define entities or attribute
  defaults) nor ``<?`` after the declaration, and every ampersand starts one of the five
  entities XML predefines (so no character reference).

Any other page goes to the XML parser, which reads it or raises as it always did. A blob
name cannot make the scanner misread a page: the service escapes it (``&lt;`` for ``<``,
``&amp;`` for ``&``), or percent-encodes it with ``Encoded="true"`` where XML cannot carry
one of its characters. A name holding a carriage return, which Azurite writes as a
character reference, sends its page to the parser: slower, not read otherwise.
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


_FIELDS_AND_BLOB = rb"(?!(?:Name|Etag|Content-Length|Content-MD5|Blob|Properties)[\s/>])"


def _others(n: int) -> bytes:
    """Any run of elements of text only other than the fields and the blob's own: each with
    no attribute, closed by its own name (group ``o<n>``: a pattern names each group once)."""
    return rb"(?:<%s(?P<o%d>[A-Za-z][\w.-]*)(?:>[^<]*</(?P=o%d)>| ?/>))*+" % (
        _FIELDS_AND_BLOB,
        n,
        n,
    )


def _holders(n: int) -> bytes:
    """Any run of elements each of text only, or holding only such elements (as
    ``OrMetadata`` holds a blob's replication policies), other than the fields and the blob's
    own (groups ``h<n>`` and ``o<n>``)."""
    return rb"(?:<%s(?P<h%d>[A-Za-z][\w.-]*)(?: ?/>|>[^<]*</(?P=h%d)>|>%s</(?P=h%d)>))*+" % (
        _FIELDS_AND_BLOB,
        n,
        n,
        _others(n),
        n,
    )


# The blobs of a page of the service's plain form, as one run of text (see the docstring).
_BLOBS = re.compile(
    rb'(?:<Blob><Name(?: Encoded="true")?>[^<]*</Name>'
    + _others(1)
    + rb"<Properties>"
    + _others(2)
    + rb"<Etag>[^<]*</Etag>"
    + _others(3)
    + rb"<Content-Length>[0-9]{1,19}</Content-Length>"
    + _others(4)
    + rb"<Content-MD5(?: ?/>|>[^<]*</Content-MD5>)"
    + _others(5)
    + rb"</Properties>"
    + _holders(6)
    + rb"</Blob>)*+"
)
# Where the blobs were, in the page parsed around them (a name no page the scanner reads holds).
_CUT = b"scanned-blobs"
_DECLARATION = re.compile(
    rb'(?:\xef\xbb\xbf)?(<\?xml version="1\.0" encoding="utf-8"(?: standalone="yes")?\?>)?'
    rb"<EnumerationResults[ >]",
    re.IGNORECASE,
)
# Bytes XML forbids in a document (control characters but tab, newline and carriage return),
# and carriage returns, which a parser turns into newlines (a page holding one is the
# parser's to read).
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
    """The blobs of one page, with the four fields staging needs: the parser's error when the
    page is not well-formed (``ElementTree.ParseError``) or a length is not a number
    (``ValueError``)."""
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
    element tree; None for any other page (the module's docstring says what qualifies)."""
    if not _plain(body):
        return None
    first, end = body.find(b"<Blob>"), body.rfind(b"</Blob>") + len(b"</Blob>")
    if first < 0:
        blobs, around = b"", body
    elif first < end and body.endswith(b"<Blobs>", 0, first) and body.startswith(b"</Blobs>", end):
        if _CUT in body:
            return None
        blobs, around = body[first:end], body[:first] + b"<%s/>" % _CUT + body[end:]
    else:
        return None
    try:
        root = ElementTree.fromstring(around)
    except ElementTree.ParseError:
        return None
    # The parser's blobs are those of every Blobs element of the root: the one the blobs were
    # cut from must be among them and hold nothing else, every other one nothing.
    held = [[e.tag for e in holder] for holder in root.findall("Blobs") if len(holder)]
    if held != ([[_CUT.decode()]] if blobs else []):
        return None
    if not _BLOBS.fullmatch(blobs):
        return None
    names, etags = _NAME.findall(blobs), _ETAG.findall(blobs)
    lengths, md5s = _LENGTH.findall(blobs), _MD5.findall(blobs)
    named = [
        unquote(text) if encoded else text
        for (encoded, _), text in zip(names, _texts([name for _, name in names]), strict=True)
    ]
    return list(
        map(PinnedBlob, named, _texts(etags), map(int, lengths), [m or None for m in _texts(md5s)])
    )


def _plain(body: bytes) -> bool:
    """Whether the whole body is of the plain form (the third point of the module's
    docstring). Each test looks first for a byte that is rare in a listing, so a page that
    has none costs a pass at memory speed."""
    declared = _DECLARATION.match(body)
    if not declared or len(body.translate(None, _NOT_PLAIN)) != len(body):
        return False
    if not body.isascii():
        try:
            body.decode()
        except UnicodeDecodeError:
            return False
    after = declared.end(1) if declared.group(1) else 0
    return not (
        (b"!" in body and b"<!" in body)
        or (b"]" in body and b"]]>" in body)
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
