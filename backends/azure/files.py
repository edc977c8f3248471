"""The scripts share on Azure: a Blob container or an Azure Files share, each with the same
contract as ``LocalShare``.

Each file's SHA-256 is kept in its own metadata, so an unchanged file costs one properties
request and no upload, and the share itself is the record of what it holds (nothing to lose on
the orchestrator). A node never reads half a script: a blob is replaced whole when its upload
commits; on Azure Files a changed file is uploaded under a temporary name and renamed over the
old one. Azure Files paths are case-insensitive: two local files whose paths differ only in case
would land on one file of the share, so such a tree is refused before anything is uploaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from backends.share import UploadReport, file_sha256, tree_digest

if TYPE_CHECKING:
    from azure.storage.blob import ContainerClient
    from azure.storage.fileshare import ShareClient, ShareServiceClient

HASH_KEY = "contentsha256"


class ShareError(ValueError):
    """The files cannot be represented on the share; the message names them."""


def _case_collisions(names: list[str]) -> list[tuple[str, str]]:
    seen: dict[str, str] = {}
    clashes = []
    for name in sorted(names):
        folded = name.casefold()
        if folded in seen:
            clashes.append((seen[folded], name))
        seen.setdefault(folded, name)
    return clashes


class AzureFilesShare:
    def __init__(self, service: ShareServiceClient, name: str) -> None:
        self.share: ShareClient = service.get_share_client(name)

    def _ensure_share(self) -> None:
        from azure.core.exceptions import ResourceExistsError

        with contextlib.suppress(ResourceExistsError):
            self.share.create_share()

    def _ensure_directories(self, rel: str, known: set[str]) -> None:
        from azure.core.exceptions import ResourceExistsError

        parents = list(PurePosixPath(rel).parents)[:-1]  # without "."
        for parent in reversed(parents):
            path = parent.as_posix()
            if path in known:
                continue
            with contextlib.suppress(ResourceExistsError):
                self.share.create_directory(path)
            known.add(path)

    def _stored_hash(self, rel: str) -> str | None:
        from azure.core.exceptions import ResourceNotFoundError

        try:
            props = self.share.get_file_client(rel).get_file_properties()
        except ResourceNotFoundError:
            return None
        return (props.metadata or {}).get(HASH_KEY)

    def upload(self, files: dict[str, Path]) -> UploadReport:
        clashes = _case_collisions(list(files))
        if clashes:
            raise ShareError(
                "Azure Files paths are case-insensitive; these would be one file on the share: "
                + "; ".join(f"{a} and {b}" for a, b in clashes)
            )
        self._ensure_share()
        directories: set[str] = set()

        def put(rel: str, source: Path, digest: str) -> None:
            self._ensure_directories(rel, directories)
            path = PurePosixPath(rel)
            temp = self.share.get_file_client(str(path.with_name(f".upload-{path.name}")))
            with open(source, "rb") as fh:
                temp.upload_file(fh, metadata={HASH_KEY: digest})
            temp.rename_file(rel, overwrite=True)

        return _upload_changed(files, self._stored_hash, put)

    def put_text(self, rel: str, text: str) -> None:
        """A small file the nodes read through their mount (a stop request)."""
        self._ensure_share()
        self._ensure_directories(rel, set())
        self.share.get_file_client(rel).upload_file(text.encode())

    def delete(self, rel: str) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        with contextlib.suppress(ResourceNotFoundError):
            self.share.get_file_client(rel).delete_file()


class BlobContainerShare:
    """The scripts in a Blob container, which the nodes mount with blobfuse as their managed
    identity. The container is the setup's (``make azure-up`` creates it; the orchestrator's
    role is on the container alone, so it cannot create one)."""

    def __init__(self, container: ContainerClient) -> None:
        self.container = container

    def _stored_hash(self, name: str) -> str | None:
        from azure.core.exceptions import ResourceNotFoundError

        try:
            props = self.container.get_blob_client(name).get_blob_properties()
        except ResourceNotFoundError as exc:
            if getattr(exc, "error_code", None) == "ContainerNotFound":
                raise ShareError(
                    f"the scripts container {self.container.container_name} does not exist in "
                    f"{self.container.account_name}: `make azure-up` creates it (share.name)"
                ) from exc
            return None
        return (props.metadata or {}).get(HASH_KEY)

    def upload(self, files: dict[str, Path]) -> UploadReport:
        def put(rel: str, source: Path, digest: str) -> None:
            with open(source, "rb") as fh:
                self.container.upload_blob(rel, fh, overwrite=True, metadata={HASH_KEY: digest})

        return _upload_changed(files, self._stored_hash, put)

    def put_text(self, rel: str, text: str) -> None:
        """A small file the nodes read through their mount (a stop request)."""
        self.container.upload_blob(rel, text.encode(), overwrite=True)

    def delete(self, rel: str) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        with contextlib.suppress(ResourceNotFoundError):
            self.container.delete_blob(rel)


def _upload_changed(
    files: dict[str, Path],
    stored_hash: Callable[[str], str | None],
    put: Callable[[str, Path, str], None],
) -> UploadReport:
    """Each file whose content hash differs from the one stored beside its copy, put; the
    others counted unchanged; the tree's digest over all of them."""
    report = UploadReport()
    current: dict[str, str] = {}
    for rel, source in files.items():
        digest = file_sha256(source)
        current[rel] = digest
        if stored_hash(rel) == digest:
            report.unchanged += 1
            continue
        put(rel, source, digest)
        report.uploaded.append(rel)
    report.digest = tree_digest(current)
    return report
