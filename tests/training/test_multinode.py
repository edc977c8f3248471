"""Training across emulated Batch nodes: prepare_node.sh on every node, launch.sh on the primary.

Each node is a host of its own (network, host name, hosts file, processes; tests/fakes/hosts.py)
with an eth0 on a shared bridge, the NFS folder shared and the scripts share mounted, and the
variables Batch sets for a multi-instance task. Every task runs in the training image, as on
Batch: the cpu variant of docker/Dockerfile, built and pushed to the local registry once per
content, pulled by the nodes, one container per node and task (tests/fakes/container.py), so
the sshd, horovodrun, torchrun and every rank are the image's, and what it lacks fails here.
The nodes have Ubuntu's default hosts file (the node's own name on 127.0.1.1), read-only, so
prepare_node.sh cannot change it: the setting under which Horovod's ranks told their peers to
connect to loopback (rank 1 died with ``connect [127.0.1.1]:<port>``) until its Gloo
process-set context got the pinned interface.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from imagedata.make_images import write_digits
from tests.conftest import LOSS_LOG_ARGS, first_step_losses
from tests.fakes.container import ImagePuller
from tests.fakes.node import PoolNodes, TaskRun
from tests.nodes_helpers import (
    JOB,
    NODES,
    copy_scripts,
    listen_on,
    metrics,
    push_with_file_deleted,
    require_emulated_nodes,
    run_task,
    training_spec,
)

pytestmark = pytest.mark.usefixtures("horovodrun")

LOSS_LOG = f"training.extra_args={list(LOSS_LOG_ARGS)}"


def output(run: TaskRun) -> str:
    """What the primary's application command printed (the trainer logs on stderr)."""
    return run.primary.stdout() + run.primary.stderr()


@pytest.fixture(scope="module")
def pool(
    tmp_path_factory: pytest.TempPathFactory, training_image: str, image_puller: ImagePuller
) -> Iterator[PoolNodes]:
    require_emulated_nodes()
    root = tmp_path_factory.mktemp("pool")
    write_digits(root / "nfs" / "data", test_fraction=0.25, seed=0, per_class=None)
    with PoolNodes(
        root, NODES, root / "nfs", copy_scripts, read_only_hosts=True, images=image_puller
    ) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def two_nodes(pool: PoolNodes, training_image: str) -> TaskRun:
    """2 nodes x 2 processes, with what a dead node of an earlier run left on NFS."""
    nfs = pool.nfs_dir
    (nfs / ".retrain-ssh.lock").mkdir(exist_ok=True)  # the lock older scripts took, never freed
    stale = nfs / ".retrain-ssh" / JOB / "train-2x2"
    stale.mkdir(parents=True, exist_ok=True)
    (stale / "authorized_keys").write_text("ssh-ed25519 AAAA-an-earlier-attempts-key\n")
    run = run_task(pool, training_spec(2, 2, LOSS_LOG), image=training_image)
    assert run.exit_code == 0, run.primary.stdout()[-3000:] + run.primary.stderr()[-3000:]
    return run


def test_two_nodes_train_as_one_job(two_nodes: TaskRun, pool: PoolNodes) -> None:
    m = metrics(two_nodes)
    assert m["world_size"] == 4
    digests = m["weights_digest_per_rank"]
    assert len(digests) == 4 and len(set(digests)) == 1  # every rank holds the same weights
    assert m["test_accuracy"] > 0.6  # chance is 0.1
    assert (
        "launch: 4 processes on 2 node(s): 10.211.0.4:2,10.211.0.5:2 (horovodrun)"
        in two_nodes.primary.stdout()
    )
    # Every node prepared itself with the image's Python (this machine has none there), and
    # the ranks horovodrun started over SSH on the other node found it too.
    assert not Path("/opt/venv").exists()
    for sub in two_nodes.subtasks:
        assert "python /opt/venv/bin/python" in sub.stdout(), sub.stdout()
    # The second node's ranks came in over its own sshd, with the key the primary made.
    secondary = two_nodes.subtasks[1]
    log = (secondary.task_dir / "shared" / ".retrain-ssh" / "sshd.log").read_text()
    assert "Accepted publickey for root from 10.211.0.4" in log
    assert secondary.exit_code == 0 and secondary.state == "completed"


def test_the_result_matches_a_single_node_run(
    two_nodes: TaskRun, pool: PoolNodes, training_image: str
) -> None:
    single = run_task(pool, training_spec(1, 4, LOSS_LOG), image=training_image)
    assert single.exit_code == 0, single.primary.stderr()[-3000:]
    one, two = metrics(single), metrics(two_nodes)
    assert one["world_size"] == two["world_size"] == 4
    assert "resuming from" not in output(single)  # it trained: nothing of the other run's
    # Same data, seed and world size: the first steps may differ only by the order of floating
    # point sums (later ones, and the final accuracy, may drift apart chaotically).
    assert first_step_losses(output(single)) == pytest.approx(
        first_step_losses(output(two_nodes)), abs=2e-3
    )


def test_names_resolving_to_loopback_do_not_reach_the_ranks(
    two_nodes: TaskRun, pool: PoolNodes
) -> None:
    for node in pool:
        assert node.run(["getent", "hosts", node.name]).stdout.split()[:1] == ["127.0.1.1"]
    errors = "".join(s.stderr() for s in two_nodes.subtasks)
    assert "tvmps_0001 does not resolve to 10.211.0.5 and /etc/hosts cannot be written" in errors


def test_keys_stay_out_of_home_and_nfs_holds_only_a_public_key(two_nodes: TaskRun) -> None:
    for sub in two_nodes.subtasks:
        assert not (sub.task_dir / ".ssh").exists()  # $HOME was the task directory
    nfs_keys = list((two_nodes.primary.node.root / "fsmounts" / "nfs" / ".retrain-ssh").rglob("*"))
    names = {p.name for p in nfs_keys if p.is_file()}
    assert names == {"authorized_keys"}
    private = two_nodes.primary.task_dir / "shared" / ".retrain-ssh" / "id_ed25519"
    assert private.is_file()


def test_a_node_without_the_interface_fails_preparation_naming_itself(
    pool: PoolNodes, training_image: str
) -> None:
    spec = training_spec(2, 1)
    run = run_task(pool, spec, image=training_image, RETRAIN_NETWORK_INTERFACE="ib0")
    assert run.exit_code == 1
    failed = next(s for s in run.subtasks if s.node_id == run.failed_node)
    message = f"prepare_node: node {failed.node_id}: no interface ib0 (this node has: eth0, lo)"
    assert message in failed.stderr()
    assert "launch:" not in run.primary.stdout()  # the application command never ran


def test_sockets_reach_across_nodes_only_through_eth0(pool: PoolNodes) -> None:
    first, second = pool
    server = listen_on(second, 5999)
    try:
        probe = "import socket,sys; socket.create_connection((sys.argv[1], 5999), 3); print('ok')"
        assert first.run([sys.executable, "-c", probe, second.address]).stdout.strip() == "ok"
        refused = first.run([sys.executable, "-c", probe, "127.0.0.1"])
        assert refused.returncode != 0  # the other node is not this node's loopback
    finally:
        server.kill()
        second.kill_processes("5999")
    assert socket.gethostname() not in {n.name for n in pool}


def test_ddp_trains_across_nodes_with_one_torchrun_per_node(
    two_nodes: TaskRun, pool: PoolNodes, training_image: str
) -> None:
    """The same task with training.engine=ddp: one torchrun per node meets at the rendezvous
    the primary hosts, and takes the steps Horovod took on the same nodes and data."""
    run = run_task(pool, training_spec(2, 2, "training.engine=ddp", LOSS_LOG), image=training_image)
    out = run.primary.stdout()
    assert run.exit_code == 0, out[-3000:] + run.primary.stderr()[-3000:]
    m = metrics(run)
    assert m["world_size"] == 4 and m["args"]["engine"] == "ddp"
    assert len(set(m["weights_digest_per_rank"])) == 1
    assert first_step_losses(output(run)) == pytest.approx(
        first_step_losses(output(two_nodes)), abs=2e-3
    )
    assert "(torchrun per node, rendezvous 10.211.0.4:29400)" in out
    # Both nodes' exit statuses were collected; the second node's torchrun came in over SSH.
    assert "launch: node 10.211.0.4 exited 0" in out and "launch: node 10.211.0.5 exited 0" in out
    log = (run.subtasks[1].task_dir / "shared" / ".retrain-ssh" / "sshd.log").read_text()
    assert "Accepted publickey for root from 10.211.0.4" in log


def test_ddp_task_fails_when_a_node_fails(pool: PoolNodes, training_image: str) -> None:
    """The primary's torchrun cannot host the rendezvous (its port is taken): the task fails
    with that node's status, and the other node's torchrun is stopped, not left waiting."""
    first, _second = pool
    holder = listen_on(first, 29411)
    try:
        spec = training_spec(2, 1, "training.engine=ddp")
        run = run_task(
            pool,
            spec,
            image=training_image,
            RETRAIN_MAX_RESTARTS="0",
            RETRAIN_RENDEZVOUS_PORT="29411",
        )
    finally:
        holder.kill()
        first.kill_processes("29411")
    out = run.primary.stdout()
    assert run.exit_code not in (0, None), out[-3000:]
    assert "launch: node 10.211.0.4 exited " in out and "launch: node 10.211.0.5 exited " in out
    assert "launch: node 10.211.0.4 exited 0" not in out
    assert "test accuracy" not in out


def test_a_coordination_sshd_that_did_not_outlive_its_container_fails_the_launch(
    pool: PoolNodes, training_image: str
) -> None:
    """The pipeline assumes a node's coordination command and the application command share
    the task's container, so the sshd prepare_node.sh leaves running serves the primary's
    ranks. Were each coordination command's container gone when it exits (Batch does not say),
    the launch fails at once, naming the node and the assumption, instead of hanging."""
    pool.coordination_in_own_container = True
    try:
        run = run_task(pool, training_spec(2, 1), image=training_image)
    finally:
        pool.coordination_in_own_container = False
    assert run.exit_code == 1
    assert all(s.exit_code == 0 for s in run.subtasks)  # every node prepared itself
    stderr = run.primary.stderr()
    assert "launch: node 10.211.0.5: no sshd answers on port 2222" in stderr, stderr
    assert "sshd outlives the coordination command" in stderr
    assert "launch: 2 processes" not in run.primary.stdout()  # no rank was started


def test_an_image_without_sshd_fails_on_the_node_naming_what_it_lacks(
    pool: PoolNodes, training_image: str
) -> None:
    """What the image lacks fails here, as it would on Batch, and says what: an image whose
    openssh-server is gone (the same image, one layer more that deletes /usr/sbin/sshd,
    pushed beside it)."""
    lacking = push_with_file_deleted(training_image, "/usr/sbin/sshd", "-no-sshd")
    run = run_task(pool, training_spec(2, 1), image=lacking)
    assert run.exit_code == 1
    failed = next(s for s in run.subtasks if s.node_id == run.failed_node)
    assert (
        f"prepare_node: node {failed.node_id}" in failed.stderr()
        and "no sshd in the image (/usr/sbin/sshd: openssh-server)" in failed.stderr()
    ), failed.stderr()
    assert "launch:" not in run.primary.stdout()  # the application command never ran
