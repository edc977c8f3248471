"""``PipelineConfig``: the one description of a retrain run, and the flow's parameter type.

Loaded from YAML (``configs/*.yaml``), overridable with ``--set section.field=value``. Being a
pydantic model, it is validated at load with messages that name the field, and the Prefect UI
renders it as a form. It never holds a secret: credentials are referred to by the name of an
environment variable or a Prefect block, and resolved inside the tasks that need them.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints
from urllib.parse import SplitResult, urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.data_versions import DataRoot, check_version_name
from core.init_from import parse_init_from, url_location
from training.args import TrainingSettings, about, extra_option_owner, field_metadata
from training.preemption import AZURE_URL as SCHEDULED_EVENTS_URL

_CONTAINER = re.compile(r"^[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]$")
_POOL_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")  # Batch REST spec, Pool.id


class _Section(BaseModel):
    # Frozen: a run's steps all read the config the run was started with (a new value is a
    # new config, made with model_copy).
    model_config = ConfigDict(extra="forbid", frozen=True)


def _container_name(value: str) -> str:
    if not _CONTAINER.match(value):
        raise ValueError(
            f"{value!r} is not a valid container name (3-63 lowercase letters, digits, hyphens)"
        )
    return value


# A query (``?`` then anything with a ``=``), with or without a URL before it, and the secret
# fields of a connection string.
_QUERY = re.compile(r"\?(?=[^\s'\"]*=)[^\s'\"]*")
_CONNECTION_SECRET = re.compile(r"((?:AccountKey|SharedAccessSignature)=)[^;\s'\"]+", re.I)
_USER_INFO = re.compile(r"(://)[^/\s@]*@")


def hide_credentials(text: str) -> str:
    """``text`` with every query, a URL's user and password, and a connection string's key
    replaced: a SAS token pasted with a URL, or a connection string pasted for the name of its
    variable, travels there, and the text (an override, a run's source line, an error) is
    shown in logs and artifacts."""
    text = _USER_INFO.sub(r"\1REDACTED@", _QUERY.sub("?REDACTED", text))
    return _CONNECTION_SECRET.sub(r"\1REDACTED", text)


def _url_parts(value: str, what: str) -> SplitResult:
    """``value`` parsed as an http(s) URL with a host and nothing that could be a credential
    (user, password, query, fragment). The errors never repeat the query or the user part."""
    if any(c.isspace() or not c.isprintable() for c in value):
        # urlsplit drops tabs and newlines before it parses: what it checked would not be
        # what is used.
        raise ValueError(f"{what} must have no spaces or control characters")
    parts = urlsplit(value)
    shown = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"
    if parts.query or parts.fragment or "?" in value or "#" in value:
        raise ValueError(
            f"{shown}?...: {what} must have no query or fragment (a SAS token or key there "
            "would be stored with every run; credentials are named, never given)"
        )
    if parts.username or parts.password or "@" in parts.netloc:
        raise ValueError(f"{shown}: {what} must have no user or password")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{shown!r}: {what} must be an http(s) URL with a host name")
    try:
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError as exc:
        raise ValueError(f"{shown}: {exc}") from None
    return parts


def _account_url(value: str | None) -> str | None:
    """A service endpoint (a storage or Batch account): the URL alone."""
    if value is not None:
        _url_parts(value, "an account URL")
    return value


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,254}\Z")


def _env_name(value: str | None) -> str | None:
    """The name of an environment variable. A connection string pasted here would be stored
    with every run, so the error does not repeat the value."""
    if value is not None and not _ENV_NAME.match(value):
        raise ValueError(
            "must be the name of an environment variable (letters, digits and _, not starting "
            "with a digit), never the connection string itself"
        )
    return value


def check_prefix(value: str) -> str:
    """A prefix in a container, the leading and trailing ``/`` dropped: segments that are real
    folder names, no empty segment (``images//v1``: Blob storage keeps it, and staging refuses
    every blob under it after the pool is up), no ``.``/``..``, backslash or control character
    (a NUL or a newline reaches paths, logs and artifacts), at most 1024 characters (Azure's
    longest blob name)."""
    value = value.strip("/")
    if len(value) > 1024:
        raise ValueError("must be at most 1024 characters (Azure's longest blob name)")
    if any(not c.isprintable() for c in value):
        raise ValueError(f"{value!r} must have no control characters (NUL, newline, tab)")
    if "\\" in value:
        raise ValueError(f"{value!r} must not contain '..' segments or backslashes")
    segments = value.split("/") if value else []
    if ".." in segments:
        raise ValueError(f"{value!r} must not contain '..' segments or backslashes")
    if any(s in ("", ".") for s in segments):
        raise ValueError(f"{value!r} must have no empty or '.' segment (one '/' between folders)")
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
        return check_prefix(value)

    @field_validator("account_url")
    @classmethod
    def _account(cls, value: str | None) -> str | None:
        return _account_url(value)

    @field_validator("connection_string_env")
    @classmethod
    def _connection_env(cls, value: str | None) -> str | None:
        return _env_name(value)


class DataLocation(BlobLocation):
    """The data root, and which of its versions a run trains (``core.data_versions``)."""

    prefix: str = Field(
        "",
        description="the data root: each data version is a folder directly below it, complete "
        "once its _SUCCESS marker is written (write it last); a root with no versions is one "
        "dataset (train/, test/, optional val/ directly below it)",
    )
    version: str | None = Field(
        None,
        description="the data version to train, a folder directly below the prefix, e.g. v2; "
        "empty: the newest complete version (or the whole root when it holds no versions)",
    )

    @field_validator("version")
    @classmethod
    def _version(cls, value: str | None) -> str | None:
        if value is None or value.strip() == "":
            return None  # a trigger's empty template, or a cleared form field
        return check_version_name(value)

    @property
    def root(self) -> DataRoot:
        return DataRoot(self.container, self.prefix)

    @property
    def dataset(self) -> BlobLocation:
        """Where the files of ``version`` are (the root itself when it is None): what the gate
        lists and staging mirrors, once the run has chosen its version."""
        fields = self.model_dump(exclude={"version", "prefix"})
        return BlobLocation(**fields, prefix=self.root.folder(self.version))

    def pinned(self, version: str | None) -> DataLocation:
        """This location with the version a run chose (None: a root without versions)."""
        return self.model_copy(update={"version": version})


class OutputLocation(BlobLocation):
    """Where a run's outputs go, and the address people open them at."""

    links_url: str | None = Field(
        None,
        description="base URL of the outputs gateway (python -m cli.models serve): a run's "
        "links point there and open in a browser with no signature in them; unset, they point "
        "at Blob storage, which answers a browser 403 unless the container is public",
    )

    @field_validator("links_url")
    @classmethod
    def _links_url(cls, value: str | None) -> str | None:
        """Links are stored in artifacts: nothing that could be a credential goes in them. The
        gateway serves the outputs at its root, so a path would make every link a 404."""
        if value is None:
            return None
        parts = _url_parts(value.strip(), "links_url (e.g. http://127.0.0.1:4280)")
        if parts.path.strip("/"):
            raise ValueError(
                f"{parts.scheme}://{parts.netloc}{parts.path}: links_url must have no path "
                "(the gateway serves a run's outputs at its root; a reverse proxy in front of "
                "it needs a host name of its own)"
            )
        return value.strip().rstrip("/")


class ShareConfig(_Section):
    """Where the training scripts go: a Blob container or an Azure Files share the nodes
    mount, or a directory standing in for it."""

    name: str = "retrain-scripts"
    account_url: str | None = Field(
        None,
        description="https://<account>.blob.core.windows.net: the container `name`, mounted "
        "with blobfuse as the nodes' managed identity (no key); or "
        "https://<account>.file.core.windows.net: the Azure Files share `name` (SMB)",
    )
    account_key_secret: str | None = Field(
        None,
        description="an Azure Files share only: name of a Prefect Secret block with the storage "
        "account key; Batch needs it to mount the share on the nodes (an SMB mount cannot use an "
        "identity)",
    )
    local_dir: Path = Path(".work/share")

    @field_validator("account_url")
    @classmethod
    def _account(cls, value: str | None) -> str | None:
        return _account_url(value)

    @property
    def on_blob(self) -> bool:
        """Whether the scripts go to a Blob container (its endpoint's service label is
        ``blob``) rather than an Azure Files share."""
        host = urlsplit(self.account_url or "").hostname or ""
        return host.split(".")[1:2] == ["blob"]


class NfsConfig(_Section):
    """The shared data and checkpoint storage the nodes mount."""

    local_dir: Path = Path(".work/nfs")
    source: str | None = Field(
        None, description="the NFS export the Batch nodes mount, e.g. 10.0.0.4:/export/retrain"
    )
    mount_options: str = "-o vers=4.1,hard,nconnect=8"
    checkpoint_days: float = Field(
        7.0,
        ge=0,
        le=3650,
        allow_inf_nan=False,
        description="how long the checkpoints of a training that did not finish are kept under "
        "checkpoints/ for a re-run to resume (removed by the next training after that); those of "
        "a finished training go at the next training of other data, code or settings",
    )
    shards: bool = Field(
        True,
        description="after staging, pack image folders into memory-mapped shards at the "
        "model's input size, which the trainer reads instead of the loose files",
    )


class ImageConfig(_Section):
    builder: Literal["none", "buildah", "acr", "docker"] = Field(
        "none",
        description="who builds and pushes the training image: acr (ACR Tasks) or docker on "
        "Azure; buildah on the local target (the cpu variant, pushed to a registry on this "
        "machine); none uses the tag as it is",
    )
    registry: str | None = Field(
        None,
        description="<registry>.azurecr.io; on the local target a loopback host:port, where a "
        "registry is started when none listens",
    )
    repository: str = "retrain/horovod"
    registry_username: str | None = Field(
        None, description="a pull-only ACR token name; omit to pull with the pool's identity"
    )
    registry_password_secret: str | None = Field(
        None, description="name of a Prefect Secret block with that token's password"
    )

    @field_validator("registry")
    @classmethod
    def _registry(cls, value: str | None) -> str | None:
        """A login server, ``host`` or ``host:port``: nodes pull the image from it, so anything
        else (a scheme, a path, a user, a query with a token) is refused."""
        if value is not None and (
            not value or any(c.isspace() or not c.isprintable() or c in "/?#@\\" for c in value)
        ):
            raise ValueError(
                "must be a registry's host name, with a port if it needs one (e.g. "
                "myregistry.azurecr.io): no scheme, path, user or query"
            )
        return value


class SpotFallbackConfig(_Section):
    """When a run on Spot nodes moves to dedicated ones (backends/spot_fallback.py): the pool
    is resized to as many dedicated nodes as it had nodes in all, and no Spot node."""

    after_preemptions: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="move to dedicated nodes after this many preemptions of the run's Spot "
        "nodes; off when unset",
    )
    after_minutes_without_capacity: float | None = Field(
        None,
        gt=0,
        le=10080,
        allow_inf_nan=False,
        description="move to dedicated nodes once the run's task has waited this many minutes "
        "for Spot nodes that Azure does not give back; off when unset",
    )

    @property
    def enabled(self) -> bool:
        return self.after_preemptions is not None or self.after_minutes_without_capacity is not None


def _scheduled_events_url(value: str) -> str:
    """The instance metadata endpoint's Scheduled Events URL: http(s), a host, no credential;
    its one query is the API version."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username:
        raise ValueError(f"{value!r} is not an http(s) URL with a host and no user")
    if not re.fullmatch(r"api-version=[0-9]{4}-[0-9]{2}-[0-9]{2}", parts.query):
        raise ValueError(f"{value!r} must end in ?api-version=YYYY-MM-DD (Azure's: 2020-07-01)")
    return value


class PoolConfig(_Section):
    id: str = Field(
        "retrain-pool", description="the Batch pool id: letters, digits, '-' and '_', at most 64"
    )
    vm_size: str = "local"
    hourly_price: float = Field(
        0.0,
        ge=0,
        le=1000,
        allow_inf_nan=False,
        description="what one node of vm_size costs per hour (the Azure price list for your "
        "region and offer; the largest GPU sizes are well under 1000); each run's summary "
        "multiplies its node-minutes by it; 0 reports node-minutes only",
    )
    spot_hourly_price: float = Field(
        0.0,
        ge=0,
        le=1000,
        allow_inf_nan=False,
        description="what one Spot node of vm_size costs per hour; with hourly_price (the "
        "dedicated price), the summary compares what the run paid on Spot with the same "
        "node-minutes on dedicated nodes; 0 reports node-minutes only",
    )
    dedicated_nodes: int = Field(1, ge=0)
    low_priority_nodes: int = Field(
        0,
        ge=0,
        description="Spot nodes (Batch's targetLowPriorityNodes; needs a Batch account in "
        "user-subscription pool allocation mode); a preempted node requeues the whole "
        "multi-node task, which resumes from its last checkpoint",
    )
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
    network_interface: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,14}$",
        description="the interface the ranks of a multi-node job talk over (Horovod, Gloo, "
        "NCCL's bootstrap, OpenMPI); default ib0 where the VM size has InfiniBand, else eth0",
    )
    start_timeout_minutes: int = Field(
        30,
        ge=5,
        description="how long nodes may take to be allocated and start (Batch's resizeTimeout: "
        "at least 5 minutes); also the time a submitted task may wait for nodes before the run "
        "gives up on it",
    )
    recreate_on_change: bool = Field(
        True,
        description="an existing pool this pipeline created, whose container image, registry "
        "credentials or other settings Batch cannot change differ from this run's, is deleted "
        "and created again while it is idle; false refuses to use it instead",
    )
    nccl_topo_file: str | None = Field(
        "auto",
        description="the host's NCCL topology file mounted into the training container and "
        "named by NCCL_TOPO_FILE on InfiniBand sizes: auto picks the Azure HPC image's file for "
        "the ND size (/opt/microsoft/ndv4-topo.xml, ndv5-topo.xml); null mounts none",
    )
    os_disk_gb: int | None = Field(
        None,
        ge=30,
        description="OS disk size of each node in GB; Docker keeps images on it, and a CUDA "
        "training image needs tens of GB (default: the VM image's own size)",
    )

    spot_fallback: SpotFallbackConfig = Field(
        default_factory=SpotFallbackConfig,
        description="when a run on Spot nodes moves to dedicated ones (after N preemptions, or "
        "M minutes without Spot capacity)",
    )
    scheduled_events_url: str = Field(
        SCHEDULED_EVENTS_URL,
        description="where a node with Spot capacity reads Azure's Scheduled Events (the "
        "instance metadata service); a Preempt notice there makes the trainer checkpoint at "
        "once. Set only to point emulated nodes at a local endpoint",
    )

    @property
    def nodes(self) -> int:
        return self.dedicated_nodes + self.low_priority_nodes

    @field_validator("scheduled_events_url")
    @classmethod
    def _events_url(cls, value: str) -> str:
        return _scheduled_events_url(value)

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
        if self.spot_fallback.enabled and self.low_priority_nodes == 0:
            raise ValueError(
                "spot_fallback is set but the pool has no Spot nodes (low_priority_nodes is 0)"
            )
        if self.spot_fallback.enabled and self.autoscale_formula:
            raise ValueError(
                "spot_fallback resizes the pool, which Batch refuses while autoscale_formula "
                "sets its size: use one or the other"
            )
        return self


@dataclass
class TrainingConfig(TrainingSettings):
    """The trainer's arguments a run sets (see ``python -m training.train --help``), defined
    with their types, defaults, bounds and help in ``training.args``, which pydantic reads."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    # A run records a Horovod timeline unless told not to: it costs little next to a run, and
    # is the first thing to read when one is slow. The trainer alone writes one when asked.
    timeline: bool = field(default=True, metadata=field_metadata(TrainingSettings, "timeline"))
    init_from: str | None = field(
        default=None,
        metadata=about(
            "what training starts from: null (random weights), champion (the data root's "
            "champion; from scratch while there is none), nfs:<path> (a file below the NFS "
            "folder), output:<blob> or data:<blob> (a blob in the configured output or data "
            "container), or a URL into one of them; see docs/warm-start.md"
        ),
    )
    follow_champion: bool = field(
        default=False,
        metadata=about(
            "retrain the data root's champion: start from its weights and the training "
            "settings its run recorded (its recipe), except those the run's overrides and "
            "fields set; the nightly and on-new-data deployments set it (docs/warm-start.md)"
        ),
    )
    extra_args: list[str] = field(
        default_factory=list,
        metadata=about(
            "further trainer options, e.g. [--fp16-allreduce]; passed on as they are, each one "
            "quoted; not the data, output and checkpoint paths, nor a setting of this section"
        ),
    )

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, value: str | None) -> str | None:
        if value is None or value.strip() in ("", "null"):
            return None  # a cleared form field
        return str(parse_init_from(value))

    @field_validator("extra_args")
    @classmethod
    def _no_owned_options(cls, value: list[str]) -> list[str]:
        for word in value:
            owner = extra_option_owner(word)
            if owner == "the pipeline":
                raise ValueError(
                    f"{word.split('=', 1)[0]} is set by the pipeline (the data it staged and "
                    "validated, the run's outputs, its checkpoints and their pruning, its stop "
                    "request): it cannot be given again"
                )
            if owner is not None:
                raise ValueError(f"{word.split('=', 1)[0]} is {owner}: set that field instead")
        return value


class RetryConfig(_Section):
    training_attempts: int = Field(3, ge=1, description="attempts of the training job")
    storage_retries: int = Field(3, ge=0)
    backoff_seconds: float = Field(
        2.0,
        ge=0,
        le=3600,
        allow_inf_nan=False,
        description="the wait before a failed step's next attempt, at most an hour",
    )
    # A training attempt that stops making progress (a rank stuck in a collective) is ended
    # and retried from its last checkpoint (backends/progress_deadline.py).
    stall_startup_seconds: float = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="how long a training attempt may take to start training (node "
        "preparation, the data opened and checked, the model built, a checkpoint loaded) "
        "before it is ended as hung",
    )
    stall_first_epoch_seconds: float = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="once training started, how long an attempt may go before its first "
        "heartbeat (the trainer's batches done, every --heartbeat-seconds) or epoch end; each "
        "heartbeat renews it, so a first epoch may be as long as its data needs",
    )
    stall_factor: float = Field(
        3.0,
        ge=1,
        allow_inf_nan=False,
        description="after its first epoch, an attempt with no new epoch for this many times "
        "its slowest recent epoch is ended as hung and retried from its checkpoint",
    )
    stall_floor_seconds: float = Field(
        600.0,
        gt=0,
        allow_inf_nan=False,
        description="the shortest wait for the next epoch, whatever the epochs before took",
    )


class PromotionMinimum(_Section):
    """What any model must reach to serve its data root, the first one included: a data root
    with no champion yet would otherwise take any model, however broken."""

    metric: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="the least value of promotion.metric (on the test split) a model must "
        "reach to become the champion, the first one included; 0: no floor (no one number "
        "suits every dataset: 0.5 accuracy is chance on 2 classes and good on 200)",
    )
    class_recall: float | None = Field(
        0.1,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="the least recall every class must reach on the test split for a model "
        "to become the champion, the first one included: a model that (almost) never "
        "recognises a class is not served; null: not checked",
    )


class PromotionConfig(_Section):
    """When a run's model replaces its data root's champion (registry/promotion.py)."""

    metric: Literal["accuracy", "macro_f1", "balanced_accuracy"] = Field(
        "accuracy",
        description="what the challenger must beat the champion on, both scored on the same "
        "test split: accuracy (the share of test images labelled right), macro_f1 (the mean of "
        "the classes' F1) or balanced_accuracy (the mean of the classes' recall)",
    )
    min_improvement: float = Field(0.0, ge=0, description="challenger must beat the champion by")
    max_class_drop: float | None = Field(
        0.1,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="the largest drop in any class's recall the challenger may have against "
        "the champion on the same test split; a larger one refuses the promotion, naming the "
        "class and both recalls; null: no class is checked",
    )
    new_class_min_recall: float | None = Field(
        0.5,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="a challenger whose classes differ from the champion's (a class added or "
        "removed by a new version of the data root) is compared with it on the classes both "
        "know, and each class the champion does not know must reach this recall on the test "
        "split; null: a change of classes is never promoted (the champion stays)",
    )
    min_scored_fraction: float = Field(
        0.95,
        ge=0,
        le=1,
        description="the share of the test split the scorer must have read for a promotion "
        "to be decided; below it (images it could not decode) the champion stays, and the "
        "decision says why",
    )
    minimum: PromotionMinimum = Field(
        default_factory=PromotionMinimum,
        description="the floor any champion must reach, the first one included",
    )


MAX_IMAGE_SIDE = 16384  # Pillow refuses to decode more than ~179 million pixels (a bomb)


class ValidationConfig(_Section):
    min_images_per_class: int = Field(5, ge=1)
    min_side: int = Field(
        8, ge=1, le=MAX_IMAGE_SIDE, description="smallest width or height the gate accepts"
    )
    max_side: int = Field(
        4096,
        ge=1,
        le=MAX_IMAGE_SIDE,
        description=f"largest width or height the gate accepts; at most {MAX_IMAGE_SIDE}, "
        "beyond which Pillow refuses to decode an image as a decompression bomb",
    )
    timeout_minutes: float = Field(
        240,
        gt=0,
        le=24 * 60,
        description="the longest the gate may spend reading and decoding a version's blobs; "
        "past it the gate fails, naming the blobs still being read, and nothing is "
        "provisioned (a blob that cannot be read to its end holds no run or lock longer); "
        "the default is about three times a first gate of an ImageNet-sized version",
    )

    @model_validator(mode="after")
    def _sides_ordered(self) -> ValidationConfig:
        if self.max_side < self.min_side:
            raise ValueError(
                f"max_side ({self.max_side}) is less than min_side ({self.min_side}): "
                "no image could pass"
            )
        return self


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
        168,
        gt=0,
        le=168,
        description="the longest a node's SAS token may live (a user delegation key lasts at "
        "most 7 days); each task's token lives as long as that task can (its attempts x its "
        "maximum run time + pool.start_timeout_minutes), and a task that could outlive this "
        "bound is refused before it is submitted",
    )

    @field_validator("batch_account_url")
    @classmethod
    def _account(cls, value: str | None) -> str | None:
        return _account_url(value)


class BudgetConfig(_Section):
    """What runs may spend, in the currency of the pool's prices (the price table's USD, or
    ``pool.hourly_price``'s unit); null: no limit. A run whose estimate is over either limit
    is refused before anything is provisioned; one whose spend passes it while training stops
    at its next checkpoint, resumable (docs/cost.md)."""

    max_run_cost: float | None = Field(
        None,
        description="the most one run may cost (its estimate before it starts, its spend as "
        "it trains); null: no limit",
    )
    monthly_cap: float | None = Field(
        None,
        description="the most this data root's runs may cost together in a calendar month "
        "(UTC), counted from their run records; null: no limit",
    )

    @field_validator("max_run_cost", "monthly_cap")
    @classmethod
    def _positive(cls, value: float | None) -> float | None:
        if value is None:
            return None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"{value:g} is no budget: it must be more than 0 (null: no limit); 0 or less "
                "would refuse every run"
            )
        return value


_BLOCK_SLUG = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,98}[a-z0-9])?\Z")


def check_tracking_uri(value: str) -> str:
    """An MLflow tracking URI: an http(s) server, or an Azure ML workspace (``azureml://``,
    read by the azureml-mlflow plugin). A user, password or query is refused as in every
    other endpoint: MLflow takes its credentials from the environment (MLFLOW_TRACKING_TOKEN,
    MLFLOW_TRACKING_USERNAME and _PASSWORD; Azure ML: DefaultAzureCredential), and the URI is
    stored with every run."""
    scheme, sep, rest = value.partition("://")
    if sep and scheme.lower() == "azureml":
        try:
            _url_parts(f"https://{rest}", "an azureml:// tracking URI")
        except ValueError as exc:
            raise ValueError(str(exc).replace("https://", "azureml://", 1)) from None
        return value
    _url_parts(value, "an MLflow tracking URI (http(s)://host:port or azureml://...)")
    return value.rstrip("/")


class TrackingConfig(_Section):
    """MLflow tracking of each training run, logged by the orchestrator (tasks/tracking.py)."""

    mlflow_uri: str | None = Field(
        None,
        description="the MLflow tracking server, e.g. http://127.0.0.1:5000 (make service "
        "starts one there), or an Azure ML workspace's azureml:// URI; null: no tracking. "
        "Never a credential: MLflow reads MLFLOW_TRACKING_TOKEN (or _USERNAME and _PASSWORD) "
        "from the environment. A server that does not answer is a warning, never a failed run",
    )
    experiment: str = Field(
        "retrain",
        min_length=1,
        max_length=200,
        pattern=r"^[^\x00-\x1f/]+$",
        description="the MLflow experiment every training run is logged in",
    )
    model_name: str = Field(
        "retrain",
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="the registered models' name, followed by the data root's (a champion, "
        "and so the `champion` alias, is kept per data root): retrain-training-data.digits-...",
    )

    @field_validator("mlflow_uri")
    @classmethod
    def _uri(cls, value: str | None) -> str | None:
        if value is None or value.strip() == "":
            return None
        return check_tracking_uri(value.strip())


AlertEvent = Literal["failed", "crashed", "promoted"]


def _every_alert() -> list[AlertEvent]:
    return ["failed", "crashed", "promoted"]


class AlertsConfig(_Section):
    """Notifications through a Prefect notification block (``python -m deployments.setup``
    creates the automations that send them: deployments/alerts.py)."""

    notify_block: str | None = Field(
        None,
        description="the Prefect notification block that receives the alerts, as "
        "<block type>/<name>: custom-webhook/retrain-alerts, slack-webhook/ml-team, "
        "ms-teams-webhook/ml, sendgrid-email/oncall; it must exist on the server when "
        "deployments.setup runs (RETRAIN_ALERTS_WEBHOOK_URL makes a webhook one); null: none",
    )
    on: list[AlertEvent] = Field(
        default_factory=_every_alert,
        description="what is notified: failed (a retrain run failed, naming its step), "
        "crashed (its process died), promoted (a new champion)",
    )

    @field_validator("notify_block")
    @classmethod
    def _block(cls, value: str | None) -> str | None:
        if value is None or value.strip() == "":
            return None
        kind, sep, name = value.strip().partition("/")
        if not sep or not _BLOCK_SLUG.match(kind) or not _BLOCK_SLUG.match(name):
            # Not repeated: a webhook URL pasted here is a secret (Slack's is its path).
            raise ValueError(
                "must be <block type>/<block name> (lowercase letters, digits and '-'), e.g. "
                "custom-webhook/retrain-alerts; never a webhook URL (the block keeps it)"
            )
        return f"{kind}/{name}"


class PipelineConfig(_Section):
    """Everything one retrain run needs. Sections mirror the steps of the flow."""

    target: Literal["local", "azure"] = "local"
    data: DataLocation
    share: ShareConfig = Field(default_factory=ShareConfig)
    nfs: NfsConfig = Field(default_factory=NfsConfig)
    image: ImageConfig = Field(default_factory=ImageConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    retries: RetryConfig = Field(default_factory=RetryConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    output: OutputLocation
    azure: AzureConfig = Field(default_factory=AzureConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    work_dir: Path = Field(Path(".work"), description="local state: run folders, logs")

    @model_validator(mode="after")
    def _init_from_allowed(self) -> PipelineConfig:
        """A URL to start from must point into the configured data or output container: no
        run may bring an account (and a credential) of its own."""
        if self.training.init_from is not None:
            start = parse_init_from(self.training.init_from)
            if start.kind == "url":
                url_location(start.path, self.init_from_accounts())
        return self

    def init_from_accounts(self) -> dict[str, tuple[str | None, str]]:
        """The accounts and containers ``training.init_from`` may name, by role."""
        return {
            "data": (self.data.account_url, self.data.container),
            "output": (self.output.account_url, self.output.container),
        }

    @model_validator(mode="after")
    def _azure_complete(self) -> PipelineConfig:
        """A run on Azure that lacks a resource fails at load, before anything is created."""
        if self.target != "azure":
            if self.image.builder in ("acr", "docker"):
                raise ValueError(
                    f"image.builder {self.image.builder} is for target azure; the local target "
                    "builds with buildah (or none)"
                )
            return self
        if self.image.builder == "buildah":
            raise ValueError(
                "image.builder buildah builds the local target's cpu image; on Azure use acr "
                "(or docker)"
            )
        needed = {
            "azure.batch_account_url": self.azure.batch_account_url,
            "share.account_url": self.share.account_url,
            "nfs.source": self.nfs.source,
            "image.registry": self.image.registry,
            "data.account_url": self.data.account_url or self.data.connection_string_env,
            "output.account_url": self.output.account_url or self.output.connection_string_env,
        }
        if not self.share.on_blob:  # the SMB mount of an Azure Files share takes the key
            needed["share.account_key_secret"] = self.share.account_key_secret
        if self.share.on_blob and not self.azure.identity_resource_id:
            raise ValueError(
                "share.account_url is a Blob endpoint: the nodes mount its container with their "
                "managed identity, so target azure needs azure.identity_resource_id (or an Azure "
                "Files share, https://<account>.file.core.windows.net, with "
                "share.account_key_secret)"
            )
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


MAX_CONFIG_BYTES = 1 << 20  # a pipeline config is a few KB; anything this large is another file
_NULLS = ("", "~", "null", "Null", "NULL")  # YAML's spellings of "no value"
_EXTRA = "Extra inputs are not permitted"  # pydantic's message for an unknown field
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$|^[0-9]{1,6}$")  # names, list indices


def _is_text(annotation: Any) -> bool:
    if annotation in (str, Path):
        return True
    return get_origin(annotation) is Literal and all(
        isinstance(a, str) for a in get_args(annotation)
    )


def _field_type(dotted: list[str]) -> tuple[str, bool]:
    """How ``--set`` reads a value for this field: ("text" | "text-list" | "yaml", optional).

    A string field takes the characters typed, as they are: YAML would turn ``2024`` into a
    number, ``images/v1 #note`` into ``images/v1`` and ``!!binary ...`` into bytes. A list of
    strings is read as a YAML sequence whose items all stay strings. Numbers, booleans and
    sections are read as YAML. An optional field is cleared with ``null`` (or nothing). A path
    the schema does not know is kept as text, and validation then names it.
    """
    model: Any = PipelineConfig
    annotation: Any = None
    for part in dotted:
        fields = _annotations(model)
        if fields is None or part not in fields:
            return "text", False
        annotation = fields[part]
        members = [a for a in get_args(annotation) or (annotation,) if a is not type(None)]
        model = members[0] if len(members) == 1 else None
    union = get_origin(annotation) in (Union, UnionType)
    members = list(get_args(annotation)) if union else [annotation]
    optional = type(None) in members
    members = [m for m in members if m is not type(None)]
    if all(_is_text(m) for m in members):
        return "text", optional
    if all(get_origin(m) is list and all(_is_text(a) for a in get_args(m)) for m in members):
        return "text-list", optional
    return "yaml", optional


def _annotations(section: Any) -> dict[str, Any] | None:
    """Field name -> type of a config section: a pydantic model, or the trainer's settings (a
    dataclass); None for anything else."""
    if isinstance(getattr(section, "model_fields", None), dict):
        return {name: f.annotation for name, f in section.model_fields.items()}
    if isinstance(section, type) and dataclasses.is_dataclass(section):
        return get_type_hints(section)
    return None


def _parse_set(key: str, raw: str, dotted: list[str]) -> Any:
    kind, optional = _field_type(dotted)
    if optional and raw.strip() in _NULLS:
        return None  # `--set data.account_url=null` (or empty) clears an optional field
    if kind == "text":
        return raw
    if raw == "":
        return [] if kind == "text-list" else raw
    try:
        if kind == "text-list":
            return yaml.load(raw, Loader=yaml.BaseLoader)  # every scalar stays a string
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problem = f"the value is not valid YAML{_where(exc)}"
        raise ConfigError(f"--set {key}={_shown(raw)}: {problem}") from None


def _set(tree: dict[str, Any], dotted: str) -> str:
    """Apply one ``section.field=value``; returns the field's dotted name."""
    if "=" not in dotted:
        raise ConfigError(f"--set {dotted!r}: expected section.field=value")
    key, raw = dotted.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {key!r}: expected section.field=value")
    _assign(tree, parts, _parse_set(key, raw, parts), f"--set {key}")
    return ".".join(parts)


def _assign(tree: dict[str, Any], parts: list[str], value: Any, origin: str) -> None:
    *parents, leaf = parts
    node = tree
    for part in parents:
        if node.get(part) is None:  # absent, or an empty section (`training:` in the file)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"{origin}: {part} is not a section")
    node[leaf] = value


def _shown(text: str) -> str:
    text = hide_credentials(text)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _where(exc: yaml.YAMLError) -> str:
    """Where a YAML error is, without the text around it (which may be another file's secret)."""
    mark = getattr(exc, "problem_mark", None)
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def _field_name(loc: tuple[Any, ...]) -> str:
    # A key comes from the file; when the file is not a config (a credentials file, a hashed
    # password list), its "keys" are its content, so only what could be a field name is shown.
    parts = [
        str(p) if _PLAIN_KEY.match(str(p)) else "<a key that is not a field name>" for p in loc
    ]
    return ".".join(parts) or "(top level)"


def _field_names(section: Any) -> list[str]:
    """The fields of a config section: a pydantic model, or a dataclass (the training one)."""
    if hasattr(section, "model_fields"):
        return list(section.model_fields)
    if dataclasses.is_dataclass(section):
        return [f.name for f in dataclasses.fields(section)]
    return []


def _suggestion(loc: tuple[Any, ...]) -> str:
    """For a field the schema does not know: the closest one it does, if any is close."""
    model: Any = PipelineConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        members = get_args(field.annotation) or (field.annotation,) if field else ()
        model = next((m for m in members if _field_names(m)), None)
    known = _field_names(model)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    return f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?" if close else ""


def _describe(exc: ValidationError, source: str, origins: dict[str, str]) -> str:
    """One line per problem, naming the field and where its value came from. When every
    problem comes from a ``--set``, the ``--set`` is blamed, not the file."""
    lines = []
    blamed = set()
    for err in exc.errors():
        field = _field_name(err["loc"])
        origin = next(
            (
                o
                for k, o in origins.items()
                if field == k or field.startswith(f"{k}.") or k.startswith(f"{field}.")
            ),
            None,
        )
        blamed.add(origin.startswith("from --set") if origin else False)
        # An unknown key of the training section (a dataclass) is an "unexpected keyword
        # argument" to pydantic; it reads as in every other section.
        unknown = err["type"] in ("extra_forbidden", "unexpected_keyword_argument")
        msg = _EXTRA if err["type"] == "unexpected_keyword_argument" else err["msg"]
        hint = _suggestion(err["loc"]) if unknown else ""
        lines.append(f"  {field}: {msg}{hint}{f' ({origin})' if origin else ''}")
    if blamed == {True}:
        return "\n".join([f"invalid --set for {source} (the file itself is not at fault):", *lines])
    return "\n".join([f"invalid config {source}:", *lines])


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in ``path``; ConfigError says what is wrong without quoting the file.

    A mistyped ``--config`` may point at any file a user can read (a ``.env``, a key file), so
    no error repeats its content: problems are named by line and column only.
    """
    file = Path(path)
    try:
        if file.is_dir():
            raise ConfigError(f"config file {path} is a folder, not a YAML file")
        if file.exists() and not file.is_file():
            raise ConfigError(f"config file {path} is not a regular file")
        with file.open("rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"config file {path} cannot be read (permission denied)") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not a UTF-8 text file") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML{_where(exc)}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return loaded


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
    fields: dict[str, Any] | None = None,
) -> PipelineConfig:
    """A validated config from a YAML file or, without one, from ``base`` (a config given as
    a parameter); then ``section.field=value`` overrides, then ``fields``: typed values (a
    flow's own parameters) set on their dotted fields as they are, never parsed. ConfigError
    names the field, and where its value came from. A file and a base together is an error:
    which one's values are meant is not knowable."""
    if path is not None and base is not None:
        raise ConfigError("give a config file or a config, not both")
    source = str(path) if path is not None else "(parameters)"
    tree = read_config_file(path) if path is not None else copy.deepcopy(base or {})
    origins = {_set(tree, item): f"from --set {_shown(item)}" for item in overrides or []}
    for dotted, value in (fields or {}).items():
        _assign(tree, dotted.split("."), value, dotted)
        origins[dotted] = "from the run's parameters"
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source, origins)) from None
