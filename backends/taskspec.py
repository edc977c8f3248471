"""The task specs the pipeline submits: one description, run by Azure Batch or the local cluster.

A spec holds exactly what Batch needs (command lines, environment, output-file patterns, limits),
so the local cluster executes the very command lines that would go to Azure. Commands refer to
storage only through Batch's own variables (``$AZ_BATCH_NODE_MOUNTS_DIR``,
``$AZ_BATCH_TASK_WORKING_DIR``), which each cluster sets for its nodes. Those fixed variables are
the only thing the node's shell expands: every value that comes from a config is quoted, so a
``$(...)`` or a space in it reaches the program as the characters the user wrote. No secret is
ever placed in a command line or in the plain environment.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from core.config import PipelineConfig
from core.init_from import parse_init_from
from staging.listing import listing_blob
from training.args import settings_argv
from training.preemption import URL_VARIABLE

NFS_MOUNT = "nfs"  # relative mount paths under $AZ_BATCH_NODE_MOUNTS_DIR
SHARE_MOUNT = "scripts"
OUTPUT_DIR = "outputs"  # relative to the task's working directory
STAGING_LISTING = "data-listing.json"  # the pinned listing, in the staging task's working dir


@dataclass
class OutputSpec:
    """Batch's OutputFile semantics: with a wildcard, ``destination`` is a blob folder and each
    file keeps its path below the part of the pattern before the first wildcard; without one,
    ``destination`` is the blob name itself."""

    pattern: str  # relative to the task working dir
    destination: str
    # Batch's uploadCondition, spelled as the service spells it: tasksuccess, taskfailure or
    # taskcompletion (logs are wanted from failures too).
    condition: str = "tasksuccess"


@dataclass
class ResourceSpec:
    blob: str  # blob path in the output container
    file_path: str  # relative to the task working dir


@dataclass
class TaskSpec:
    id: str
    command_line: str
    instances: int = 1
    coordination_command: str | None = None
    environment: dict[str, str] = field(default_factory=dict)
    outputs: list[OutputSpec] = field(default_factory=list)
    resources: list[ResourceSpec] = field(default_factory=list)
    max_wall_clock_seconds: int = 6 * 3600
    max_retries: int = 0  # on Batch the service retries; the local cluster runs once
    reads_training_data: bool = False  # the cluster then provides RETRAIN_DATA_URL


# What a task process inherits from the machine it runs on, besides the spec's environment and
# Batch's AZ_BATCH_* variables: what a Batch node's shell (or the training image) has, nothing of
# the orchestrator's. An allow-list, because credentials come under any name (STORAGE_CONN,
# DATABASE_URL, PREFECT_API_KEY, a proxy URL with a password in it).
NODE_VARIABLES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "TERM",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "LD_LIBRARY_PATH",  # CUDA and NCCL libraries on GPU machines
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
    }
)
NODE_VARIABLE_PREFIXES = ("LC_", "HOROVOD_", "NCCL_", "GLOO_")  # locale and collective tuning


def node_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` a task on a node may see (the allow-list above)."""
    return {
        k: v
        for k, v in environ.items()
        if k in NODE_VARIABLES or k.startswith(NODE_VARIABLE_PREFIXES)
    }


BatchDirectory = Literal["AZ_BATCH_NODE_MOUNTS_DIR", "AZ_BATCH_TASK_WORKING_DIR"]
MOUNTS_DIR: BatchDirectory = "AZ_BATCH_NODE_MOUNTS_DIR"
WORKING_DIR: BatchDirectory = "AZ_BATCH_TASK_WORKING_DIR"


def node_path(variable: BatchDirectory, *parts: str) -> str:
    """One shell word for a path below a directory Batch gives each node.

    The variable is double-quoted (its value may hold spaces, as a local work_dir may) and is the
    only part the shell expands; the rest is quoted literally, whatever characters it holds.
    """
    return f'"${variable}"' + shlex.quote("/" + "/".join(parts))


# Batch does not expand variables in environment settings, so the scripts' import path is set
# inside the command, where the node's shell expands it.
PYTHONPATH = f"export PYTHONPATH={node_path(MOUNTS_DIR, SHARE_MOUNT)}"


def _bash(script: str) -> str:
    """Batch runs command lines without a shell; variables need one."""
    return f"/bin/bash -c {shlex.quote(script)}"


STOP_REQUESTS = "stop-requests"  # a folder of the scripts share


def stop_request(task_id: str) -> str:
    """The share file that asks the training task ``task_id`` to stop at its next checkpoint:
    the share is the one place both the orchestrator (Files API) and every node (its mount)
    reach; NFS is the nodes' alone."""
    return f"{STOP_REQUESTS}/{task_id}"


def training_task(
    config: PipelineConfig, task_id: str, training_key: str, output_prefix: str
) -> TaskSpec:
    """The trainer across nodes x processes under the configured engine (horovodrun or one
    torchrun per node, started by launch.sh), on data and checkpoints in NFS (retries resume).
    It removes the checkpoint folders of other keys that no run will resume (the policy in
    ``training/checkpoint.py``; ``nfs.checkpoint_days``)."""
    paths = [
        "--data-dir",
        node_path(MOUNTS_DIR, NFS_MOUNT, "data"),
        "--output-dir",
        node_path(WORKING_DIR, OUTPUT_DIR),
        "--checkpoint-dir",
        node_path(MOUNTS_DIR, NFS_MOUNT, "checkpoints", training_key),
        "--prune-checkpoint-folders",
        shlex.quote(f"{config.nfs.checkpoint_days:g}"),
        # The orchestrator's stop request (the budget's) reaches every node through the share.
        "--stop-file",
        node_path(MOUNTS_DIR, SHARE_MOUNT, stop_request(task_id)),
        # The best epoch is the one the promotion would have chosen.
        "--val-metric",
        shlex.quote(config.promotion.metric),
    ]
    values = [*settings_argv(config.training), *config.training.extra_args]
    # Every config value is quoted, extra_args included: only the paths above expand.
    words = [*paths, *(shlex.quote(v) for v in values)]
    launch = node_path(MOUNTS_DIR, SHARE_MOUNT, "training", "launch.sh")
    prepare = node_path(MOUNTS_DIR, SHARE_MOUNT, "training", "prepare_node.sh")
    start = starting_weights(config, output_prefix)
    return TaskSpec(
        id=task_id,
        command_line=_bash(
            f"{PYTHONPATH}; {start.place}bash {launch} {' '.join([*words, *start.words])}"
        ),
        resources=start.resources,
        instances=config.pool.nodes,
        coordination_command=_bash(f"bash {prepare}"),
        environment={
            "RETRAIN_PROCESSES_PER_NODE": str(config.pool.processes_per_node),
            # The launcher to start; the trainer's --engine (from the same setting) checks it.
            "RETRAIN_ENGINE": config.training.engine,
            "PYTHONUNBUFFERED": "1",
            **_preemption_notices(config),
        },
        outputs=[
            OutputSpec(f"{OUTPUT_DIR}/**/*", output_prefix),
            OutputSpec("../std*.txt", f"{output_prefix}/logs", "taskcompletion"),
        ],
        max_retries=config.retries.training_attempts - 1,
    )


def _preemption_notices(config: PipelineConfig) -> dict[str, str]:
    """Where the trainer watches for a Preempt notice (training/preemption.py): on pools with
    Spot nodes only, as a dedicated node is never preempted."""
    if config.pool.low_priority_nodes == 0:
        return {}
    return {URL_VARIABLE: config.pool.scheduled_events_url}


INIT_FROM_DIR = "init-from"  # below the task's working dir and the NFS folder
# A run's model in the output container: the run id is recorded with what a training started from.
_RUN_MODEL = re.compile(r"(?:^|/)runs/([^/]+)/model\.pt$")


@dataclass(frozen=True)
class StartSpec:
    """How the training task reaches ``training.init_from``: the trainer's words, the blob it
    downloads and the command that puts that file where every node sees it."""

    words: list[str] = field(default_factory=list)
    resources: list[ResourceSpec] = field(default_factory=list)
    place: str = ""  # a shell command ending in "&& ", run before the launcher


def starting_weights(config: PipelineConfig, output_prefix: str) -> StartSpec:
    """The trainer's ``--init-from`` for the run's resolved ``training.init_from``
    (``core/init_from.py``).

    A file below NFS is read where it is. A blob of the output container reaches the primary
    node as a resource file, and is copied from there into the NFS folder (written under a
    temporary name, then renamed) before the launcher starts: rank 0 may run on any node, and
    every node mounts NFS. A value no run has resolved yet (``champion``, ``data:``, a URL, as
    ``--plan`` shows a config) names the blob as a placeholder."""
    value = config.training.init_from
    if value is None:
        return StartSpec()
    start = parse_init_from(value)
    if start.kind == "nfs":
        return StartSpec(["--init-from", node_path(MOUNTS_DIR, NFS_MOUNT, *start.path.split("/"))])
    blob = start.path if start.kind == "output" else f"{{{start} resolved by the run}}"
    name = blob.rsplit("/", 1)[-1]
    digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
    downloaded = node_path(WORKING_DIR, INIT_FROM_DIR, name)
    folder = node_path(MOUNTS_DIR, NFS_MOUNT, INIT_FROM_DIR, digest)
    target = node_path(MOUNTS_DIR, NFS_MOUNT, INIT_FROM_DIR, digest, name)
    partial = node_path(MOUNTS_DIR, NFS_MOUNT, INIT_FROM_DIR, digest, f".{name}.partial")
    place = (
        f"mkdir -p {folder} && cp -f {downloaded} {partial}.$$ && mv -f {partial}.$$ {target} && "
    )
    words = ["--init-from", target]
    if run := _RUN_MODEL.search(blob):
        words += ["--init-from-run", shlex.quote(run.group(1))]
    return StartSpec(words, [ResourceSpec(blob, f"{INIT_FROM_DIR}/{name}")], place)


# Settings that change no weight of the trained model, each with the value the digest takes
# for it: a Horovod timeline records the run; checkpoints inside an epoch resume it exactly.
NOT_SHAPING_THE_MODEL: dict[str, Any] = {"timeline": False, "checkpoint_minutes": None}


def training_task_digest(config: PipelineConfig) -> str:
    """The training task as this code would submit it for ``config``, as a digest: its command
    line, coordination command, environment and instances, with fixed names for what is each
    run's own (the task id, the checkpoint key, the output prefix) and the settings of
    :data:`NOT_SHAPING_THE_MODEL` left out. A change here that changes what the nodes run (an
    argument given to the trainer, an environment setting) changes it, as a change of the
    trainer's own code changes the scripts' digest."""
    shaped = config.model_copy(
        update={"training": replace(config.training, **NOT_SHAPING_THE_MODEL)}
    )
    spec = training_task(shaped, "task", "key", "outputs")
    shape = {
        "command_line": spec.command_line,
        "coordination_command": spec.coordination_command,
        # Where a Spot node reads its notices changes no weight either.
        "environment": {k: v for k, v in spec.environment.items() if k != URL_VARIABLE},
        "instances": spec.instances,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def pack_image_size(config: PipelineConfig) -> int:
    """The side in pixels staging packs shards at (the trainer's input size, decided by the one
    function the trainer uses), or 0 with packing switched off."""
    return config.training.input_size() if config.nfs.shards else 0


def staging_task(config: PipelineConfig, task_id: str, output_prefix: str) -> TaskSpec:
    """Blob -> NFS on a pool node (Azure): the data never streams through the orchestrator.

    The data gate's pinned listing (in the run's output prefix) reaches the node as a resource
    file, like the model the scorer reads: exactly the validated blobs are staged. The report
    is uploaded on failure too: it then says why, naming the blob.
    """
    script = (
        f"{PYTHONPATH}; mkdir -p {OUTPUT_DIR} && python -m staging.task "
        f"--prefix {shlex.quote(config.data.dataset.prefix)} "
        f"--dest {node_path(MOUNTS_DIR, NFS_MOUNT, 'data')} --report {OUTPUT_DIR}/staging.json "
        f"--listing {STAGING_LISTING} --pack-image-size {pack_image_size(config)}"
    )
    return TaskSpec(
        id=task_id,
        command_line=_bash(script),
        environment={"PYTHONUNBUFFERED": "1"},
        resources=[ResourceSpec(listing_blob(output_prefix), STAGING_LISTING)],
        outputs=[
            OutputSpec(
                f"{OUTPUT_DIR}/staging.json", f"{output_prefix}/staging.json", "taskcompletion"
            ),
            OutputSpec("../std*.txt", f"{output_prefix}/logs-staging", "taskcompletion"),
        ],
        max_wall_clock_seconds=4 * 3600,
        max_retries=config.retries.storage_retries,
        reads_training_data=True,
    )


def scoring_task(
    task_id: str,
    model_blob: str,
    output_prefix: str,
    name: str = "score",
    known_classes_only: bool = False,
) -> TaskSpec:
    """The scorer on the held-out split, on a node that sees the same NFS data: ``<name>.json``
    on success; ``<name>.error.json`` (the reason) when the scorer refuses the model or data.
    ``known_classes_only``: a model whose classes differ from the data's is scored on the
    classes it knows (the champion, against a version that added or removed a class)."""
    script = (
        f"{PYTHONPATH}; mkdir -p {OUTPUT_DIR} && python -m training.score --model model.pt "
        f"--data-dir {node_path(MOUNTS_DIR, NFS_MOUNT, 'data')} --split test "
        f"--output {OUTPUT_DIR}/{shlex.quote(name)}.json "
        f"--error-output {OUTPUT_DIR}/{shlex.quote(name)}.error.json"
        + (" --known-classes-only" if known_classes_only else "")
    )
    return TaskSpec(
        id=task_id,
        command_line=_bash(script),
        environment={"PYTHONUNBUFFERED": "1"},
        resources=[ResourceSpec(model_blob, "model.pt")],
        # A wildcard: whichever of the two exists is uploaded, and a missing one is no error.
        outputs=[OutputSpec(f"{OUTPUT_DIR}/{name}*.json", output_prefix, "taskcompletion")],
        max_wall_clock_seconds=3600,
    )
