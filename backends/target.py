"""Which backends a config's target uses: the one place that reads ``config.target``.

``target_for(config)`` is this machine's stand-ins (a directory for the share, the training
image built with buildah and pushed to a registry here, local processes for the pool, staging in
this process) or Azure through the SDKs (Azure Files, ACR
Tasks or docker, a Batch pool, staging as a task on the pool). The flow and its tasks call the
target's methods and the cluster's; none of them asks which target it is.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from backends.blob import container_client
from backends.cluster import Cluster
from backends.image import ImageResult, build_local, content_tag
from backends.share import LocalShare, UploadReport
from backends.taskspec import pack_image_size, staging_task
from core.config import PipelineConfig
from staging.listing import listing_blob, parse_listing

if TYPE_CHECKING:
    from backends.azure.batch import BatchCluster, Polling

PROJECT_ROOT = Path(__file__).resolve().parents[1]
OnLine = Callable[[str], None]


class Share(Protocol):
    """Where the scripts go: Azure Files or a directory; unchanged files are not sent again."""

    def upload(self, files: dict[str, Path]) -> UploadReport: ...


class Target(Protocol):
    # Staging runs on the pool's nodes (it then waits for the pool and the uploaded scripts).
    stages_on_pool: bool
    # The training task runs in the built image (it then waits for the build).
    trains_in_image: bool

    def share(self) -> Share: ...

    def build_image(self, on_line: OnLine) -> ImageResult: ...

    def cluster(self) -> Cluster: ...

    def stage(
        self, cluster: Cluster, output_prefix: str, task_id: str, on_line: OnLine
    ) -> dict[str, Any]:
        """Stage the data gate's pinned listing (in the run's outputs) into the pool's NFS
        data folder; the staging report."""
        ...


def image_reference(config: PipelineConfig) -> str:
    registry = f"{config.image.registry}/" if config.image.registry else ""
    return f"{registry}{config.image.repository}:{content_tag(PROJECT_ROOT)}"


class LocalTarget:
    """This machine: a directory for the share, the image's cpu variant built and pushed as
    ACR Tasks does on Azure (image.builder buildah), local processes for the pool."""

    stages_on_pool = False
    trains_in_image = False  # the local cluster runs the trainer on this machine's files

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config

    def share(self) -> Share:
        return LocalShare(self.config.share.local_dir)

    def build_image(self, on_line: OnLine) -> ImageResult:
        """Built and pushed unless the registry has its tag (image.builder buildah), or only
        named (none)."""
        image = self.config.image
        if image.builder != "buildah":
            return build_local(PROJECT_ROOT, image.repository)
        from backends.local.buildah import LocalImageBuilder
        from backends.local.oci_server import local_registry

        with local_registry(image.registry) as registry:
            return LocalImageBuilder(registry).build(PROJECT_ROOT, image.repository, on_line)

    def cluster(self) -> Cluster:
        from backends.local.cluster import LocalCluster

        config = self.config
        return LocalCluster(
            config.work_dir,
            config.pool.id,
            config.pool.nodes,
            config.nfs.local_dir,
            config.share.local_dir,
            container_client(config.output, config.retries.storage_retries, create=True),
            sys.executable,
        )

    def stage(
        self, cluster: Cluster, output_prefix: str, task_id: str, on_line: OnLine
    ) -> dict[str, Any]:
        """In this process: the NFS folder is on this machine."""
        from staging.sync import stage

        config = self.config
        pinned = listing_blob(output_prefix)
        dataset = config.data.dataset  # the run's data version, chosen by the gate
        listing = parse_listing(
            cluster.outputs.download_blob(pinned).readall(), pinned, dataset.prefix
        )
        return stage(
            container_client(dataset, config.retries.storage_retries),
            dataset.prefix,
            config.nfs.local_dir / "data",
            pack_image_size(config),
            listing=listing,
        )


class AzureTarget:
    """A Blob container or Azure Files share for the scripts, ACR Tasks (or docker, or a tag
    used as is), a Batch pool."""

    stages_on_pool = True  # the data must not stream through the orchestrator
    trains_in_image = True

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config

    def share(self) -> Share:
        from backends.azure.clients import scripts_container, share_service
        from backends.azure.files import AzureFilesShare, BlobContainerShare

        share = self.config.share
        if share.on_blob:
            return BlobContainerShare(scripts_container(share))
        return AzureFilesShare(share_service(share), share.name)

    def build_image(self, on_line: OnLine) -> ImageResult:
        image = self.config.image
        if image.builder == "none":
            return ImageResult(
                image_reference(self.config), False, "image.builder is none: tag used as is"
            )
        if image.builder == "docker":
            from backends.docker_cli import docker_build

            return docker_build(PROJECT_ROOT, image_reference(self.config), on_line)
        from backends.azure.acr import AcrBuilder
        from backends.azure.clients import acr_tasks_client, registry_client

        builder = AcrBuilder(
            acr_tasks_client(self.config.azure),
            registry_client(str(image.registry)),
            str(self.config.azure.resource_group),
            str(image.registry),
        )
        return builder.build(PROJECT_ROOT, image.repository, content_tag(PROJECT_ROOT), on_line)

    def cluster(
        self,
        secrets: Callable[[], tuple[str, str | None]] | None = None,
        polling: Polling | None = None,
    ) -> BatchCluster:
        """The Batch pool. ``secrets`` gives (share key, registry password) when the pool is
        created; by default they come from the Prefect Secret blocks the config names, fetched
        only then."""
        from backends.azure.access import AccessIssuer
        from backends.azure.batch import BatchCluster
        from backends.azure.clients import batch_client, secret

        config = self.config
        retries = config.retries.storage_retries
        outputs = container_client(config.output, retries, create=True)
        data = container_client(config.data, retries)

        def pool_secrets() -> tuple[str, str | None]:
            password = config.image.registry_password_secret
            # A Blob container is mounted with the nodes' identity: no key is read.
            key = "" if config.share.on_blob else secret(str(config.share.account_key_secret))
            return key, secret(password) if password else None

        return BatchCluster(
            config,
            batch_client(config.azure),
            outputs,
            AccessIssuer(config, data, outputs),
            image_reference(config),
            secrets or pool_secrets,
            polling,
        )

    def stage(
        self, cluster: Cluster, output_prefix: str, task_id: str, on_line: OnLine
    ) -> dict[str, Any]:
        """A staging task on the pool; its report comes back through the run's outputs."""
        spec = staging_task(self.config, task_id, output_prefix)
        result = cluster.run_task(spec, on_line)
        uploaded = _staging_report(cluster, output_prefix)
        if result.exit_code != 0:
            why = f": {uploaded['error']}" if uploaded and uploaded.get("error") else ""
            raise RuntimeError(f"staging task {spec.id} exited with {result.exit_code}{why}")
        if uploaded is None:
            raise RuntimeError(f"staging task {spec.id} uploaded no staging.json")
        return uploaded


def _staging_report(cluster: Cluster, output_prefix: str) -> dict[str, Any] | None:
    """The staging task's report (uploaded on failure too, then holding the error)."""
    from azure.core.exceptions import ResourceNotFoundError

    try:
        data = cluster.outputs.download_blob(f"{output_prefix}/staging.json").readall()
    except ResourceNotFoundError:
        return None
    report = json.loads(data)
    return report if isinstance(report, dict) else None


TARGETS: dict[str, type[LocalTarget] | type[AzureTarget]] = {
    "local": LocalTarget,
    "azure": AzureTarget,
}


def target_for(config: PipelineConfig) -> LocalTarget | AzureTarget:
    return TARGETS[config.target](config)
