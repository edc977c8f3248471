"""Steps 2 to 5, independent of each other, run concurrently once the data gate has passed:
upload the scripts, stage the data, build the image, ensure the pool."""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.tasks import exponential_backoff

from backends import factory
from backends.blob import container_client
from backends.image import build_local
from backends.local_cluster import LocalCluster
from backends.share import collect_files
from backends.staging import sync_to_directory
from flows.config import PipelineConfig
from tasks.steps import step_record

SCRIPT_PACKAGES = ["training"]
# Storage faults (throttling, resets) are usually gone within seconds: 2, 4, 8 s.
TRANSIENT_BACKOFF = exponential_backoff(backoff_factor=2)


@task(name="upload-scripts", cache_policy=NONE, retries=3, retry_delay_seconds=TRANSIENT_BACKOFF)
def upload_scripts(config: PipelineConfig) -> dict[str, Any]:
    started = time.perf_counter()
    report = factory.share(config).upload(collect_files(factory.PROJECT_ROOT, SCRIPT_PACKAGES))
    get_run_logger().info(
        "scripts: %d uploaded, %d unchanged", len(report.uploaded), report.unchanged
    )
    return step_record(
        "upload-scripts",
        started,
        bool(report.uploaded),
        uploaded=len(report.uploaded),
        unchanged=report.unchanged,
        code_version=report.digest,
    )


@task(name="stage-data", cache_policy=NONE, retries=3, retry_delay_seconds=TRANSIENT_BACKOFF)
def stage_data(config: PipelineConfig) -> dict[str, Any]:
    started = time.perf_counter()
    container = container_client(config.data, config.retries.storage_retries)
    report = sync_to_directory(container, config.data.prefix, config.nfs.local_dir / "data")
    get_run_logger().info(
        "data: %d downloaded (%d bytes), %d unchanged, %d deleted; version %s",
        len(report.downloaded),
        report.bytes_downloaded,
        report.skipped,
        len(report.deleted),
        report.data_version,
    )
    return step_record(
        "stage-data",
        started,
        bool(report.downloaded or report.deleted),
        downloaded=len(report.downloaded),
        unchanged=report.skipped,
        deleted=len(report.deleted),
        bytes=report.bytes_downloaded,
        files=report.total_files,
        data_version=report.data_version,
    )


@task(name="build-image", cache_policy=NONE)
def build_image(config: PipelineConfig) -> dict[str, Any]:
    started = time.perf_counter()
    result = build_local(factory.PROJECT_ROOT, config.image.repository)
    get_run_logger().info("image %s: %s", result.reference, result.reason)
    return step_record(
        "build-image", started, result.built, image=result.reference, reason=result.reason
    )


@task(
    name="ensure-pool",
    cache_policy=NONE,
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=5),
)
def ensure_pool(config: PipelineConfig, cluster: LocalCluster) -> dict[str, Any]:
    started = time.perf_counter()
    info = cluster.ensure_pool()
    get_run_logger().info(
        "pool %s steady (%s)", config.pool.id, "created" if info["created"] else "already there"
    )
    return step_record("ensure-pool", started, bool(info["created"]), **info)


@task(name="release-pool", cache_policy=NONE)
def release_pool(cluster: LocalCluster) -> dict[str, Any]:
    started = time.perf_counter()
    info = cluster.release()
    get_run_logger().info("pool %s released (was %s)", info["pool"], info["was"])
    return step_record("release-pool", started, True, **info)
