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

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple
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


def data_container(url: str) -> ContainerClient:
    """The container at ``url``: with a SAS in the URL it is used as is; without one the
    node's managed identity (``AZURE_CLIENT_ID`` selects one) or any other credential
    ``DefaultAzureCredential`` finds authenticates."""
    from azure.storage.blob import ContainerClient

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


LIST_AT_ONCE = 8  # folders listed at once: under the SDK transport's 10 pooled connections
PAGE_SIZE = 5000  # List Blobs' most results per page
WALK_FOLDERS = 5000  # folders listed one by one at most; beyond, each subtree is listed flat


def list_pinned(container: ContainerClient, prefix: str) -> list[PinnedBlob]:
    """Every blob below ``prefix`` with its ETag, size and Content-MD5, as the data gate pins
    them, in name order; what ``container.list_blobs`` returns, at a fraction of its cost.

    Why not the SDK's iterator: it builds a model object per blob through its generic XML
    deserializer, about 1 ms of interpreter-locked CPU per blob, which is 20 minutes for a
    1.28 M-image dataset and most of a re-sync's time. Here each page goes through the SDK's
    own request pipeline (its authentication, retries and service version) and is read with
    the C XML parser, taking only the four fields staging needs.

    Why folder by folder, ``LIST_AT_ONCE`` at a time, as rclone lists: a flat listing is a
    chain of pages, each asked for with the marker the one before returned, so an
    ImageNet-sized container is 266 round trips one after another, and each page's parsing
    waits on the service's answers. Listed by folder (``delimiter=/``), the class folders'
    pages are asked for at once and parsed while others are on their way. Where that would
    multiply requests, a folder is listed flat instead: one holding more entries than a page
    (a folder per image, say), and any with subfolders once ``WALK_FOLDERS`` folders were
    seen; so a walk asks for at most about twice ``WALK_FOLDERS`` pages more than a flat
    listing, however the names nest.
    """
    return _Walk(container).run(folder(prefix) or "")


class _Folder(NamedTuple):
    """One folder's page (listed with ``delimiter=/``), or a whole subtree listed flat."""

    prefix: str
    blobs: list[PinnedBlob]
    subfolders: list[str]
    more: bool  # the folder holds more than one page: it is listed flat instead


class _Walk:
    """One listing, folder by folder: each finished folder page adds its blobs and hands its
    subfolders to the pool; the first error cancels what is queued and is raised."""

    def __init__(self, container: ContainerClient) -> None:
        base, _, sas = container.url.partition("?")
        self.container, self.base, self.sas = container, base, sas

    def run(self, start: str) -> list[PinnedBlob]:
        from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

        pinned: list[PinnedBlob] = []
        seen = 0  # folders found so far
        pool = ThreadPoolExecutor(LIST_AT_ONCE, thread_name_prefix="list")
        try:
            pending: set[Future[_Folder]] = {pool.submit(self.folder, start)}
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    page = future.result()
                    seen += len(page.subfolders)
                    if page.more or (page.subfolders and seen > WALK_FOLDERS):
                        pending.add(pool.submit(self.flat, page.prefix))
                        continue
                    pinned += page.blobs
                    pending |= {pool.submit(self.folder, sub) for sub in page.subfolders}
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        pinned.sort(key=lambda b: b.name)  # the service's order: UTF-8 bytes, as code points
        return pinned

    def folder(self, prefix: str) -> _Folder:
        """The blobs directly in folder ``prefix`` and its subfolders: one page."""
        root = self._page(prefix, delimiter=True)
        subfolders = [_name(p) for p in root.iterfind("Blobs/BlobPrefix")]
        return _Folder(prefix, _blobs(root), subfolders, bool(root.findtext("NextMarker")))

    def flat(self, prefix: str) -> _Folder:
        """Every blob whose name starts with ``prefix``, page after page."""
        pinned: list[PinnedBlob] = []
        marker = ""
        while True:
            root = self._page(prefix, marker=marker)
            pinned += _blobs(root)
            marker = root.findtext("NextMarker") or ""
            if not marker:
                return _Folder(prefix, pinned, [], False)

    def _page(self, prefix: str, marker: str = "", delimiter: bool = False) -> Any:
        from urllib.parse import quote
        from xml.etree import ElementTree

        query = f"restype=container&comp=list&maxresults={PAGE_SIZE}"
        if prefix:
            query += f"&prefix={quote(prefix, safe='')}"
        if delimiter:
            query += "&delimiter=%2F"
        if marker:
            query += f"&marker={quote(marker, safe='')}"
        url = f"{self.base}?{query}" + (f"&{self.sas}" if self.sas else "")
        return ElementTree.fromstring(_page(self.container, url))


def _name(element: Any) -> str:
    """A Blob's or BlobPrefix's name; names with characters XML cannot carry come encoded."""
    from urllib.parse import unquote

    name_el = element.find("Name")
    name = (name_el.text or "") if name_el is not None else ""
    return unquote(name) if name_el is not None and name_el.get("Encoded") == "true" else name


def _blobs(root: Any) -> list[PinnedBlob]:
    """The blobs of one List Blobs page, with the four fields staging needs."""
    pinned = []
    for blob in root.iterfind("Blobs/Blob"):
        props = blob.find("Properties")
        if blob.find("Name") is None or props is None:
            continue
        md5 = props.findtext("Content-MD5") or None
        size = int(props.findtext("Content-Length") or 0)
        pinned.append(PinnedBlob(_name(blob), props.findtext("Etag") or "", size, md5))
    return pinned


def _page(container: ContainerClient, url: str, attempts: int = 3) -> bytes:
    """One List Blobs page's body, through the SDK's pipeline (its authentication, retries
    and service version). Streamed: unstreamed, the pipeline parses every XML body into an
    element tree it never gives back, which doubled a listing's CPU. A body cut off on the way
    is asked for again, as the pipeline's own retries do for a body they read."""
    from urllib.parse import urlsplit

    from azure.core.exceptions import IncompleteReadError, ServiceResponseError
    from azure.core.rest import HttpRequest

    attempt = 0
    while True:
        request = HttpRequest("GET", url)
        request.headers["x-ms-version"] = API_VERSION
        response = container._client._send_request(request, stream=True)
        try:
            if response.status_code != 200:
                raise ValueError(
                    f"container {container.container_name!r}: listing "
                    f"{urlsplit(url).path} refused with HTTP {response.status_code}"
                )
            return response.read()
        except (IncompleteReadError, ServiceResponseError):
            attempt += 1
            if attempt >= attempts:
                raise
        finally:
            response.close()
        time.sleep(0.5 * attempt)  # as the pipeline's retries, a pause before the next try
