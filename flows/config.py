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
    account_url: str | None = None
    local_dir: Path = Path(".work/share")


class NfsConfig(_Section):
    """The shared data and checkpoint storage the nodes mount."""

    local_dir: Path = Path(".work/nfs")
    mount_path: str = "/mnt/nfs"


class ImageConfig(_Section):
    builder: Literal["none", "acr", "docker"] = "none"
    registry: str | None = None
    repository: str = "retrain/horovod"


class PoolConfig(_Section):
    id: str = "retrain-pool"
    vm_size: str = "local"
    dedicated_nodes: int = Field(1, ge=0)
    low_priority_nodes: int = Field(0, ge=0)
    processes_per_node: int = Field(2, ge=1, description="GPUs per node on Azure")
    release: Literal["resize_to_zero", "delete"] = "resize_to_zero"

    @property
    def nodes(self) -> int:
        return self.dedicated_nodes + self.low_priority_nodes

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
    work_dir: Path = Field(Path(".work"), description="local state: run folders, logs")


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
