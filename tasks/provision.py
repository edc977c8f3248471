"""Steps 2 to 5, run concurrently once the data gate has passed: upload the scripts, stage the
data, build the image, ensure the pool. Where staging runs is the target's to say (on Azure it
is a task on the pool, so there it waits for the pool and the scripts); the flow asks it."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import get_run_logger
from prefect.runtime import task_run
from prefect.tasks import exponential_backoff

from backends.cluster import Cluster
from backends.share import collect_files
from backends.target import PROJECT_ROOT, Target
from core.run import Run
from tasks.steps import Done, step

# What the nodes import from the share: the trainer, and the staging code the Azure staging
# task runs.
SCRIPT_PACKAGES = ["common", "imagedata", "training", "staging"]
# Storage faults (throttling, resets) are usually gone within seconds: 2, 4, 8 s.
TRANSIENT_BACKOFF = exponential_backoff(backoff_factor=2)


@dataclass(frozen=True)
class StagedData:
    """What the training data on the pool is now."""

    version: str  # a hash of the staged files: what the trainer and the scorer read
    files: int
    downloaded: int
    unchanged: int


@step("upload-scripts", retries=3, retry_delay_seconds=TRANSIENT_BACKOFF)
def upload_scripts(target: Target) -> Done[str]:
    """The code version: a hash of every file uploaded."""
    report = target.share().upload(collect_files(PROJECT_ROOT, SCRIPT_PACKAGES))
    get_run_logger().info(
        "scripts: %d uploaded, %d unchanged", len(report.uploaded), report.unchanged
    )
    return Done(
        bool(report.uploaded),
        report.digest,
        {
            "uploaded": len(report.uploaded),
            "unchanged": report.unchanged,
            "code_version": report.digest,
        },
    )


@step("stage-data", retries=3, retry_delay_seconds=TRANSIENT_BACKOFF)
def stage_data(target: Target, cluster: Cluster, run: Run) -> Done[StagedData]:
    """Exactly the listing the data gate pinned in the run's outputs."""
    logger = get_run_logger()
    # A fresh task id per attempt: a Batch task id cannot be reused within its job.
    report = target.stage(
        cluster, run.output_prefix, f"stage-{run.id}-{task_run.run_count}", logger.info
    )
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
    staged = StagedData(
        report["data_version"], report["total_files"], len(report["downloaded"]), report["skipped"]
    )
    return Done(
        bool(
            report["downloaded"]
            or report["deleted"]
            or report.get("removed")  # left by a killed sync: the folder changed
            or shards["action"] == "packed"
        ),
        staged,
        {
            "downloaded": staged.downloaded,
            "unchanged": staged.unchanged,
            "deleted": len(report["deleted"]),
            "removed": len(report.get("removed", [])),
            "bytes": report["bytes_downloaded"],
            "files": staged.files,
            "data_version": staged.version,
            "shards": shards,
        },
    )


@step("build-image")
def build_image(target: Target) -> Done[str]:
    """The image reference the pool runs."""
    logger = get_run_logger()
    result = target.build_image(logger.info)
    logger.info("image %s: %s", result.reference, result.reason)
    return Done(
        result.built, result.reference, {"image": result.reference, "reason": result.reason}
    )


@step("ensure-pool", retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=5))
def ensure_pool(cluster: Cluster) -> Done[None]:
    info = cluster.ensure_pool()
    get_run_logger().info(
        "pool %s ready: %s",
        info["pool"],
        info.get("action") or ("created" if info["created"] else "already there"),
    )
    return Done(bool(info["created"]), None, info)


@step("release-pool")
def release_pool(cluster: Cluster) -> Done[None]:
    info = cluster.release()
    get_run_logger().info("pool %s released (was %s)", info["pool"], info["was"])
    return Done(True, None, info)
