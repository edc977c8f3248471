"""Multi-instance tasks on the fake Batch service run on emulated nodes, as Batch runs them.

Through the real azure-batch client and the project's Batch backend: the coordination command
runs on every node and all must exit 0 before the application command runs on the primary only;
a subtask that fails fails the task, which the service retries up to ``maxTaskRetryCount``; the
subtasks, their states and exit codes are listed by ``list_subtasks``, and each node keeps the
subtask's stdout.txt and stderr.txt in the task's directory.
"""

from __future__ import annotations

import shlex
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.azure.batch import BatchCluster
from backends.taskspec import TaskSpec, training_task
from imagedata.make_images import write_digits
from tests.backends.azure.test_batch import ready_cluster
from tests.fakes.node import PoolNodes
from tests.fakes.scheduled_events import ScheduledEvents
from tests.nodes_helpers import copy_scripts, require_emulated_nodes
from tests.reliability import report
from training.checkpoint import list_checkpoints

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


NOTICE_SECONDS = 8.0  # Azure gives at least 30 s; the trainer acts within a few


def test_a_preempted_spot_node_resumes_from_its_emergency_checkpoint(
    fake_azure_account: Any, tmp_path: Path, horovodrun: Path
) -> None:
    """A Spot node preempted mid-epoch, through the real SDK, the project's Batch backend and
    launcher, on an emulated node: the service posts a Preempt event to the node's Scheduled
    Events endpoint, the trainer (2 ranks) writes an emergency checkpoint inside the epoch, the
    node is taken (every process on it killed), and the service requeues the task without
    counting a retry. It starts again on the new VM, with a new stdout.txt, from the newest
    checkpoint: that one, or an epoch's end that came before the node went (training goes on
    during the notice): the work lost is under the notice's seconds, not an epoch's."""
    require_emulated_nodes()
    batch = fake_azure_account.batch
    with ScheduledEvents() as events:
        config, cluster = ready_cluster(
            tmp_path,
            "pool.dedicated_nodes=0",
            "pool.low_priority_nodes=1",
            "pool.processes_per_node=2",
            f"pool.scheduled_events_url={events.url()}",
            "training.model=cnn",
            "training.epochs=4",
            "training.batch_size=4",
            "training.timeline=false",
            "training.checkpoint_minutes=10",  # the interval never ends here: notices only
        )
        batch.scheduled_events = events
        nodes = [(n["id"], n["ipAddress"]) for n in batch.nodes[config.pool.id]]
        write_digits(tmp_path / "nfs" / "data", test_fraction=0.2, seed=0, per_class=250)
        with PoolNodes(tmp_path / "pool", nodes, tmp_path / "nfs", copy_scripts) as pool:
            pool.attach(batch)
            spec = training_task(config, "train-spot", "spotkey", "runs/spot")
            lines: list[str] = []
            out: list[Any] = []
            runner = threading.Thread(
                target=lambda: out.append(cluster.run_task(spec, lines.append)), daemon=True
            )
            runner.start()
            checkpoints = tmp_path / "nfs" / "checkpoints" / "spotkey"
            deadline = time.monotonic() + 600
            while not list(checkpoints.glob("checkpoint-*.pt")):  # training is under way
                assert runner.is_alive() and time.monotonic() < deadline, lines[-20:]
                time.sleep(0.05)
            noticed = time.time()
            batch.preempt(config.pool.id, recover_after=2, notice_seconds=NOTICE_SECONDS)
            taken = time.time()
            states = {
                path: torch.load(path, map_location="cpu", weights_only=True)
                for _, path in list_checkpoints(checkpoints)
            }
            runner.join(timeout=600)
    assert out and out[0].exit_code == 0, lines[-40:]
    newest = next(iter(states))  # when the node went
    notified = [p for p, s in states.items() if s["reason"].startswith("preemption: Preempt")]
    assert len(notified) == 1, {p.name: s["reason"] for p, s in states.items()}
    emergency = notified[0]
    state = states[emergency]
    assert state["batch"] > 0, emergency.name  # inside an epoch
    assert noticed < state["saved_at"] < taken
    # Nothing newer than the emergency checkpoint but an epoch's end (training went on).
    assert newest == emergency or states[newest]["batch"] == 0, newest.name
    result = out[0]
    assert result.attempts == 1 and result.preemptions == 1  # a requeue is not a retry
    task = batch.tasks[(cluster.job_id(spec), spec.id)]
    assert task.execution["retryCount"] == 0 and task.starts == 2
    assert any("was requeued (a node was preempted" in line for line in lines)
    why = " (written on a notice: Preempt event" if newest == emergency else ": starting at epoch"
    resumed = f"resuming from {newest.name}{why}"
    assert any(resumed in line for line in lines), lines[-40:]
    lost = taken - states[newest]["saved_at"]
    report.record(
        "training",
        f"a Spot node preempted mid-epoch, Preempt notice {NOTICE_SECONDS:g} s ahead "
        "(2 ranks, emulated Batch node, fake Batch service)",
        "emergency checkpoint inside the epoch; task requeued (retryCount 0); resumed from it "
        "on the new VM; model produced",
        checkpoint=newest.name,
        seconds_of_work_lost=round(lost, 2),
        seconds_from_notice_to_checkpoint=round(state["saved_at"] - noticed, 2),
    )
