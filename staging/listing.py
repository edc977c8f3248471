"""The data gate's pinned listing: the exact blobs (names, ETags, sizes, MD5s) it validated.

Staging stages this listing and nothing else, so what is trained is what was validated: a blob
uploaded after the gate is not staged, and one changed since is detected by its ETag. The gate
writes the listing into the run's output prefix; the local staging step reads it from there,
and on Azure the staging task gets it as a resource file (a blob URL, never a command-line
value). Kept free of heavy imports: the gate, the orchestrator and the node all read it.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

LISTING = "data-listing.json"  # in the run's output prefix
LISTING_FORMAT = 1


class ListingError(ValueError):
    """A pinned listing is unusable (not the gate's, or for another prefix); names the entry."""


class ChangedSinceGateError(RuntimeError):
    """A blob of the pinned listing changed or vanished after the data gate validated it."""


@dataclass(frozen=True)
class PinnedBlob:
    """One blob as the data gate saw it: what staging must fetch, and at which version."""

    name: str
    etag: str
    size: int
    md5: str | None  # base64, as the service stores it; None when it stores none


def pin(blob: Any) -> PinnedBlob:
    """The pinned form of a blob from a container listing (``BlobProperties``)."""
    stored = blob.content_settings.content_md5 if blob.content_settings else None
    md5 = base64.b64encode(bytes(stored)).decode() if stored else None
    return PinnedBlob(str(blob.name), str(blob.etag), int(blob.size), md5)


def listing_blob(output_prefix: str) -> str:
    """Where a run's pinned listing lives in the output container."""
    return f"{output_prefix}/{LISTING}"


def listing_json(prefix: str, blobs: Iterable[PinnedBlob]) -> bytes:
    entries = [asdict(b) for b in sorted(blobs, key=lambda b: b.name)]
    return json.dumps(
        {"format": LISTING_FORMAT, "prefix": prefix.strip("/"), "blobs": entries},
        separators=(",", ":"),
    ).encode()


def parse_listing(data: bytes, source: str, prefix: str) -> list[PinnedBlob]:
    """The blobs of a listing :func:`listing_json` wrote for ``prefix``; ListingError if not."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ListingError(f"pinned listing {source} is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != LISTING_FORMAT:
        raise ListingError(f"pinned listing {source} is not format {LISTING_FORMAT}")
    entries = doc.get("blobs")
    if not isinstance(entries, list):
        raise ListingError(f"pinned listing {source} lacks 'blobs'")
    if doc.get("prefix") != prefix.strip("/"):
        raise ListingError(
            f"pinned listing {source} is for prefix {doc.get('prefix')!r}, "
            f"not {prefix.strip('/')!r}"
        )
    blobs = []
    for i, e in enumerate(entries):
        ok = (
            isinstance(e, dict)
            and isinstance(e.get("name"), str)
            and isinstance(e.get("etag"), str)
            and type(e.get("size")) is int
            and e["size"] >= 0
            and (e.get("md5") is None or isinstance(e.get("md5"), str))
        )
        if not ok:
            raise ListingError(f"pinned listing {source}: entry {i} is not name/etag/size/md5")
        blobs.append(PinnedBlob(e["name"], e["etag"], e["size"], e.get("md5")))
    return blobs


def listing_version(blobs: Iterable[PinnedBlob]) -> str:
    """The data version the gate validated, known before anything is staged: a digest of each
    blob's name, size, ETag and content MD5. The ETag is in it because the MD5 alone proves
    nothing: Put Block List stores whatever Content-MD5 the writer sends, unchecked, so a blob
    rewritten with its old MD5 kept looked unchanged (the run ended up to date on old data).
    Every write of a blob gives it a new ETag, so a blob written again, even with the same
    bytes, is a new data version."""
    entries = sorted((b.name, b.size, b.etag, b.md5) for b in blobs)
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]
