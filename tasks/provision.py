"""Steps 2 to 5, run concurrently once the data gate has passed: upload the scripts, stage the
data, build the image, ensure the pool. On Azure, staging is itself a task on the pool (the data
must not stream through the orchestrator), so there it waits for the pool and the scripts."""

from __future__ import annotations

import json
import time
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.runtime import task_run
from prefect.tasks import exponential_backoff

from backends import factory
from backends.blob import container_client
from backends.listing import listing_blob, parse_listing
from backends.share import collect_files
from backends.staging import stage
from backends.taskspec import Cluster, pack_image_size, staging_task
from flows.config import PipelineConfig
from tasks.steps import step_record

# What the nodes import from the share: the trainer, and the staging code the Azure staging
# task runs.
SCRIPT_PACKAGES = ["training", "backends"]
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
def stage_data(
    config: PipelineConfig, cluster: Cluster, run_id: str, output_prefix: str
) -> dict[str, Any]:
    started = time.perf_counter()
    logger = get_run_logger()
    pinned = listing_blob(output_prefix)  # what the data gate validated: staged exactly
    if config.target == "local":
        container = container_client(config.data, config.retries.storage_retries)
        listing = parse_listing(
            cluster.outputs.download_blob(pinned).readall(), pinned, config.data.prefix
        )
        report = stage(
            container,
            config.data.prefix,
            config.nfs.local_dir / "data",
            pack_image_size(config),
            listing=listing,
        )
    else:
        # A fresh task id per attempt: a Batch task id cannot be reused within its job.
        spec = staging_task(config, f"stage-{run_id}-{task_run.run_count}", output_prefix)
        result = cluster.run_task(spec, logger.info)
        uploaded = _staging_report(cluster, output_prefix)
        if result.exit_code != 0:
            why = f": {uploaded['error']}" if uploaded and uploaded.get("error") else ""
            raise RuntimeError(f"staging task {spec.id} exited with {result.exit_code}{why}")
        if uploaded is None:
            raise RuntimeError(f"staging task {spec.id} uploaded no staging.json")
        report = uploaded
    shards = report["shards"]
    logger.info(
        "data: %d downloaded (%d bytes), %d unchanged, %d deleted; version %s; shards %s%s",
        len(report["downloaded"]),
        report["bytes_downloaded"],
        report["skipped"],
        len(report["deleted"]),
        report["data_version"],
        shards["action"],
        f" ({shards['reason']})" if shards.get("reason") else "",
    )
    return step_record(
        "stage-data",
        started,
        bool(report["downloaded"] or report["deleted"] or shards["action"] == "packed"),
        downloaded=len(report["downloaded"]),
        unchanged=report["skipped"],
        deleted=len(report["deleted"]),
        bytes=report["bytes_downloaded"],
        files=report["total_files"],
        data_version=report["data_version"],
        shards=shards,
    )


def _staging_report(cluster: Cluster, output_prefix: str) -> dict[str, Any] | None:
    """The staging task's report (uploaded on failure too, then holding the error)."""
    from azure.core.exceptions import ResourceNotFoundError

    try:
        data = cluster.outputs.download_blob(f"{output_prefix}/staging.json").readall()
    except ResourceNotFoundError:
        return None
    report = json.loads(data)
    return report if isinstance(report, dict) else None


@task(name="build-image", cache_policy=NONE)
def build_image(config: PipelineConfig) -> dict[str, Any]:
    started = time.perf_counter()
    logger = get_run_logger()
    result = factory.build_image(config, logger.info)
    logger.info("image %s: %s", result.reference, result.reason)
    return step_record(
        "build-image", started, result.built, image=result.reference, reason=result.reason
    )


@task(
    name="ensure-pool",
    cache_policy=NONE,
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=5),
)
def ensure_pool(config: PipelineConfig, cluster: Cluster) -> dict[str, Any]:
    started = time.perf_counter()
    info = cluster.ensure_pool()
    get_run_logger().info(
        "pool %s ready: %s",
        config.pool.id,
        info.get("action") or ("created" if info["created"] else "already there"),
    )
    return step_record("ensure-pool", started, bool(info["created"]), **info)


@task(name="release-pool", cache_policy=NONE)
def release_pool(cluster: Cluster) -> dict[str, Any]:
    started = time.perf_counter()
    info = cluster.release()
    get_run_logger().info("pool %s released (was %s)", info["pool"], info["was"])
    return step_record("release-pool", started, True, **info)
