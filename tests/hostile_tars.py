"""WebDataset shards with hostile member headers, written byte by byte as an attacker would:
a valid sample, then sample ``b`` whose size is false.

``size=-1536`` in an extended (pax) header sends Python 3.11.7's tarfile back to a header it
has read, forever (CVE-2025-8194); a size past the end of the file ends in an OSError from a
seek; a base-256 size field can be negative without any extended header.
"""

from __future__ import annotations

import io
import tarfile

# The cases: (id, how the shard lies, the words a refusal must hold besides the member).
CASES = [
    ("pax-size-negative", "pax:-1536", "says -1536 bytes"),
    ("pax-size-1e18", "pax:1000000000000000000", "says 1000000000000000000 bytes, past the end"),
    ("base256-size-negative", "base256:-1536", "says -1536 bytes"),
]
MEMBER = "b.png"  # the sample whose header lies


def hostile_shard(png: bytes, lie: str, label: bytes = b"digit_0") -> bytes:
    """A shard of sample ``a`` (``png``, ``label``) and sample ``b`` whose header lies
    (``lie``: ``pax:<size>`` or ``base256:<size>``, see :data:`CASES`)."""
    kind, _, value = lie.partition(":")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("a.png", png), ("a.cls", label), (MEMBER, png), ("b.cls", label)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if name == MEMBER and kind == "pax":
                info.pax_headers = {"size": "9" * len(value)}  # a placeholder of the same length
            tar.addfile(info, io.BytesIO(data))
    raw = bytearray(buffer.getvalue())
    if kind == "pax":
        placeholder = b"size=" + b"9" * len(value)
        assert raw.count(placeholder) == 1
        at = raw.index(placeholder)
        raw[at : at + len(placeholder)] = b"size=" + value.encode()  # the record's length holds
        return bytes(raw)
    # base256: the member's own size field, two's complement after a 0xff lead byte, and the
    # header's checksum made right again (as a hand-written header would be).
    at = _header_of(bytes(raw), MEMBER)
    raw[at + 124 : at + 136] = b"\xff" + int(value).to_bytes(11, "big", signed=True)
    raw[at + 148 : at + 156] = b" " * 8
    raw[at + 148 : at + 156] = b"%06o\0 " % sum(raw[at : at + 512])
    return bytes(raw)


def _header_of(raw: bytes, name: str) -> int:
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        return next(m.offset for m in tar.getmembers() if m.name == name)
