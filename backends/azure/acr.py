"""Build and push the training image with ACR Tasks: no Docker engine on the orchestrator.

The build context (exactly the files the content tag hashes) is uploaded as a tar.gz to the
upload URL the registry hands out, a Docker build run is scheduled, and its log is streamed
from the log blob while the run is polled. A tag already in the registry is never rebuilt: the
tag names the content, so an existing tag is the image this code would produce.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.azure import service_name
from backends.image import ImageResult, context_archive
from backends.lines import read_new_lines

if TYPE_CHECKING:
    from azure.containerregistry import ContainerRegistryClient
    from azure.mgmt.containerregistrytasks import ContainerRegistryTasksMgmtClient

DOCKERFILE = "docker/Dockerfile"
TERMINAL = {"Succeeded", "Failed", "Canceled", "Error", "Timeout"}


class ImageBuildError(RuntimeError):
    """The image could not be built or pushed; the message carries the registry's reason."""


def tag_exists(registry: ContainerRegistryClient, repository: str, tag: str) -> bool:
    from azure.core.exceptions import ResourceNotFoundError

    try:
        registry.get_tag_properties(repository, tag)
    except ResourceNotFoundError:
        return False
    return True


class AcrBuilder:
    def __init__(
        self,
        tasks: ContainerRegistryTasksMgmtClient,
        registry: ContainerRegistryClient,
        resource_group: str,
        login_server: str,
        poll_seconds: float = 5.0,
        timeout_seconds: int = 3 * 3600,
        dockerfile: str = DOCKERFILE,
        context: Callable[[Path], bytes] = context_archive,
    ) -> None:
        """``dockerfile`` and ``context`` (the build context's tar.gz, from the project root)
        default to the training image's; `make azure-up` builds the service image with its own."""
        self.tasks, self.registry = tasks, registry
        self.dockerfile, self.context = dockerfile, context
        self.resource_group, self.login_server = resource_group, login_server
        self.registry_name = login_server.split(".", 1)[0]
        self.poll_seconds, self.timeout_seconds = poll_seconds, timeout_seconds

    def build(
        self, root: Path, repository: str, tag: str, on_line: Callable[[str], None]
    ) -> ImageResult:
        reference = f"{self.login_server}/{repository}:{tag}"
        if tag_exists(self.registry, repository, tag):
            return ImageResult(reference, False, "tag already in the registry")
        from azure.mgmt.containerregistrytasks import models as m
        from azure.storage.blob import BlobClient

        upload = self.tasks.registries.get_build_source_upload_url(
            self.resource_group, self.registry_name
        )
        BlobClient.from_blob_url(str(upload.upload_url)).upload_blob(
            self.context(root), overwrite=True
        )
        request = m.DockerBuildRequest(
            image_names=[f"{repository}:{tag}"],
            is_push_enabled=True,
            docker_file_path=self.dockerfile,
            source_location=upload.relative_path,
            platform=m.PlatformProperties(os="Linux", architecture="amd64"),
            timeout=self.timeout_seconds,
        )
        run = self.tasks.registries.schedule_run(self.resource_group, self.registry_name, request)
        run_id = str(run.properties.run_id)  # type: ignore[union-attr]
        on_line(f"ACR run {run_id} scheduled for {reference}")
        final = self._follow(run_id, on_line)
        status = final.properties.status if final.properties else None
        if status != "Succeeded":
            message = final.properties.run_error_message if final.properties else None
            raise ImageBuildError(
                f"ACR run {run_id} for {reference} ended {service_name(status)}: {message}"
            )
        return ImageResult(reference, True, f"built and pushed by ACR run {run_id}")

    def _follow(self, run_id: str, on_line: Callable[[str], None]) -> Any:
        from azure.storage.blob import BlobClient

        log: BlobClient | None = None
        offset = 0
        while True:
            run = self.tasks.runs.get(self.resource_group, self.registry_name, run_id)
            status = run.properties.status if run.properties else None
            if log is None and status not in (None, "Queued"):
                link = self.tasks.runs.get_log_sas_url(
                    self.resource_group, self.registry_name, run_id
                ).log_link
                log = BlobClient.from_blob_url(str(link)) if link else None
            if log is not None:
                offset = self._read_log(log, offset, on_line)
            if status in TERMINAL:
                return run
            time.sleep(self.poll_seconds)

    @staticmethod
    def _read_log(log: Any, offset: int, on_line: Callable[[str], None]) -> int:
        from azure.core.exceptions import HttpResponseError, ResourceNotFoundError

        try:
            size = log.get_blob_properties().size
            return read_new_lines(
                size,
                offset,
                lambda start, end: log.download_blob(offset=start, length=end - start).readall(),
                on_line,
            )
        except (ResourceNotFoundError, HttpResponseError):
            return offset  # the log blob appears once the run starts writing
