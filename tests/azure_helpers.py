"""The fake Azure account for contract tests: Batch, Files and ACR fakes behind the real SDKs,
Blob in Azurite, and configs for the Azure target that point at them."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from backends.azure.clients import Route, route_through
from backends.blob import container_client
from flows.config import BlobLocation, PipelineConfig, load_config
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
    services = {
        fakes.batch.host: fakes.batch,
        fakes.files.host: fakes.files,
        ARM_HOST: fakes.acr.arm,
        fakes.acr.registry_host: fakes.acr.registry,
    }
    route = Route(transport_factory(services), FakeCredential(), f"https://{ARM_HOST}")
    with route_through(route):
        yield fakes


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
