"""Reading a registry record (a small JSON blob someone else may have written) without trusting
its size or its numbers.

Every record reader goes through here: the champion, the last run and each trained fingerprint,
each run's record and its promotion decision. A record is read with one ranged request of at
most its limit plus one byte, so a blob of 400 MB costs 8 MB of memory at most, not 400; an
empty blob, which answers a ranged read with 416 (InvalidRange), is an empty record (a damaged
one), not an error. A number in a record is an accuracy only when it is in [0, 1]: JSON has no
bound on integers, and a 400-digit one raised OverflowError wherever it met a float.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RecordBlob:
    """What a record blob holds: at most ``limit + 1`` of its bytes, and its ETag."""

    data: bytes
    etag: str
    limit: int

    @property
    def too_large(self) -> bool:
        return len(self.data) > self.limit


def read_record(container: Any, name: str, limit: int) -> RecordBlob | None:
    """The record ``name`` (None when it does not exist), read up to ``limit + 1`` bytes."""
    from azure.core.exceptions import HttpResponseError, ResourceNotFoundError

    try:
        download = container.download_blob(name, offset=0, length=limit + 1)
    except ResourceNotFoundError:
        return None
    except HttpResponseError as exc:
        if exc.status_code != 416:
            raise
        # A range of an empty blob is unsatisfiable: the blob is there, with no bytes.
        try:
            props = container.get_blob_client(name).get_blob_properties()
        except ResourceNotFoundError:
            return None
        if props.size:  # written again since: read what it holds now
            return read_record(container, name, limit)
        return RecordBlob(b"", str(props.etag), limit)
    return RecordBlob(download.readall(), str(download.properties.etag), limit)


MAX_NESTING = 64  # a record is a few levels deep; far below the parser's recursion limit
_BRACKETS = bytes(range(256)).translate(None, b'[]{}"\\')


def _nesting(data: bytes) -> int:
    """How deep ``data``'s arrays and objects nest, brackets inside strings aside: counted
    before parsing, since the parser recurses once a level and a recursion error deep in the
    stack can break whatever runs there (a finaliser, a hook) with it."""
    depth = deepest = 0
    in_string = escaped = False
    for c in data.translate(None, _BRACKETS):
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in b"]}":
            depth -= 1
    return deepest


def json_object(data: bytes, limit: int) -> dict[str, Any] | str:
    """``data`` as a JSON object, or why it is not one, in words a reader can act on: larger
    than ``limit``, empty, not JSON, nested too deep to read (a record nesting every earlier
    record inside it), or another JSON type."""
    if len(data) > limit:
        return f"larger than {limit} bytes"
    if not data.strip():
        return "empty"
    if _nesting(data) > MAX_NESTING:
        return "nested too deep to read"
    try:
        doc = json.loads(data)
    except RecursionError:
        return "nested too deep to read"
    except ValueError:  # UnicodeDecodeError included
        return "not JSON"
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    return doc


def fraction(value: Any) -> float | None:
    """``value`` as a float when it is a number in [0, 1] (an accuracy), else None. NaN, the
    infinities and integers too large for a float are none."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0 <= value <= 1 else None


def shown(value: Any) -> str:
    """A stored value as an error names it: short, whatever its size."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18:
        return f"an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
