"""Faults across emulated Batch nodes: the rank on the second node killed mid-epoch, and a node
whose sshd port is taken. The task must fail within a bounded time (no hang), Batch's retry of
it (the same job and task on the same nodes) must resume from the newest checkpoint on the
shared folder, losing at most the epoch in progress."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from imagedata.make_images import write_digits
from tests.fakes.node import PoolNodes
from tests.nodes_helpers import (
    JOB,
    NODES,
    copy_scripts,
    listen_on,
    metrics,
    require_emulated_nodes,
    run_task,
    task_body,
    training_key,
    training_spec,
)
from tests.reliability import report, trials
from training.checkpoint import list_checkpoints

pytestmark = pytest.mark.usefixtures("horovodrun")

EPOCHS = 4
RESUMED = re.compile(r"resuming from checkpoint-(\d+)\.pt")


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolNodes]:
    require_emulated_nodes()
    root = tmp_path_factory.mktemp("pool")
    # Few images: epochs of a second or two are enough to kill one midway and resume.
    write_digits(root / "nfs" / "data", test_fraction=0.25, seed=0, per_class=40)
    with PoolNodes(root, NODES, root / "nfs", copy_scripts) as nodes:
        yield nodes


def _newest(checkpoints: Path) -> tuple[int, float]:
    found = list_checkpoints(checkpoints)
    return (found[0][0], found[0][1].stat().st_mtime) if found else (0, 0.0)


@pytest.mark.parametrize("trial", trials(default=1))
def test_rank_killed_on_the_second_node_fails_the_task_and_the_retry_resumes(
    trial: int, pool: PoolNodes
) -> None:
    rng = random.Random(200 + trial)
    settings = (f"training.epochs={EPOCHS}", f"training.seed={trial}")
    spec = training_spec(2, 1, *settings)
    spec.id = f"train-kill-{trial}"
    checkpoints = pool.nfs_dir / "checkpoints" / training_key(2, 1, *settings)
    for old in checkpoints.glob("checkpoint-*.pt"):  # each trial trains from the start
        old.unlink()
    run = pool.start(task_body(spec), JOB)
    deadline = time.monotonic() + 300
    while _newest(checkpoints)[0] < 2:
        assert not run.done.is_set(), run.primary.stderr()[-3000:]
        assert time.monotonic() < deadline, "no second checkpoint within 300 s"
        time.sleep(0.05)
    epoch_seconds = _newest(checkpoints)[1] - (checkpoints / "checkpoint-1.pt").stat().st_mtime
    time.sleep(rng.uniform(0.0, 0.6 * epoch_seconds))  # a random point of the next epoch
    at_kill, checkpoint_time = _newest(checkpoints)
    killed_at = time.time()
    killed = pool.node("tvmps_0001").kill_processes("training.train")
    started = time.monotonic()
    assert killed, "no rank was running on the second node"
    code = run.wait(timeout=300)  # a hang fails here
    seconds_to_fail = time.monotonic() - started
    assert at_kill < EPOCHS
    assert code != 0, "a job that lost a rank must fail, not succeed"

    retry = run_task(pool, spec)  # Batch retries the same task on the same nodes
    output = retry.primary.stdout() + retry.primary.stderr()
    assert retry.exit_code == 0, output[-3000:]
    resumed = int(RESUMED.search(output).group(1))  # type: ignore[union-attr]
    lost_epochs = (at_kill + 1) - resumed  # the epoch in progress at the kill, redone
    assert resumed >= at_kill and 0 <= lost_epochs <= 1
    assert metrics(retry)["world_size"] == 2
    # Ubuntu's hosts file (the node's name on 127.0.1.1) was writable here: preparation pinned
    # each node's name to its own address.
    for node in pool:
        assert node.run(["getent", "hosts", node.name]).stdout.split()[:1] == [node.address]
    assert [e["epoch"] for e in metrics(retry)["epochs"]] == list(range(1, EPOCHS + 1))
    report.record(
        "training",
        f"kill the rank on the second of 2 nodes (trial {trial + 1})",
        "task failed; retry on the same nodes resumed; model produced",
        newest_checkpoint_at_kill=at_kill,
        resumed_from=resumed,
        epochs_redone=lost_epochs,
        seconds_of_work_lost=round(killed_at - checkpoint_time, 2),
        seconds_to_fail=round(seconds_to_fail, 1),
        first_exit_code=code,
    )


def test_a_taken_ssh_port_fails_preparation_naming_the_node(pool: PoolNodes) -> None:
    second = pool.node("tvmps_0001")
    holder = listen_on(second, 2222)
    started = time.monotonic()
    run = run_task(pool, training_spec(2, 1))
    seconds = time.monotonic() - started
    holder.kill()
    assert run.exit_code == 1
    assert run.failed_node == "tvmps_0001"
    err = run.subtasks[1].stderr()
    assert "prepare_node: node tvmps_0001 (10.211.0.5): sshd cannot serve port 2222" in err
    assert "Address already in use" in err
    assert "launch:" not in run.primary.stdout()  # the application command never ran
    message = next(line for line in err.splitlines() if "sshd cannot serve" in line)
    report.record(
        "training",
        "sshd port taken on the second node",
        "preparation failed on that node; training never started",
        message=message,
        seconds_to_fail=round(seconds, 1),
    )
