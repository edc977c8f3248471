"""``--plan``: every request body one Azure run would send to Batch, without calling Azure.

The bodies come from the same builders the Batch cluster uses, serialized the way the SDK puts
them on the wire, so the plan is what would be sent. Secrets are not fetched: where one would
go, the plan names the Prefect Secret block it would come from, and SAS tokens are described
(permissions, lifetime) instead of signed.
"""

from __future__ import annotations

from typing import Any

from backends.azure.access import AccessIssuer
from backends.azure.batch_requests import (
    container_run_options,
    has_infiniband,
    job_body,
    job_completion_body,
    job_id,
    nccl_topology,
    pool_body,
    resize_body,
    task_body,
    wire,
)
from backends.image import content_tag
from backends.taskspec import scoring_task, staging_task, training_task
from core.config import PipelineConfig
from core.run import output_prefix as run_output_prefix

RUN_ID = "{run_id}"


class PlanError(ValueError):
    """The config describes no Azure run to plan."""


def _container_url(location: Any) -> str:
    base = (location.account_url or f"${location.connection_string_env}").rstrip("/")
    return f"{base}/{location.container}"


def build_plan(config: PipelineConfig, root: Any) -> dict[str, Any]:
    from backends.target import image_reference

    if config.target != "azure":
        raise PlanError(f"--plan describes an Azure run; the config has target {config.target}")
    image = image_reference(config)
    access = AccessIssuer(config)
    data_url, output_url = _container_url(config.data), _container_url(config.output)
    share_key = (
        ""  # a Blob container is mounted with the nodes' identity: no key
        if config.share.on_blob
        else f"<secret from Prefect Secret block {config.share.account_key_secret!r}>"
    )
    password = (
        f"<secret from Prefect Secret block {config.image.registry_password_secret!r}>"
        if config.image.registry_password_secret
        else None
    )
    output_prefix = run_output_prefix(config.output.prefix, RUN_ID)
    specs = [
        staging_task(config, f"stage-{RUN_ID}-1", output_prefix),
        training_task(config, f"train-{RUN_ID}", "{training_key}", output_prefix),
        scoring_task(f"score-{RUN_ID}", f"{output_prefix}/model.pt", output_prefix),
    ]
    pool_id = config.pool.id
    pool_settings = wire(pool_body(config, image, access, share_key, password))
    create: dict[str, Any] = {
        "step": "ensure-pool",
        "when": "the pool does not exist",
        "method": "POST",
        "path": "/pools",
        "body": pool_settings,
    }
    if access.identity:  # the Batch API cannot attach an identity: the run stops instead
        create = {
            "step": "ensure-pool",
            "when": "the pool does not exist",
            "action": "fail: a pool whose nodes use a managed identity is created through Azure "
            "Resource Manager, once, with these settings and the identity (docs/azure.md)",
            "pool_settings": pool_settings,
        }
    requests: list[dict[str, Any]] = [
        create,
        {
            "step": "ensure-pool",
            "when": "the pool exists with fewer nodes",
            "method": "POST",
            "path": f"/pools/{pool_id}/resize",
            "body": wire(resize_body(config.pool.dedicated_nodes, config.pool.low_priority_nodes)),
        },
    ]
    for spec in specs:
        job = job_id(pool_id, spec.id)
        step = spec.id.split("-", 1)[0]
        requests.append(
            {
                "step": step,
                "method": "POST",
                "path": "/jobs",
                "body": wire(job_body(config, job)),
            }
        )
        requests.append(
            {
                "step": step,
                "method": "POST",
                "path": f"/jobs/{job}/tasks",
                "body": wire(
                    task_body(config, spec, image, access.describe(spec, data_url, output_url))
                ),
            }
        )
        requests.append(
            {
                "step": step,
                "when": "once the task exists: the job then ends with it",
                "method": "PATCH",
                "path": f"/jobs/{job}",
                "body": wire(job_completion_body()),
            }
        )
    release: dict[str, Any] = (
        {"method": "DELETE", "path": f"/pools/{pool_id}"}
        if config.pool.release == "delete"
        else {"method": "POST", "path": f"/pools/{pool_id}/resize", "body": wire(resize_body(0, 0))}
    )
    requests.append({"step": "release-pool", "when": "always, in a finally", **release})
    return {
        "target": "azure",
        "batch_account": config.azure.batch_account_url,
        "resources": {
            "data": {
                "container": _container_url(config.data),
                "prefix": config.data.prefix,
                "version": config.data.version
                or "the newest complete version below the prefix, chosen when the run starts "
                "(the whole prefix when it holds no versions)",
                "use": "read (gate on the orchestrator, staging on a node)",
            },
            "outputs": {"container": _container_url(config.output), "action": "create if missing"},
            "share": {
                "url": f"{config.share.account_url}/{config.share.name}",
                "action": "create if missing; upload changed scripts",
            },
            "nfs": {"source": config.nfs.source, "mounted_at": "$AZ_BATCH_NODE_MOUNTS_DIR/nfs"},
            "image": {
                "reference": image,
                "tag": content_tag(root),
                "builder": config.image.builder,
                "action": "build and push unless the tag exists",
            },
            "pool": {
                "id": pool_id,
                "vm_size": config.pool.vm_size,
                "nodes": config.pool.nodes,
                "infiniband": has_infiniband(config),
                "container_run_options": container_run_options(config),
                "nccl_topo_file": nccl_topology(config),
                # Docker keeps the pulled image there (None: the VM image's own size).
                "os_disk_gb": config.pool.os_disk_gb,
                "action": "create if missing, resize if smaller, then "
                f"{config.pool.release} at the end",
            },
            "node_access": "managed identity" if access.identity else "SAS tokens",
        },
        "requests": requests,
    }
