"""Blob storage clients, built from a config without a secret ever passing through parameters.

Order of preference: a connection string named by an environment variable (Azurite, or an
explicit key the user chose), a prefect-azure credentials block, then DefaultAzureCredential
(managed identity on a Batch node or worker VM, ``az login`` on a laptop).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from flows.config import BlobLocation

if TYPE_CHECKING:
    from azure.storage.blob import BlobServiceClient, ContainerClient

# Azurite rejects the newest service version the SDK speaks; this one both accept, and real
# Azure accepts it too, so one client works against both.
API_VERSION = "2025-01-05"


class StorageConfigError(ValueError):
    """No usable credentials for a Blob location; the message names the config field."""


def _retry_kwargs(retries: int) -> dict[str, Any]:
    return {"retry_total": retries, "retry_backoff_factor": 0.5, "retry_backoff_max": 8}


def service_client(location: BlobLocation, retries: int = 3) -> BlobServiceClient:
    from azure.storage.blob import BlobServiceClient

    kwargs = {"api_version": API_VERSION, **_retry_kwargs(retries)}
    if location.connection_string_env and os.environ.get(location.connection_string_env):
        return BlobServiceClient.from_connection_string(
            os.environ[location.connection_string_env], **kwargs
        )
    if location.credentials_block:
        from prefect_azure import AzureBlobStorageCredentials

        block = AzureBlobStorageCredentials.load(location.credentials_block)
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


def container_client(location: BlobLocation, retries: int = 3, create: bool = False) -> ContainerClient:
    client = service_client(location, retries).get_container_client(location.container)
    if create and not client.exists():
        from azure.core.exceptions import ResourceExistsError

        try:
            client.create_container()
        except ResourceExistsError:
            pass  # created concurrently: fine
    return client


def join(prefix: str, name: str) -> str:
    return f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name
