"""Pick each backend for a config's target. The Azure implementations plug in here."""

from __future__ import annotations

import sys
from pathlib import Path

from backends.blob import container_client
from backends.local_cluster import LocalCluster
from backends.share import LocalShare
from flows.config import PipelineConfig

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class TargetNotAvailableError(NotImplementedError):
    """The config asks for a target whose backend this installation does not provide."""


def _require_local(config: PipelineConfig, what: str) -> None:
    if config.target != "local":
        raise TargetNotAvailableError(
            f"target {config.target!r}: the Azure {what} backend is not available yet; "
            "use target: local"
        )


def share(config: PipelineConfig) -> LocalShare:
    _require_local(config, "Files")
    return LocalShare(config.share.local_dir)


def cluster(config: PipelineConfig) -> LocalCluster:
    _require_local(config, "Batch")
    outputs = container_client(config.output, config.retries.storage_retries, create=True)
    return LocalCluster(
        config.work_dir,
        config.pool.id,
        config.pool.nodes,
        config.nfs.local_dir,
        config.share.local_dir,
        outputs,
        sys.executable,
    )
