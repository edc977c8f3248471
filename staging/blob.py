"""Node-side Blob helpers: the service version both Azure and Azurite accept, the listing prefix
of a folder, and the clients staging reads with.

Staging reads through two clients of one container: the storage SDK's ``ContainerClient`` for
the listing (it carries each blob's Content-MD5, which staging verifies against) and an
``obstore`` store for the downloads (Rust's ``object_store``: the whole HTTP exchange runs
outside the interpreter lock, at a fraction of the SDK's CPU per request). The store is built
from the container client, so both see the same account, container and credential: a shared
key, a SAS (a SAS in the URL or an ``AzureSasCredential``), or a token credential such as a
managed identity. Nothing here logs or returns a credential.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from staging.listing import PinnedBlob

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient
    from obstore.store import AzureStore

# Azurite rejects the newest service version the SDK speaks; this one both accept, and real
# Azure accepts it too, so one client works against both.
API_VERSION = "2025-01-05"


def folder(prefix: str) -> str | None:
    """The ``name_starts_with`` that lists what lies below ``prefix`` (everything for "")."""
    return f"{prefix.strip('/')}/" if prefix.strip("/") else None


@dataclass(frozen=True)
class Retry:
    """How hard a download tries before the sync gives up on a blob.

    Each request is retried by the store (connection errors, resets, 5xx, throttling) with
    exponential backoff from ``first_wait`` up to ``max_wait``; a blob whose response broke off
    mid-body is fetched again, ``blob_attempts`` times in all. The defaults wait about 1, 2, 4,
    8 s: a dropped connection costs seconds, not the 15 s and more of the SDK's defaults.
    """

    request_retries: int = 4
    first_wait: float = 1.0
    max_wait: float = 10.0
    blob_attempts: int = 3
    give_up_after: float = 180.0  # seconds from a request's first try; a SAS must outlive it


# The query fields of a SAS: the signature, and what it signs.
SECRET = re.compile(r"(sig|se|sv|sp|skoid|sktid|skt|ske|sks|skv|spr|srt|ss|st|sr)=[^&\s\"']+")


def redact(text: str) -> str:
    """``text`` without SAS fields; only its first line (the store's messages go on with
    debugging detail of the request)."""
    return SECRET.sub(r"\1=REDACTED", text.strip().splitlines()[0] if text.strip() else "")


class _HideSas(logging.Filter):
    """Rewrites a record whose message holds SAS fields, every line of it, before any
    handler sees it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        hidden = SECRET.sub(r"\1=REDACTED", message)
        if hidden != message:
            record.msg, record.args = hidden, None
        return True


_HIDE_SAS = _HideSas()


def hide_sas_in_http_logs() -> None:
    """urllib3, under the storage SDK, logs each request line at DEBUG with its query: with
    a SAS (in a URL, or a connection string's SharedAccessSignature) that is the signature.
    The SDK's own logging policy redacts it; urllib3 does not. Called by whatever builds a
    storage client, so a user who turns DEBUG on for a run logs no signature."""
    logger = logging.getLogger("urllib3.connectionpool")
    if _HIDE_SAS not in logger.filters:
        logger.addFilter(_HIDE_SAS)


def data_container(url: str) -> ContainerClient:
    """The container at ``url``: with a SAS in the URL it is used as is; without one the
    node's managed identity (``AZURE_CLIENT_ID`` selects one) or any other credential
    ``DefaultAzureCredential`` finds authenticates."""
    from azure.storage.blob import ContainerClient

    hide_sas_in_http_logs()
    if "sig=" in url:
        return ContainerClient.from_container_url(url, api_version=API_VERSION)
    from azure.identity import DefaultAzureCredential

    return ContainerClient.from_container_url(
        url, credential=DefaultAzureCredential(), api_version=API_VERSION
    )


def object_store(container: ContainerClient, retry: Retry | None = None) -> AzureStore:
    """An obstore store for the same container and credential as ``container``."""
    from obstore.store import AzureStore

    retry = retry or Retry()
    scheme = str(container.scheme)
    config: dict[str, Any] = {
        "account_name": container.account_name,
        # scheme://host[:port][/account]: path-style for Azurite, the account's host on Azure.
        "endpoint": f"{scheme}://{container.primary_hostname}",
    }
    provider = None
    credential: Any = container.credential
    query = urlsplit(container.url).query
    if getattr(credential, "account_key", None):
        config["access_key"] = credential.account_key
    elif query and "sig=" in query:
        config["sas_key"] = query
    elif credential is not None and hasattr(credential, "signature"):  # AzureSasCredential
        config["sas_key"] = str(credential.signature).lstrip("?")
    elif credential is not None and hasattr(credential, "get_token"):
        from obstore.auth.azure import AzureCredentialProvider

        provider = AzureCredentialProvider(credential)
    else:
        raise ValueError(
            f"container {container.container_name!r}: no credential staging can use (a shared "
            "key, a SAS or a token credential)"
        )
    return AzureStore(
        container.container_name,
        config=config,  # type: ignore[arg-type]  # keys checked by the store, as it documents
        client_options={
            "allow_http": scheme == "http",
            "connect_timeout": timedelta(seconds=10),
            # A stalled body (no byte for a minute) fails the request instead of hanging it.
            "read_timeout": timedelta(seconds=60),
            "pool_max_idle_per_host": str(max(64, os.cpu_count() or 1)),
        },
        retry_config={
            "max_retries": retry.request_retries,
            "retry_timeout": timedelta(seconds=retry.give_up_after),
            "backoff": {
                "init_backoff": timedelta(seconds=retry.first_wait),
                "max_backoff": timedelta(seconds=retry.max_wait),
                "base": 2,
            },
        },
        credential_provider=provider,
    )


PAGE_SIZE = 5000  # List Blobs' most results per page
LIST_AHEAD = True  # ask for the next page before parsing this one (False: one after another)


def list_pinned(container: ContainerClient, prefix: str) -> list[PinnedBlob]:
    """Every blob below ``prefix`` with its ETag, size and Content-MD5, as the data gate pins
    them; what ``container.list_blobs`` returns, at a fraction of its cost.

    Why not the SDK's iterator: it builds a model object per blob through its generic XML
    deserializer, about 1 ms of interpreter-locked CPU per blob, which is 20 minutes for a
    1.28 M-image dataset and most of a re-sync's time. Here each page (5,000 blobs) is asked
    for through azure-core's public pipeline client with the container's own credential
    (:func:`_page_client`) and read for only the four fields staging needs
    (``staging.list_page``).

    Pages are a chain: each is asked for with the marker the one before ended with. The next
    page is asked for as soon as this one's marker is read from the end of its body, before
    the body is read, so reading it overlaps the service's answer instead of adding to it.
    Why not list folder by folder with a delimiter, several at once, as rclone does: that
    asks for a page per folder (2,002 for ImageNet's layout instead of 266), which, measured
    against a fixed delay per request, cost more than it overlapped wherever folders hold far
    fewer blobs than a page.
    """
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import quote

    from staging.list_page import next_marker

    client, base, sas = _page_client(container)
    query = f"restype=container&comp=list&maxresults={PAGE_SIZE}"
    if start := folder(prefix):
        query += f"&prefix={quote(start, safe='')}"

    def fetch(marker: str) -> bytes:
        url = f"{base}?{query}" + (f"&marker={quote(marker, safe='')}" if marker else "")
        return _page(client, container.container_name, url + (f"&{sas}" if sas else ""))

    pinned: list[PinnedBlob] = []
    with client, ThreadPoolExecutor(1, thread_name_prefix="list") as ahead:
        body = fetch("")
        while True:
            marker = next_marker(body)
            following = ahead.submit(fetch, marker) if marker and LIST_AHEAD else None
            pinned += _blobs(body)
            if not marker:
                return pinned
            body = following.result() if following else fetch(marker)


def _page_client(container: ContainerClient) -> tuple[Any, str, str]:
    """azure-core's pipeline client for the container's List Blobs pages, with its credential:
    (the client, the container's URL, a SAS query every request carries or ""). A shared key
    signs a short-lived SAS that may list only (``generate_container_sas``); a token credential
    signs each request (storage's scope); a SAS is carried as it is. The SAS never leaves
    this process: errors are redacted (:func:`_page`)."""
    from datetime import UTC, datetime

    from azure.core import PipelineClient
    from azure.core.pipeline.policies import (
        BearerTokenCredentialPolicy,
        HeadersPolicy,
        RetryPolicy,
    )
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    base, _, sas = container.url.partition("?")
    credential: Any = container.credential
    policies: list[Any] = [HeadersPolicy({"x-ms-version": API_VERSION}), RetryPolicy()]
    if getattr(credential, "account_key", None):
        sas = generate_container_sas(
            container.account_name or "",
            container.container_name,
            account_key=credential.account_key,
            permission=ContainerSasPermissions(list=True),
            expiry=datetime.now(UTC) + timedelta(hours=1),
        )
    elif credential is not None and hasattr(credential, "signature"):  # AzureSasCredential
        sas = str(credential.signature).lstrip("?")
    elif credential is not None and hasattr(credential, "get_token"):
        scope = "https://storage.azure.com/.default"
        policies.append(BearerTokenCredentialPolicy(credential, scope))
    elif not sas:
        raise ValueError(
            f"container {container.container_name!r}: no credential staging can list with (a "
            "shared key, a SAS or a token credential)"
        )
    return PipelineClient(base, policies=policies), base, sas


def _blobs(body: bytes) -> list[PinnedBlob]:
    """The blobs of one List Blobs page, with the four fields staging needs."""
    from staging.list_page import blobs

    with paused_gc():
        return blobs(body)


def _page(client: Any, container_name: str, url: str, attempts: int = 3) -> bytes:
    """One List Blobs page's body. Streamed: the body is read once, by the page's reader. A
    body cut off on the way is asked for again, as the pipeline's own retries do for a body
    they read. An error names the page's path, never its query (which may hold a SAS)."""
    from azure.core.exceptions import AzureError, IncompleteReadError, ServiceResponseError
    from azure.core.rest import HttpRequest

    path = urlsplit(url).path
    attempt = 0
    while True:
        try:
            response = client.send_request(HttpRequest("GET", url), stream=True)
        except AzureError as exc:
            raise ConnectionError(
                f"container {container_name!r}: listing {path} failed ({redact(str(exc))})"
            ) from None
        try:
            if response.status_code != 200:
                raise ValueError(
                    f"container {container_name!r}: listing {path} refused with HTTP "
                    f"{response.status_code}"
                )
            return response.read()
        except (IncompleteReadError, ServiceResponseError):
            attempt += 1
            if attempt >= attempts:
                raise ConnectionError(
                    f"container {container_name!r}: listing {path} was cut off {attempts} times"
                ) from None
        finally:
            response.close()
        time.sleep(0.5 * attempt)  # as the pipeline's retries, a pause before the next try


class GcPause:
    """A pause of the cyclic collector, which work that may take long (reading files) can
    step out of: ``with pause.resumed():`` runs it with the collector as the caller had it."""

    def __init__(self, paused: bool) -> None:
        self._paused = paused

    @contextmanager
    def resumed(self) -> Iterator[None]:
        if self._paused:
            gc.enable()
        try:
            yield
        finally:
            if self._paused:
                gc.disable()


@contextmanager
def paused_gc() -> Iterator[GcPause]:
    """The cyclic garbage collector paused through a burst of allocations that form no cycle.

    Why: a page of 5,000 blobs read by the XML parser becomes about 80,000 objects the
    collector tracks (the scanner makes about 10,000), which live until the page is read. Each
    time the survivors of younger collections outnumber a quarter of the process's long-lived
    objects, the collector walks every one of them; in a process that had imported Prefect and
    the bench (about 280,000 tracked objects) that took 145 ms of a page's 183 ms with the
    parser (bench/gate_scale.py measures a listing both ways). Nothing made here forms a cycle, so a
    pause leaves no garbage a collection would have freed; a collector a caller had paused
    stays paused. The pause is process-wide (other threads' cycles wait for it to end), so it
    is kept to CPU work: I/O steps out of it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield GcPause(was_enabled)
    finally:
        if was_enabled:
            gc.enable()
