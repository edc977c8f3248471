"""``PipelineConfig``: the one description of a retrain run, and the flow's parameter type.

Loaded from YAML (``configs/*.yaml``), overridable with ``--set section.field=value``. Being a
pydantic model, it is validated at load with messages that name the field, and the Prefect UI
renders it as a form. It never holds a secret: credentials are referred to by the name of an
environment variable or a Prefect block, and resolved inside the tasks that need them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_CONTAINER = re.compile(r"^[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]$")
_POOL_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")  # Batch REST spec, Pool.id


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _container_name(value: str) -> str:
    if not _CONTAINER.match(value):
        raise ValueError(
            f"{value!r} is not a valid container name (3-63 lowercase letters, digits, hyphens)"
        )
    return value


class BlobLocation(_Section):
    """A place in Blob storage (Azurite on the local target), and how to authenticate to it."""

    account_url: str | None = Field(
        None,
        description="https://<account>.blob.core.windows.net; with no connection string, "
        "DefaultAzureCredential (managed identity, az login) is used",
    )
    connection_string_env: str | None = Field(
        "AZURE_STORAGE_CONNECTION_STRING",
        description="name of the environment variable holding a connection string (never the "
        "string itself)",
    )
    credentials_block: str | None = Field(
        None, description="name of a prefect-azure AzureBlobStorageCredentials block"
    )
    container: str
    prefix: str = ""

    @field_validator("container")
    @classmethod
    def _container(cls, value: str) -> str:
        return _container_name(value)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        value = value.strip("/")
        if ".." in value.split("/") or "\\" in value:
            raise ValueError(f"{value!r} must not contain '..' segments or backslashes")
        return value


class ShareConfig(_Section):
    """Where the training scripts go: an Azure Files share, or a directory standing in for it."""

    name: str = "retrain-scripts"
    account_url: str | None = Field(
        None, description="https://<account>.file.core.windows.net (Entra ID, backup intent)"
    )
    account_key_secret: str | None = Field(
        None,
        description="name of a Prefect Secret block with the storage account key; Batch needs "
        "it to mount the share on the nodes (an SMB mount cannot use an identity)",
    )
    local_dir: Path = Path(".work/share")


class NfsConfig(_Section):
    """The shared data and checkpoint storage the nodes mount."""

    local_dir: Path = Path(".work/nfs")
    source: str | None = Field(
        None, description="the NFS export the Batch nodes mount, e.g. 10.0.0.4:/export/retrain"
    )
    mount_options: str = "-o vers=4.1,hard,nconnect=8"
    shards: bool = Field(
        True,
        description="after staging, pack image folders into memory-mapped shards at the "
        "model's input size, which the trainer reads instead of the loose files",
    )


class ImageConfig(_Section):
    builder: Literal["none", "acr", "docker"] = "none"
    registry: str | None = Field(None, description="<registry>.azurecr.io")
    repository: str = "retrain/horovod"
    registry_username: str | None = Field(
        None, description="a pull-only ACR token name; omit to pull with the pool's identity"
    )
    registry_password_secret: str | None = Field(
        None, description="name of a Prefect Secret block with that token's password"
    )


class PoolConfig(_Section):
    id: str = Field(
        "retrain-pool", description="the Batch pool id: letters, digits, '-' and '_', at most 64"
    )
    vm_size: str = "local"
    dedicated_nodes: int = Field(1, ge=0)
    low_priority_nodes: int = Field(0, ge=0)
    processes_per_node: int = Field(2, ge=1, description="GPUs per node on Azure")
    release: Literal["resize_to_zero", "delete"] = "resize_to_zero"
    image_publisher: str = "microsoft-dsvm"
    image_offer: str = "ubuntu-hpc"
    image_sku: str = "2204"
    node_agent_sku_id: str = "batch.node.ubuntu 22.04"
    subnet_id: str | None = Field(
        None, description="a subnet that can reach the NFS server (ARM resource id)"
    )
    autoscale_formula: str | None = Field(
        None, description="Batch autoscale formula; replaces the fixed node counts"
    )
    infiniband: Literal["auto", "on", "off"] = Field(
        "auto", description="NCCL over InfiniBand: auto means by the VM size (H-, ND-series)"
    )
    start_timeout_minutes: int = Field(30, ge=1, description="how long nodes may take to start")

    @property
    def nodes(self) -> int:
        return self.dedicated_nodes + self.low_priority_nodes

    @field_validator("id")
    @classmethod
    def _pool_id(cls, value: str) -> str:
        """Batch's own rule for ids; the id also names the local pool's folder, so nothing else
        (a '/', a '..') may reach a path."""
        if not _POOL_ID.match(value):
            raise ValueError(
                f"{value!r} is not a valid pool id (1-64 letters, digits, '-' and '_', as Batch "
                "requires)"
            )
        return value

    @model_validator(mode="after")
    def _some_nodes(self) -> PoolConfig:
        if self.nodes < 1:
            raise ValueError("dedicated_nodes + low_priority_nodes must be at least 1")
        return self


class TrainingConfig(_Section):
    """The trainer's own arguments (see ``python -m training.train --help``)."""

    epochs: int = Field(5, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(0.05, gt=0)
    model: Literal["cnn", "resnet18", "resnet50"] = "cnn"
    image_size: int | None = Field(
        None, ge=8, description="input size in pixels; default the model's own"
    )
    seed: int = 0
    timeline: bool = True
    extra_args: list[str] = Field(default_factory=list)


class RetryConfig(_Section):
    training_attempts: int = Field(3, ge=1, description="attempts of the training job")
    storage_retries: int = Field(3, ge=0)
    backoff_seconds: float = Field(2.0, ge=0)


class PromotionConfig(_Section):
    metric: Literal["accuracy"] = "accuracy"
    min_improvement: float = Field(0.0, ge=0, description="challenger must beat the champion by")


class ValidationConfig(_Section):
    min_images_per_class: int = Field(5, ge=1)
    min_side: int = Field(8, ge=1)
    max_side: int = Field(4096, ge=1)


class AzureConfig(_Section):
    """The Azure account resources; unused on the local target."""

    batch_account_url: str | None = Field(
        None, description="https://<account>.<region>.batch.azure.com"
    )
    batch_key_secret: str | None = Field(
        None,
        description="name of a Prefect Secret block with the Batch account key; without "
        "it, Entra ID (DefaultAzureCredential) is used",
    )
    subscription_id: str | None = None
    resource_group: str | None = Field(None, description="of the container registry")
    identity_resource_id: str | None = Field(
        None,
        description="user-assigned identity the pool's nodes use for Blob and ACR instead of "
        "SAS tokens and registry passwords (the pool must be created with it through ARM)",
    )
    identity_client_id: str | None = Field(
        None, description="that identity's client id, for DefaultAzureCredential on the nodes"
    )
    sas_hours: float = Field(
        12, gt=0, le=168, description="lifetime of SAS tokens given to the nodes"
    )


class PipelineConfig(_Section):
    """Everything one retrain run needs. Sections mirror the steps of the flow."""

    target: Literal["local", "azure"] = "local"
    data: BlobLocation
    share: ShareConfig = Field(default_factory=ShareConfig)
    nfs: NfsConfig = Field(default_factory=NfsConfig)
    image: ImageConfig = Field(default_factory=ImageConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    retries: RetryConfig = Field(default_factory=RetryConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    output: BlobLocation
    azure: AzureConfig = Field(default_factory=AzureConfig)
    work_dir: Path = Field(Path(".work"), description="local state: run folders, logs")

    @model_validator(mode="after")
    def _azure_complete(self) -> PipelineConfig:
        """A run on Azure that lacks a resource fails at load, before anything is created."""
        if self.target != "azure":
            return self
        needed = {
            "azure.batch_account_url": self.azure.batch_account_url,
            "share.account_url": self.share.account_url,
            "nfs.source": self.nfs.source,
            "share.account_key_secret": self.share.account_key_secret,  # for the SMB mount
            "image.registry": self.image.registry,
            "data.account_url": self.data.account_url or self.data.connection_string_env,
            "output.account_url": self.output.account_url or self.output.connection_string_env,
        }
        if self.image.builder == "acr":
            needed["azure.subscription_id"] = self.azure.subscription_id
            needed["azure.resource_group"] = self.azure.resource_group
        missing = [name for name, value in needed.items() if not value]
        if missing:
            raise ValueError(f"target azure needs {', '.join(missing)}")
        if self.image.registry_username and not self.image.registry_password_secret:
            raise ValueError("image.registry_username needs image.registry_password_secret")
        return self


class ConfigError(ValueError):
    """A config file or override is unusable; the message names the file and field."""


def _set(tree: dict[str, Any], dotted: str) -> None:
    if "=" not in dotted:
        raise ConfigError(f"--set {dotted!r}: expected section.field=value")
    key, raw = dotted.split("=", 1)
    value = yaml.safe_load(raw) if raw else ""
    node = tree
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part} is not a section")
    node[leaf] = value


def _describe(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {field}: {err['msg']}")
    return "\n".join(lines)


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> PipelineConfig:
    """Read YAML, apply ``section.field=value`` overrides, validate; ConfigError names the field."""
    tree: dict[str, Any] = dict(base or {})
    source = "(parameters)"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        tree.update(loaded)
    for item in overrides or []:
        _set(tree, item)
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None
