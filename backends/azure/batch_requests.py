"""The request bodies the pipeline sends to Azure Batch, built from a config and a task spec.

Pure functions: the Batch cluster sends them and ``--plan`` prints them, so what a user reviews
is exactly what goes on the wire. ``wire`` serializes a model the way the SDK does (REST JSON,
camelCase, read-only fields dropped).
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from backends.azure.access import NodeAccess
from backends.taskspec import NFS_MOUNT, SHARE_MOUNT, TaskSpec
from core.config import PipelineConfig

if TYPE_CHECKING:
    from azure.batch import models as batch_models

# Sizes with an "r" among their feature letters have RDMA (InfiniBand): ND96isr_H100_v5,
# ND96asr_v4, HB120rs_v3, NC24rs_v3. NC24ads_A100_v4 has none.
_SIZE = re.compile(r"^Standard_[A-Z]+\d+([a-z]*)", re.IGNORECASE)


# The NCCL topology files of the Azure HPC images, by ND family. The image's /etc/nccl.conf names
# the file for the host; inside the container NCCL sees neither unless they are mounted, and then
# falls back to a topology it discovers itself (wrong on these VMs: slower all-reduce).
_TOPOLOGY = (
    (re.compile(r"^Standard_ND\d+a\w*_(A100_)?v4$", re.I), "/opt/microsoft/ndv4-topo.xml"),
    (re.compile(r"^Standard_ND\d+\w*_H(100|200)_v5$", re.I), "/opt/microsoft/ndv5-topo.xml"),
)
CREDENTIALS_KEY = "credentials-sha256"  # pool metadata: which secrets the pool was created with
# blobfuse's mount of the scripts container: names, attributes and misses not cached (a script
# the orchestrator replaces is seen by the next task), readable by the task's container.
BLOBFUSE_OPTIONS = "-o attr_timeout=0 -o entry_timeout=0 -o negative_timeout=0 -o allow_other"


def has_infiniband(config: PipelineConfig) -> bool:
    if config.pool.infiniband != "auto":
        return config.pool.infiniband == "on"
    match = _SIZE.match(config.pool.vm_size)
    return bool(match and "r" in match.group(1).lower())


def nccl_topology(config: PipelineConfig) -> str | None:
    """The host topology file NCCL must read on this pool, or None."""
    wanted = config.pool.nccl_topo_file
    if not wanted or not has_infiniband(config):
        return None
    if wanted != "auto":
        return wanted
    for pattern, path in _TOPOLOGY:
        if pattern.match(config.pool.vm_size):
            return path
    return None


def wire(model: Any) -> dict[str, Any]:
    """A request body as it goes on the wire (the model's public ``as_dict``, with
    azure-core's encoder for dates and durations)."""
    from azure.core.serialization import AzureJSONEncoder

    body = model.as_dict(exclude_readonly=True)
    return dict(json.loads(json.dumps(body, cls=AzureJSONEncoder)))


class HasIdentity(Protocol):
    @property
    def identity(self) -> str | None: ...


def _identity(access: HasIdentity) -> batch_models.BatchNodeIdentityReference | None:
    from azure.batch import models as m

    return m.BatchNodeIdentityReference(resource_id=access.identity) if access.identity else None


def credentials_digest(share_key: str, registry_password: str | None) -> str:
    """A digest of the secrets a pool is created with. Batch never returns them, so the pool's
    metadata carries this instead: a rotated key or password shows as a different digest."""
    material = f"{share_key}\n{registry_password or ''}".encode()
    return hashlib.sha256(material).hexdigest()[:32]


def _scripts_mount(
    config: PipelineConfig, access: HasIdentity, share_key: str
) -> batch_models.MountConfiguration:
    """The scripts: a Blob container through blobfuse as the nodes' identity (no key), or an
    Azure Files share over SMB, which takes the account key (Batch's AzureFileShareConfiguration
    has no identity: its accountKey is required)."""
    from azure.batch import models as m

    share = config.share
    url = str(share.account_url).rstrip("/")
    account = url.split("//", 1)[1].split(".", 1)[0]
    if share.on_blob:
        return m.MountConfiguration(
            azure_blob_file_system_configuration=m.AzureBlobFileSystemConfiguration(
                account_name=account,
                container_name=share.name,
                identity_reference=_identity(access),
                relative_mount_path=SHARE_MOUNT,
                blobfuse_options=BLOBFUSE_OPTIONS,
            )
        )
    return m.MountConfiguration(
        azure_file_share_configuration=m.AzureFileShareConfiguration(
            account_name=account,
            azure_file_url=f"{url}/{share.name}",
            account_key=share_key,
            relative_mount_path=SHARE_MOUNT,
            mount_options="-o vers=3.0,dir_mode=0755,file_mode=0755,serverino",
        )
    )


def pool_body(
    config: PipelineConfig,
    image: str,
    access: HasIdentity,
    share_key: str,
    registry_password: str | None,
) -> batch_models.BatchPoolCreateOptions:
    """A container-capable GPU pool with inter-node communication and both mounts."""
    from azure.batch import models as m

    pool, registry = config.pool, config.image.registry
    registry_ref = m.ContainerRegistryReference(
        registry_server=registry,
        username=config.image.registry_username,
        password=registry_password,
        identity_reference=None if registry_password else _identity(access),
    )
    autoscale = bool(pool.autoscale_formula)
    return m.BatchPoolCreateOptions(
        id=pool.id,
        vm_size=pool.vm_size,
        virtual_machine_configuration=m.VirtualMachineConfiguration(
            image_reference=m.BatchVmImageReference(
                publisher=pool.image_publisher,
                offer=pool.image_offer,
                sku=pool.image_sku,
                version="latest",
            ),
            node_agent_sku_id=pool.node_agent_sku_id,
            container_configuration=m.BatchContainerConfiguration(
                type="dockerCompatible",
                container_image_names=[image],  # pulled once per node, before any task
                container_registries=[registry_ref],
            ),
            os_disk=m.BatchOsDisk(disk_size_gb=pool.os_disk_gb) if pool.os_disk_gb else None,
        ),
        target_dedicated_nodes=None if autoscale else pool.dedicated_nodes,
        target_low_priority_nodes=None if autoscale else pool.low_priority_nodes,
        enable_auto_scale=autoscale,
        auto_scale_formula=pool.autoscale_formula,
        auto_scale_evaluation_interval=timedelta(minutes=5) if autoscale else None,
        resize_timeout=timedelta(minutes=pool.start_timeout_minutes),
        enable_inter_node_communication=True,  # multi-instance tasks need it
        task_slots_per_node=1,  # one training process group owns a node's GPUs
        network_configuration=(
            m.NetworkConfiguration(subnet_id=pool.subnet_id) if pool.subnet_id else None
        ),
        mount_configuration=[
            m.MountConfiguration(
                nfs_mount_configuration=m.NfsMountConfiguration(
                    source=str(config.nfs.source),
                    relative_mount_path=NFS_MOUNT,
                    mount_options=config.nfs.mount_options,
                )
            ),
            _scripts_mount(config, access, share_key),
        ],
        metadata=[
            m.BatchMetadataItem(name="created-by", value="retrain-pipeline"),
            m.BatchMetadataItem(
                name=CREDENTIALS_KEY, value=credentials_digest(share_key, registry_password)
            ),
        ],
    )


def resize_body(
    dedicated: int, low_priority: int, requeue: bool = False
) -> batch_models.BatchPoolResizeOptions:
    """A resize. Nodes it removes let their running task end (``taskcompletion``), except in a
    resize to zero or with ``requeue``: then the task is stopped and queued again (it resumes
    from its checkpoint), and the nodes go at once. The Spot fallback requeues: with
    ``taskcompletion`` the Spot nodes would stay until the training ended, beside the new
    dedicated nodes billed idle, and the resize would not complete meanwhile."""
    from azure.batch import models as m

    keep_running = bool(dedicated + low_priority) and not requeue
    return m.BatchPoolResizeOptions(
        target_dedicated_nodes=dedicated,
        target_low_priority_nodes=low_priority,
        node_deallocation_option="taskcompletion" if keep_running else "requeue",
    )


def job_id(pool_id: str, task_id: str) -> str:
    """The job a task runs in: one job per task, named for the pool and the task, cut to the
    64 characters a Batch job id may have."""
    return f"{pool_id}-{task_id}"[:64]


def job_body(config: PipelineConfig, job_id: str) -> batch_models.BatchJobCreateOptions:
    """One job per task. Created with ``noaction``: a job told to terminate when all its tasks
    are complete, and created before its task, has no task yet and may complete at once, and
    then refuses the task (409). ``job_completion_body`` turns termination on once the task is
    in."""
    from azure.batch import models as m

    return m.BatchJobCreateOptions(
        id=job_id,
        pool_info=m.BatchPoolInfo(pool_id=config.pool.id),
        all_tasks_complete_mode="noaction",
        metadata=[m.BatchMetadataItem(name="created-by", value="retrain-pipeline")],
    )


def job_completion_body() -> batch_models.BatchJobUpdateOptions:
    """Once its task exists, the job ends when the task does, so nothing lingers on the pool."""
    from azure.batch import models as m

    return m.BatchJobUpdateOptions(all_tasks_complete_mode="terminatejob")


def network_interface(config: PipelineConfig) -> str:
    """The interface a multi-node job's ranks talk over (launch.sh pins Horovod, Gloo, NCCL's
    bootstrap and OpenMPI to it): the same name on every node of the pool."""
    return config.pool.network_interface or ("ib0" if has_infiniband(config) else "eth0")


def _nccl_environment(config: PipelineConfig) -> dict[str, str]:
    if has_infiniband(config):
        env = {"NCCL_IB_DISABLE": "0", "NCCL_IB_PCI_RELAXED_ORDERING": "1", "UCX_TLS": "rc"}
        topology = nccl_topology(config)
        if topology:
            env["NCCL_TOPO_FILE"] = topology
        return env
    return {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}


def container_run_options(config: PipelineConfig) -> str:
    # Host networking: Horovod's ranks talk to each other on the nodes' own addresses.
    options = "--network=host --ipc=host --ulimit memlock=-1 --ulimit stack=67108864"
    if has_infiniband(config):
        options += " --device=/dev/infiniband --cap-add=IPC_LOCK"
        topology = nccl_topology(config)
        if topology:  # the host's NCCL settings and topology, read-only
            folder = topology.rsplit("/", 1)[0]
            options += f" -v /etc/nccl.conf:/etc/nccl.conf:ro -v {folder}:{folder}:ro"
    return options


def task_body(
    config: PipelineConfig, spec: TaskSpec, image: str, access: NodeAccess
) -> batch_models.BatchTaskCreateOptions:
    from azure.batch import models as m

    identity = _identity(access)
    environment = {**spec.environment, **_nccl_environment(config), "RETRAIN_PYTHON": "python"}
    environment["RETRAIN_NETWORK_INTERFACE"] = network_interface(config)
    if spec.reads_training_data:
        environment["RETRAIN_DATA_URL"] = access.data_url
        if access.identity_client_id:
            environment["AZURE_CLIENT_ID"] = access.identity_client_id
    outputs = [
        m.OutputFile(
            file_pattern=out.pattern,
            destination=m.OutputFileDestination(
                container=m.OutputFileBlobContainerDestination(
                    container_url=access.output_url,
                    path=out.destination,
                    identity_reference=identity,
                )
            ),
            upload_options=m.OutputFileUploadConfiguration(upload_condition=out.condition),
        )
        for out in spec.outputs
    ]
    resources = [
        m.ResourceFile(
            http_url=access.blob_url(res.blob), file_path=res.file_path, identity_reference=identity
        )
        for res in spec.resources
    ]
    multi = None
    if spec.coordination_command:  # every multi-node spec prepares its nodes
        multi = m.MultiInstanceSettings(
            number_of_instances=spec.instances,
            coordination_command_line=spec.coordination_command,
        )
    return m.BatchTaskCreateOptions(
        id=spec.id,
        command_line=spec.command_line,
        container_settings=m.BatchTaskContainerSettings(
            image_name=image,
            container_run_options=container_run_options(config),
            working_directory="taskWorkingDirectory",
        ),
        resource_files=resources or None,
        output_files=outputs,
        environment_settings=[
            m.EnvironmentSetting(name=k, value=v) for k, v in sorted(environment.items())
        ],
        constraints=m.BatchTaskConstraints(
            max_wall_clock_time=timedelta(seconds=spec.max_wall_clock_seconds),
            max_task_retry_count=spec.max_retries,
            retention_time=timedelta(days=2),
        ),
        # Pool-wide admin auto-user: MPI/SSH between the nodes and InfiniBand devices need it.
        user_identity=m.UserIdentity(
            auto_user=m.AutoUserSpecification(scope="pool", elevation_level="admin")
        ),
        multi_instance_settings=multi,
    )


def arm_pool(config: PipelineConfig, image: str, identity: str) -> dict[str, Any]:
    """The pool as Azure Resource Manager creates it (``Microsoft.Batch/batchAccounts/pools``),
    from the same :func:`pool_body` that ensure-pool sends and ``--plan`` prints: only the
    shape differs (ARM nests the image under ``deploymentConfiguration`` and the node counts
    under ``scaleSettings``). The nodes' identity is attached beside these properties and is
    the only credential the pool has: the scripts container is mounted with it, so no account
    key reaches ARM, Batch or a node."""
    if not config.share.on_blob:
        raise ValueError(
            "the pool through ARM mounts the scripts from a Blob container with the nodes' "
            "identity: share.account_url must be https://<account>.blob.core.windows.net (an "
            "Azure Files share needs the account key on the pool)"
        )

    class _Identity:
        def __init__(self, resource_id: str) -> None:
            self.identity: str | None = resource_id

    body = wire(pool_body(config, image, _Identity(identity), "", None))
    vm = body["virtualMachineConfiguration"]
    container = vm["containerConfiguration"]
    scale: dict[str, Any]
    if body.get("enableAutoScale"):
        scale = {
            "autoScale": {
                "formula": body["autoScaleFormula"],
                "evaluationInterval": body["autoScaleEvaluationInterval"],
            }
        }
    else:
        scale = {
            "fixedScale": {
                "targetDedicatedNodes": body["targetDedicatedNodes"],
                "targetLowPriorityNodes": body["targetLowPriorityNodes"],
                "resizeTimeout": body["resizeTimeout"],
            }
        }
    machine: dict[str, Any] = {
        "imageReference": vm["imageReference"],
        "nodeAgentSkuId": vm["nodeAgentSKUId"],
        "containerConfiguration": {
            # The same enum, spelt in ARM's Pascal case (BatchManagement's ContainerType).
            "type": container["type"][:1].upper() + container["type"][1:],
            "containerImageNames": container["containerImageNames"],
            "containerRegistries": container["containerRegistries"],
        },
    }
    if "osDisk" in vm:
        machine["osDisk"] = vm["osDisk"]
    properties: dict[str, Any] = {
        "vmSize": body["vmSize"],
        "deploymentConfiguration": {"virtualMachineConfiguration": machine},
        "scaleSettings": scale,
        "interNodeCommunication": "Enabled" if body["enableInterNodeCommunication"] else "Disabled",
        "taskSlotsPerNode": body["taskSlotsPerNode"],
        "mountConfiguration": body["mountConfiguration"],
        # The credentials digest is left out: the pool holds no secret.
        "metadata": [m for m in body["metadata"] if m["name"] != CREDENTIALS_KEY],
    }
    if "networkConfiguration" in body:
        properties["networkConfiguration"] = body["networkConfiguration"]
    return {"name": body["id"], "properties": properties}
