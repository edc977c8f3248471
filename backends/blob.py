"""Blob storage clients, built from a config without a secret ever passing through parameters.

The node-side helpers (the service version, a folder's listing prefix) live in
``staging.blob``, which the staging task imports on Batch nodes; this module builds the
orchestrator's clients from a config.

Order of preference: a connection string named by an environment variable (Azurite, or an
explicit key the user chose), a prefect-azure credentials block, then DefaultAzureCredential
(managed identity on a Batch node or worker VM, ``az login`` on a laptop).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from core.links import blob_link
from staging.blob import API_VERSION, folder, hide_sas_in_http_logs

if TYPE_CHECKING:
    from azure.storage.blob import BlobServiceClient, ContainerClient

    from core.config import BlobLocation

POOL_SIZE = 32
CA_BUNDLE_VARS = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


class StorageConfigError(ValueError):
    """No usable credentials for a Blob location; the message names the config field."""


def _client_kwargs(retries: int) -> dict[str, Any]:
    """Retries with backoff, and a connection pool as large as the staging thread pool (the
    default of 10 makes urllib3 drop and reopen connections under parallel downloads)."""
    from urllib.request import getproxies

    import requests
    from azure.core.pipeline.transport import RequestsTransport
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    session = requests.Session()
    # Looking up proxy settings in the environment on every request costs about a tenth of a
    # small blob's download; look once, and keep requests' lookups only where one is set.
    session.trust_env = bool(getproxies()) or any(os.environ.get(v) for v in CA_BUNDLE_VARS)
    adapter = HTTPAdapter(
        pool_maxsize=POOL_SIZE,
        max_retries=Retry(total=False, redirect=False, raise_on_status=False),
    )
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return {
        "api_version": API_VERSION,
        # The storage SDK's own ExponentialRetry reads these (azure-core's retry_backoff_*
        # names are ignored by it): waits of about 1, 3, 5, 9 s (+-1 s jitter) instead of its
        # default 15, 18, 24 s, which turned one dropped connection into a 15 s stall.
        "retry_total": retries,
        "initial_backoff": 1,
        "increment_base": 2,
        "random_jitter_range": 1,
        "transport": RequestsTransport(session=session),
    }


def service_client(location: BlobLocation, retries: int = 3) -> BlobServiceClient:
    from azure.storage.blob import BlobServiceClient

    hide_sas_in_http_logs()
    kwargs = _client_kwargs(retries)
    if location.connection_string_env and os.environ.get(location.connection_string_env):
        return BlobServiceClient.from_connection_string(
            os.environ[location.connection_string_env], **kwargs
        )
    if location.credentials_block:
        from prefect_azure import AzureBlobStorageCredentials

        block = cast(Any, AzureBlobStorageCredentials.load(location.credentials_block))
        if block.connection_string is not None:
            return BlobServiceClient.from_connection_string(
                block.connection_string.get_secret_value(), **kwargs
            )
        if block.account_url:
            from azure.identity import DefaultAzureCredential

            return BlobServiceClient(block.account_url, DefaultAzureCredential(), **kwargs)
    if location.account_url:
        from azure.identity import DefaultAzureCredential

        return BlobServiceClient(location.account_url, DefaultAzureCredential(), **kwargs)
    raise StorageConfigError(
        f"no credentials for container {location.container!r}: set the environment variable "
        f"{location.connection_string_env or '(connection_string_env)'}, or "
        "credentials_block, or account_url (for DefaultAzureCredential)"
    )


def container_client(
    location: BlobLocation, retries: int = 3, create: bool = False
) -> ContainerClient:
    client = service_client(location, retries).get_container_client(location.container)
    if create and not client.exists():
        from azure.core.exceptions import ResourceExistsError

        with contextlib.suppress(ResourceExistsError):  # created concurrently: fine
            client.create_container()
    return client


def unreachable(location: BlobLocation, field: str) -> str | None:
    """Why ``location`` cannot be used, found in a second before a run starts anything (a
    Prefect server, a pool): credentials that do not resolve, or storage that does not answer
    (on the local target, Azurite not running). None when it answers; a missing container is
    not a problem here (the gate names a missing data container, outputs are created)."""
    from azure.core.exceptions import (
        ClientAuthenticationError,
        HttpResponseError,
        ResourceNotFoundError,
        ServiceRequestError,
    )

    try:
        client = container_client(location, retries=0)
    except StorageConfigError as exc:
        return f"{field}: {exc}"
    try:
        client.get_container_properties(timeout=10)
    except ResourceNotFoundError:
        return None
    except ServiceRequestError as exc:
        local = "127.0.0.1" in client.url or "localhost" in client.url
        hint = (
            "; on the local target, start Azurite first (`make demo` starts its own)"
            if local
            else ""
        )
        return (
            f"{field}: Blob storage at {blob_link(client)} does not answer "
            f"({type(exc).__name__}){hint}"
        )
    except (ClientAuthenticationError, HttpResponseError) as exc:
        code = getattr(exc, "error_code", None) or getattr(exc, "status_code", "")
        return f"{field}: Blob storage at {blob_link(client)} refused the credentials ({code})"
    return None


def join(prefix: str, name: str) -> str:
    return f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name


def upload_directory(
    container: ContainerClient, source: Path, prefix: str, workers: int = 1
) -> int:
    """Upload every file below ``source`` to ``prefix/<relative path>``; returns how many.

    Blobs whose stored MD5 already matches are left alone, so re-seeding a dataset keeps its
    ETags and downstream incremental syncs see nothing new. ``workers`` uploads run at once
    (per-request cost, not bandwidth, bounds a tree of small files).
    """
    from concurrent.futures import ThreadPoolExecutor

    from azure.storage.blob import ContentSettings

    existing = {
        b.name: b.content_settings.content_md5
        for b in container.list_blobs(name_starts_with=folder(prefix))
    }

    def upload(path: Path) -> bool:
        name = join(prefix, path.relative_to(source).as_posix())
        data = path.read_bytes()
        md5 = hashlib.md5(data, usedforsecurity=False).digest()
        stored = existing.get(name)
        if stored is not None and bytes(stored) == md5:
            return False
        container.upload_blob(
            name, data, overwrite=True, content_settings=ContentSettings(content_md5=bytearray(md5))
        )
        return True

    files = sorted(p for p in source.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return sum(pool.map(upload, files))
