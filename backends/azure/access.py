"""How Batch nodes reach Blob storage: the pool's managed identity, or short-lived SAS tokens.

With an identity configured, nothing secret leaves the orchestrator: resource and output files
carry an identity reference and the staging task authenticates as that identity. Without one,
each task gets its own SAS per container, with the least permissions its use needs (read and list
on the training data; create and write on the outputs), signed when the task is submitted and
valid for as long as that task can live: every attempt Batch may make at its maximum run time,
plus the time it may wait for nodes. A token signed once per run would expire under a long or
retried task, and its last outputs (the model) would silently not be uploaded: Batch does not
retry an upload. A SAS travels only in request bodies and task environment settings, never in a
command line, and ``redact`` removes signatures from anything shown to a user.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from backends.taskspec import TaskSpec
from core.config import PipelineConfig

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient

SIGNATURE = re.compile(r"([?&]sig=)[^&\s\"']+", re.IGNORECASE)
CLOCK_SKEW = timedelta(minutes=5)  # between us and Storage, on both ends of a token
# A task's SAS permissions, the least its use needs: read the training data; write the outputs
# (read and list too, for a retry that finds what an earlier attempt uploaded).
DATA_PERMISSIONS = ("read", "list")
OUTPUT_PERMISSIONS = ("read", "list", "create", "write")


def redact(text: str) -> str:
    return SIGNATURE.sub(r"\1REDACTED", text)


class AccessError(ValueError):
    """A task could outlive the longest token the config allows; the message names the fields."""


def task_lifetime(config: PipelineConfig, spec: TaskSpec) -> timedelta:
    """The longest a submitted task can take: every attempt at its maximum run time, plus the
    time its nodes may take to come (the pool's start timeout). The orchestrator gives up on the
    task at this deadline, so nothing it left running needs a token for longer."""
    attempts = spec.max_retries + 1
    return timedelta(
        seconds=attempts * spec.max_wall_clock_seconds + 60 * config.pool.start_timeout_minutes
    )


@dataclass(frozen=True)
class NodeAccess:
    """What one task's requests need to let its nodes read data and write outputs."""

    data_url: str  # container URL, with a read/list SAS unless identity is set
    output_url: str  # container URL, with a create/write/read/list SAS unless identity is set
    identity: str | None = None  # ARM id of the pool's user-assigned identity
    identity_client_id: str | None = None

    def blob_url(self, blob: str) -> str:
        """A blob in the output container, readable with the same token as its container."""
        base, _, query = self.output_url.partition("?")
        return f"{base}/{blob}" + (f"?{query}" if query else "")


def _container_sas(
    container: ContainerClient, start: datetime, expiry: datetime, **permissions: bool
) -> str:
    from azure.storage.blob import (
        BlobServiceClient,
        ContainerSasPermissions,
        generate_container_sas,
    )

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
    # The account's service endpoint (path-style on an emulator: host, port and account).
    account = f"{container.scheme}://{container.primary_hostname}"
    with BlobServiceClient(account, credential, api_version=container.api_version) as service:
        delegation = service.get_user_delegation_key(start, expiry)
    return generate_container_sas(user_delegation_key=delegation, **common)


class AccessIssuer:
    """Issues each task's ``NodeAccess``: identity references, or SAS tokens signed for that
    task's lifetime."""

    def __init__(
        self,
        config: PipelineConfig,
        data: ContainerClient | None = None,
        outputs: ContainerClient | None = None,
    ) -> None:
        self.config, self.data, self.outputs = config, data, outputs
        self.identity = config.azure.identity_resource_id
        self.identity_client_id = config.azure.identity_client_id

    def lifetime(self, spec: TaskSpec) -> timedelta:
        """The token lifetime ``spec`` needs, refused when it exceeds ``azure.sas_hours``."""
        needed = task_lifetime(self.config, spec) + CLOCK_SKEW
        cap = timedelta(hours=self.config.azure.sas_hours)
        if not self.identity and needed > cap:
            raise AccessError(
                f"task {spec.id} may run for {needed.total_seconds() / 3600:.1f} h "
                f"({spec.max_retries + 1} attempts x {spec.max_wall_clock_seconds / 3600:g} h + "
                f"pool.start_timeout_minutes), longer than azure.sas_hours="
                f"{self.config.azure.sas_hours:g} allows for its SAS token: lower the attempts "
                "(retries.*) or use a pool identity (azure.identity_resource_id)"
            )
        return needed

    def for_task(self, spec: TaskSpec) -> NodeAccess:
        if self.identity:
            return self._by_identity(
                self.data.url if self.data else "", self.outputs.url if self.outputs else ""
            )
        if self.data is None or self.outputs is None:
            raise RuntimeError("an AccessIssuer without containers can only describe access")
        start = datetime.now(UTC) - CLOCK_SKEW
        expiry = datetime.now(UTC) + self.lifetime(spec)
        read = _container_sas(self.data, start, expiry, **dict.fromkeys(DATA_PERMISSIONS, True))
        write = _container_sas(
            self.outputs, start, expiry, **dict.fromkeys(OUTPUT_PERMISSIONS, True)
        )
        return NodeAccess(f"{self.data.url}?{read}", f"{self.outputs.url}?{write}")

    def describe(self, spec: TaskSpec, data_url: str, output_url: str) -> NodeAccess:
        """What ``for_task`` would issue for ``spec``, its tokens described, not signed (each is
        signed at submission for the task's own lifetime): what ``--plan`` shows."""
        if self.identity:
            return self._by_identity(data_url, output_url)
        hours = self.lifetime(spec).total_seconds() / 3600
        expires = f"expires {hours:.1f} h after submission"
        return NodeAccess(
            f"{data_url}?<SAS {','.join(DATA_PERMISSIONS)}; {expires}>",
            f"{output_url}?<SAS {','.join(OUTPUT_PERMISSIONS)}; {expires}>",
        )

    def _by_identity(self, data_url: str, output_url: str) -> NodeAccess:
        return NodeAccess(data_url, output_url, self.identity, self.identity_client_id)
