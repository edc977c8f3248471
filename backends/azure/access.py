"""How Batch nodes reach Blob storage: the pool's managed identity, or short-lived SAS tokens.

With an identity configured, nothing secret leaves the orchestrator: resource and output files
carry an identity reference and the staging task authenticates as that identity. Without one,
each container gets a SAS with the least permissions its use needs (read and list on the
training data; create and write on the outputs) that expires after ``azure.sas_hours``. A SAS
travels only in request bodies and task environment settings, never in a command line, and
``redact`` removes signatures from anything shown to a user.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from flows.config import PipelineConfig

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

SIGNATURE = re.compile(r"([?&]sig=)[^&\s\"']+", re.IGNORECASE)


def redact(text: str) -> str:
    return SIGNATURE.sub(r"\1REDACTED", text)


@dataclass(frozen=True)
class NodeAccess:
    """What the task requests need to let nodes read data and write outputs."""

    data_url: str  # container URL, with a read/list SAS unless identity is set
    output_url: str  # container URL, with a create/write/read/list SAS unless identity is set
    identity: str | None = None  # ARM id of the pool's user-assigned identity
    identity_client_id: str | None = None

    def blob_url(self, blob: str) -> str:
        """A blob in the output container, readable with the same token as its container."""
        base, _, query = self.output_url.partition("?")
        return f"{base}/{blob}" + (f"?{query}" if query else "")


def _container_sas(container: ContainerClient, hours: float, **permissions: bool) -> str:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    start = datetime.now(UTC) - timedelta(minutes=5)  # clock skew between us and Storage
    expiry = datetime.now(UTC) + timedelta(hours=hours)
    credential: Any = container.credential
    key = getattr(credential, "account_key", None)
    common: dict[str, Any] = {
        "account_name": container.account_name,
        "container_name": container.container_name,
        "permission": ContainerSasPermissions(**permissions),
        "start": start,
        "expiry": expiry,
    }
    if container.url.startswith("https://"):
        common["protocol"] = "https"
    if key:
        return generate_container_sas(account_key=key, **common)
    # Entra ID: a user delegation key, itself valid only as long as the token it signs.
    service = container._get_blob_service_client()
    delegation = service.get_user_delegation_key(start, expiry)
    return generate_container_sas(user_delegation_key=delegation, **common)


def node_access(
    config: PipelineConfig, data: ContainerClient, outputs: ContainerClient
) -> NodeAccess:
    if config.azure.identity_resource_id:
        return NodeAccess(
            data.url,
            outputs.url,
            config.azure.identity_resource_id,
            config.azure.identity_client_id,
        )
    hours = config.azure.sas_hours
    read = _container_sas(data, hours, read=True, list=True)
    write = _container_sas(outputs, hours, read=True, list=True, create=True, write=True)
    return NodeAccess(f"{data.url}?{read}", f"{outputs.url}?{write}")
