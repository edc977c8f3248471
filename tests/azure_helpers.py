"""The fake Azure account for contract tests: Batch, Files and ACR fakes behind the real SDKs,
Blob in Azurite, and configs for the Azure target that point at them."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from backends.azure.clients import Route, route_through
from backends.blob import container_client
from core.config import BlobLocation, PipelineConfig, load_config
from tests.fakes.acr import ARM_HOST, FakeAcr
from tests.fakes.batch import FakeBatch
from tests.fakes.files import FakeFiles
from tests.fakes.transport import FakeCredential, transport_factory

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class FakeAzure:
    batch: FakeBatch
    files: FakeFiles
    acr: FakeAcr


@contextlib.contextmanager
def fake_azure() -> Iterator[FakeAzure]:
    """Every client ``backends.azure.clients`` builds goes to these fakes while this is open.

    Needs AZURE_STORAGE_CONNECTION_STRING to name Azurite (the ACR fake keeps contexts there).
    """
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    registry_store = container_client(
        BlobLocation(container=f"acr-{uuid.uuid4().hex[:12]}"), create=True
    )
    sas = generate_container_sas(
        registry_store.account_name,
        registry_store.container_name,
        account_key=registry_store.credential.account_key,
        permission=ContainerSasPermissions(read=True, write=True, create=True),
        expiry=datetime.now(UTC) + timedelta(hours=1),
    )
    fakes = FakeAzure(FakeBatch(), FakeFiles(), FakeAcr(registry_store, sas))
    fakes.batch.identity_upload = _identity_upload(registry_store.credential)
    services = {
        fakes.batch.host: fakes.batch,
        fakes.files.host: fakes.files,
        ARM_HOST: fakes.acr.arm,
        fakes.acr.registry_host: fakes.acr.registry,
    }
    route = Route(transport_factory(services), FakeCredential(), f"https://{ARM_HOST}")
    with route_through(route):
        yield fakes
    # Every request the suite sends must pass the spec check, unless a test sends bad ones on
    # purpose.
    refused = fakes.batch.refused
    assert fakes.batch.allow_refusals or not refused, f"Batch refused by the spec: {refused}"
    assert not fakes.acr.refused or fakes.acr.allow_refusals, f"ACR refused: {fakes.acr.refused}"


def _identity_upload(credential: Any) -> Any:
    """A node uploading as the pool's managed identity: the fake has no identity provider, so it
    writes with the storage account's own key (the identity's role assignment, in effect)."""

    def upload(url: str, data: bytes) -> None:
        from azure.storage.blob import BlobClient

        BlobClient.from_blob_url(url, credential=credential).upload_blob(data, overwrite=True)

    return upload


def azure_config(tmp_path: Path, *overrides: str) -> PipelineConfig:
    """configs/azure.example.yaml pointed at the fakes, with Blob on Azurite."""
    suffix = uuid.uuid4().hex[:10]
    return load_config(
        ROOT / "configs" / "azure.example.yaml",
        [
            "data.connection_string_env=AZURE_STORAGE_CONNECTION_STRING",
            "output.connection_string_env=AZURE_STORAGE_CONNECTION_STRING",
            f"data.container=data-{suffix}",
            f"output.container=out-{suffix}",
            "data.prefix=digits",
            f"share.account_url=https://{FakeFiles.host}",
            f"share.name=scripts-{suffix}",
            f"azure.batch_account_url=https://{FakeBatch.host}",
            "azure.subscription_id=00000000-0000-0000-0000-000000000001",
            "azure.resource_group=retrain-rg",
            f"image.registry={FakeAcr.registry_host}",
            f"pool.id=pool-{suffix}",
            f"work_dir={tmp_path / 'work'}",
            *overrides,
        ],
    )
