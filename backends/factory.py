"""Pick each backend for a config's target: local stand-ins, or Azure through the SDKs."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backends.blob import container_client
from backends.image import ImageResult, build_local, content_tag
from backends.share import LocalShare
from backends.taskspec import Cluster
from core.config import PipelineConfig

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def share(config: PipelineConfig) -> Any:
    """An object with ``upload(files) -> UploadReport``: Azure Files or a directory."""
    if config.target == "local":
        return LocalShare(config.share.local_dir)
    from backends.azure.clients import share_service
    from backends.azure.files import AzureFilesShare

    return AzureFilesShare(share_service(config), config.share.name)


def image_reference(config: PipelineConfig) -> str:
    registry = f"{config.image.registry}/" if config.image.registry else ""
    return f"{registry}{config.image.repository}:{content_tag(PROJECT_ROOT)}"


def build_image(config: PipelineConfig, on_line: Callable[[str], None]) -> ImageResult:
    if config.target == "local":
        return build_local(PROJECT_ROOT, config.image.repository)
    tag = content_tag(PROJECT_ROOT)
    if config.image.builder == "none":
        return ImageResult(image_reference(config), False, "image.builder is none: tag used as is")
    if config.image.builder == "docker":
        from backends.docker_cli import docker_build

        return docker_build(PROJECT_ROOT, image_reference(config), on_line)
    from backends.azure.acr import AcrBuilder
    from backends.azure.clients import acr_tasks_client, registry_client

    builder = AcrBuilder(
        acr_tasks_client(config),
        registry_client(config),
        str(config.azure.resource_group),
        str(config.image.registry),
    )
    return builder.build(PROJECT_ROOT, config.image.repository, tag, on_line)


def cluster(config: PipelineConfig) -> Cluster:
    outputs = container_client(config.output, config.retries.storage_retries, create=True)
    if config.target == "local":
        from backends.local_cluster import LocalCluster

        return LocalCluster(
            config.work_dir,
            config.pool.id,
            config.pool.nodes,
            config.nfs.local_dir,
            config.share.local_dir,
            outputs,
            sys.executable,
        )
    from backends.azure.access import node_access
    from backends.azure.batch import BatchCluster
    from backends.azure.clients import batch_client, secret

    data = container_client(config.data, config.retries.storage_retries)

    def pool_secrets() -> tuple[str, str | None]:
        password = config.image.registry_password_secret
        return secret(str(config.share.account_key_secret)), secret(password) if password else None

    return BatchCluster(
        config,
        batch_client(config),
        outputs,
        node_access(config, data, outputs),
        image_reference(config),
        pool_secrets,
    )
