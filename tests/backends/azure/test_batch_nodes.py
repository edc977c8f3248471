"""Multi-instance tasks on the fake Batch service run on emulated nodes, as Batch runs them.

Through the real azure-batch client and the project's Batch backend: the coordination command
runs on every node and all must exit 0 before the application command runs on the primary only;
a subtask that fails fails the task, which the service retries up to ``maxTaskRetryCount``; the
subtasks, their states and exit codes are listed by ``list_subtasks``, and each node keeps the
subtask's stdout.txt and stderr.txt in the task's directory.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.azure.batch import BatchCluster
from backends.taskspec import TaskSpec
from tests.backends.azure.test_batch import ready_cluster
from tests.fakes.node import PoolNodes
from tests.nodes_helpers import copy_scripts, require_emulated_nodes

# Each command leaves a mark on NFS named for the node it ran on, and what it saw.
MARK = (
    'echo "$(hostname) master=$AZ_BATCH_IS_CURRENT_NODE_MASTER"'
    ' > "$AZ_BATCH_NODE_MOUNTS_DIR/nfs/{what}-$AZ_BATCH_NODE_ID"'
)


def _bash(script: str) -> str:
    return f"/bin/bash -c {shlex.quote(script)}"


@pytest.fixture
def two_node_pool(
    fake_azure_account: Any, tmp_path: Path
) -> Iterator[tuple[BatchCluster, PoolNodes]]:
    require_emulated_nodes()
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=2")
    batch = fake_azure_account.batch
    nodes = [(n["id"], n["ipAddress"]) for n in batch.nodes[config.pool.id]]
    with PoolNodes(tmp_path / "pool", nodes, tmp_path / "nfs", copy_scripts) as pool:
        pool.attach(batch)
        yield cluster, pool


def _spec(coordination: str, retries: int = 0) -> TaskSpec:
    return TaskSpec(
        id="mi-check",
        command_line=_bash(MARK.format(what="app") + "; echo application done"),
        instances=2,
        coordination_command=_bash(coordination),
        max_retries=retries,
    )


def test_coordination_on_every_node_then_the_application_on_the_primary(
    two_node_pool: tuple[BatchCluster, PoolNodes], tmp_path: Path
) -> None:
    cluster, pool = two_node_pool
    lines: list[str] = []
    spec = _spec(MARK.format(what="coord") + "; echo coordinated on $AZ_BATCH_NODE_ID")
    result = cluster.run_task(spec, lines.append)

    assert result.exit_code == 0 and result.attempts == 1
    nfs = tmp_path / "nfs"
    marks = {p.name: p.read_text().strip() for p in nfs.iterdir() if p.is_file()}
    assert marks == {
        "coord-tvmps_0000d": "tvmps_0000d master=true",
        "coord-tvmps_0001d": "tvmps_0001d master=false",
        "app-tvmps_0000d": "tvmps_0000d master=true",
    }
    # The order Batch runs them in: both coordination commands, then the application.
    assert [node for node, _ in pool.commands] == ["tvmps_0000d", "tvmps_0001d", "tvmps_0000d"]
    assert "application done" in "\n".join(lines)  # the primary's stdout, streamed
    (sub,) = cluster.client.list_subtasks(cluster.job_id(spec), spec.id)
    assert (sub.id, sub.state, sub.exit_code, sub.result) == (1, "completed", 0, "success")
    assert sub.node_info.node_id == "tvmps_0001d"
    root = sub.node_info.task_root_directory
    assert root == f"workitems/{cluster.job_id(spec)}/job-1/{spec.id}"
    stdout = pool.node("tvmps_0001d").root / root / "stdout.txt"
    assert stdout.read_text().strip() == "coordinated on tvmps_0001d"
    assert sub.start_time is not None and sub.end_time is not None


def test_a_failing_subtask_fails_the_task_and_batch_retries_it(
    two_node_pool: tuple[BatchCluster, PoolNodes], tmp_path: Path
) -> None:
    cluster, pool = two_node_pool
    lines: list[str] = []
    failing = (
        'if [ "$AZ_BATCH_IS_CURRENT_NODE_MASTER" != true ]; then echo "no GPU here" >&2; exit 3; fi'
    )
    spec = _spec(failing, retries=1)
    result = cluster.run_task(spec, lines.append)

    assert result.exit_code == 3
    assert result.attempts == 2  # retried once by the service (maxTaskRetryCount=1)
    assert not list((tmp_path / "nfs").glob("app-*"))  # the application command never ran
    assert sum(1 for line in lines if "subtask 1 on tvmps_0001d: completed (exit 3)" in line) >= 1
    (sub,) = cluster.client.list_subtasks(cluster.job_id(spec), spec.id)
    assert (sub.state, sub.exit_code, sub.result) == ("completed", 3, "failure")
    assert sub.failure_info is not None and sub.failure_info.code == "FailureExitCode"
    stderr = pool.node("tvmps_0001d").root / sub.node_info.task_root_directory / "stderr.txt"
    assert stderr.read_text().strip() == "no GPU here"
    assert [command for _, command in pool.commands].count(spec.command_line) == 0
