"""Blob writes that land only on the state their writer listed.

Each write is conditional: a new blob is created only where none is (If-None-Match: *), a
listed one is replaced or deleted only while its ETag is the listed one (If-Match), and a copy
reads its source only at the source's listed ETag. So two writers that race never overwrite
each other unseen: the second gets :class:`Conflict`, the one exception callers above
``backends/`` see (no storage SDK exception leaves this module).

A refused write whose blob already holds exactly the bytes it meant to write (same size and
Content-MD5) counts as done: that is the SDK retrying a write whose answer was lost, or another
writer that wrote the same content. Listing is ``staging.blob.list_pinned`` (paged, each blob
with its ETag, size and MD5).
"""

from __future__ import annotations

import time
from typing import IO, TYPE_CHECKING, Any

from staging.blob import list_pinned
from staging.listing import PinnedBlob

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

COPY_WAIT_SECONDS = 1800.0  # the longest a server-side copy may stay pending


class Conflict(RuntimeError):
    """A conditional write or delete was refused: the blob is no longer as its writer listed
    it (created, replaced or deleted meanwhile by someone else). ``name``: the blob."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name}: {why}")
        self.name = name


class CopyUnavailable(RuntimeError):
    """A server-side copy could not be made from its source (gone, changed since it was
    listed, or the copy failed): the caller sends the bytes instead, over ``etag``, the ETag
    the destination has now (a failed copy leaves a blob; None: still none)."""

    def __init__(self, why: str, etag: str | None) -> None:
        super().__init__(why)
        self.etag = etag


def listed(container: ContainerClient, prefix: str) -> dict[str, PinnedBlob]:
    """The blobs below ``prefix`` by name, each with its ETag, size and MD5."""
    return {b.name: b for b in list_pinned(container, prefix)}


def properties(container: ContainerClient, name: str) -> PinnedBlob | None:
    """One blob's ETag, size and MD5 as they are now; None when it does not exist."""
    from azure.core.exceptions import ResourceNotFoundError

    from staging.listing import pin

    try:
        props = container.get_blob_client(name).get_blob_properties()
    except ResourceNotFoundError:
        return None
    return pin(props)


def _conditions(etag: str | None) -> dict[str, Any]:
    """If-None-Match: * for a blob listed as absent; If-Match its ETag for a listed one."""
    from azure.core import MatchConditions

    if etag is None:
        return {"match_condition": MatchConditions.IfMissing}
    return {"etag": etag, "match_condition": MatchConditions.IfNotModified}


def _refused(container: ContainerClient, name: str, size: int, md5: str) -> None:
    """After a refused write: done when the blob holds these bytes already, else Conflict."""
    now = properties(container, name)
    if now is not None and (now.size, now.md5) == (size, md5):
        return
    why = "deleted" if now is None else "written by someone else"
    raise Conflict(name, f"{why} since it was listed")


def put(
    container: ContainerClient,
    name: str,
    data: IO[bytes] | bytes,
    size: int,
    md5: str,
    content_type: str,
    etag: str | None,
    concurrency: int = 1,
) -> None:
    """Write ``data`` (``size`` bytes, ``md5`` in base64) as ``name``: created where the
    listing had no blob (``etag`` None), else replacing the listed ``etag``. Each request's
    body is checked by the service (``validate_content``) and the MD5 is stored."""
    import base64

    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError
    from azure.storage.blob import ContentSettings

    settings = ContentSettings(
        content_type=content_type, content_md5=bytearray(base64.b64decode(md5))
    )
    try:
        container.upload_blob(
            name,
            data,
            length=size,
            overwrite=etag is not None,
            validate_content=True,
            max_concurrency=concurrency,
            content_settings=settings,
            **_conditions(etag),
        )
    except (ResourceExistsError, ResourceModifiedError):
        _refused(container, name, size, md5)


def copy(container: ContainerClient, name: str, source: PinnedBlob, etag: str | None) -> None:
    """``source`` (a blob of the same account, at its listed ETag) copied to ``name`` by the
    service, its Content-MD5 and content type with it, no byte through this machine; created
    or replacing ``etag`` as :func:`put`. Returns once the copy is done. CopyUnavailable when
    the source cannot be copied as listed."""
    from azure.core import MatchConditions
    from azure.core.exceptions import (
        HttpResponseError,
        ResourceExistsError,
        ResourceModifiedError,
        ResourceNotFoundError,
    )

    blob = container.get_blob_client(name)
    source_url = container.get_blob_client(source.name).url
    try:
        started = blob.start_copy_from_url(
            source_url,
            source_etag=source.etag,
            source_match_condition=MatchConditions.IfNotModified,
            **_conditions(etag),
        )
    except (ResourceExistsError, ResourceModifiedError) as exc:
        if getattr(exc, "error_code", None) == "SourceConditionNotMet":
            raise CopyUnavailable(f"{source.name} changed since it was listed", etag) from None
        _refused(container, name, source.size, source.md5 or "")
        _wait_for_copy(container, name)
        return
    except ResourceNotFoundError:
        raise CopyUnavailable(f"{source.name} is gone", etag) from None
    except HttpResponseError as exc:
        code = getattr(exc, "error_code", None)
        if code in ("CannotVerifyCopySource", "SourceConditionNotMet"):
            raise CopyUnavailable(f"{source.name}: {code}", etag) from None
        raise
    if started.get("copy_status") != "success":
        _wait_for_copy(container, name)


def _wait_for_copy(container: ContainerClient, name: str) -> None:
    """Until the copy into ``name`` is no longer pending; CopyUnavailable when it failed."""
    blob = container.get_blob_client(name)
    deadline = time.monotonic() + COPY_WAIT_SECONDS
    wait = 0.2
    while True:
        props = blob.get_blob_properties()
        status = props.copy.status
        if status in (None, "success"):
            return
        if status != "pending":
            break
        if time.monotonic() > deadline:
            blob.abort_copy(props)
            break
        time.sleep(wait)
        wait = min(wait * 2, 5.0)
    etag = str(blob.get_blob_properties().etag)
    raise CopyUnavailable(f"the copy into {name} ended {status}", etag)


def delete(container: ContainerClient, name: str, etag: str) -> None:
    """Delete ``name`` only while its ETag is the listed ``etag``; gone already is done."""
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

    try:
        container.delete_blob(name, etag=etag, match_condition=MatchConditions.IfNotModified)
    except ResourceNotFoundError:
        return
    except ResourceModifiedError:
        raise Conflict(name, "written by someone else since it was listed") from None
