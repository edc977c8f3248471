"""The Batch cluster through the real azure-batch client against the fake Batch service.

Assertions are on what the SDK serialized (the REST bodies) and on behaviour: pool created,
reused, resized or refused; nodes that fail to start; a task retried by the service; the job
terminated on cancellation; the pool released. Output files go to Azurite through the SAS the
task carries, so a token without the right permissions fails here as on Azure.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from backends.azure.batch import BatchCluster, Polling, PoolError, TaskFailedError
from backends.azure.batch_requests import pool_body, wire
from backends.blob import container_client
from backends.target import AzureTarget, image_reference
from backends.taskspec import TaskSpec, scoring_task, staging_task, training_task
from core.config import ConfigError, PipelineConfig
from tests.azure_helpers import azure_config
from tests.fakes.batch import Attempt, wait_until
from tests.reliability import report

FAST = Polling(first=0.01, factor=1.0, cap=0.01, lro_seconds=0)
SHARE_KEY, REGISTRY_PASSWORD = "ZmlsZXMta2V5LXZhbHVl", "acr-token-password-value"


def make_cluster(config: PipelineConfig) -> BatchCluster:
    """The cluster the target builds, with the pool secrets the Secret blocks would hold."""
    container_client(config.data, create=True)
    password = REGISTRY_PASSWORD if config.image.registry_password_secret else None
    return AzureTarget(config).cluster(lambda: (SHARE_KEY, password), FAST)


def ready_cluster(tmp_path: Path, *overrides: str) -> tuple[PipelineConfig, BatchCluster]:
    """A config on the fakes and its cluster, with the pool already ensured."""
    config = azure_config(tmp_path, *overrides)
    cluster = make_cluster(config)
    cluster.ensure_pool()
    return config, cluster


def _sas_permissions(url: str) -> str:
    return parse_qs(urlparse(url).query)["sp"][0]


def test_missing_pool_is_created_with_what_multi_instance_tasks_need(
    fake_azure_account, tmp_path: Path
) -> None:
    config = azure_config(
        tmp_path,
        "pool.vm_size=Standard_ND96asr_v4",
        "pool.dedicated_nodes=2",
        "pool.low_priority_nodes=1",
        "nfs.source=10.0.1.4:/export/retrain",
    )
    info = make_cluster(config).ensure_pool()

    assert info["action"] == "created" and info["nodes"] == 3
    (body,) = fake_azure_account.batch.bodies("POST", "/pools")
    assert body["id"] == config.pool.id and body["vmSize"] == "Standard_ND96asr_v4"
    assert body["enableInterNodeCommunication"] is True and body["taskSlotsPerNode"] == 1
    assert (body["targetDedicatedNodes"], body["targetLowPriorityNodes"]) == (2, 1)
    vm = body["virtualMachineConfiguration"]
    assert vm["nodeAgentSKUId"] == "batch.node.ubuntu 22.04"
    container = vm["containerConfiguration"]
    assert container["type"] == "dockerCompatible"
    assert container["containerImageNames"] == [image_reference(config)]
    assert container["containerRegistries"] == [
        {
            "registryServer": "retrainacr.azurecr.io",
            "username": "retrain-pull",
            "password": REGISTRY_PASSWORD,
        }
    ]
    nfs, files = body["mountConfiguration"]
    assert nfs == {
        "nfsMountConfiguration": {
            "source": "10.0.1.4:/export/retrain",
            "relativeMountPath": "nfs",
            "mountOptions": "-o vers=4.1,hard,nconnect=8",
        }
    }
    share = files["azureFileShareConfiguration"]
    assert (
        share["azureFileUrl"] == f"https://retrainfiles.file.core.windows.net/{config.share.name}"
    )
    assert share["relativeMountPath"] == "scripts" and share["accountKey"] == SHARE_KEY
    assert body["networkConfiguration"]["subnetId"].endswith("/subnets/batch")
    assert "enableAutoScale" in body and body["enableAutoScale"] is False


def test_autoscale_formula_replaces_fixed_counts(fake_azure_account, tmp_path: Path) -> None:
    formula = "$TargetDedicatedNodes = $PendingTasks.GetSample(1) > 0 ? 2 : 0;"
    config = azure_config(tmp_path, f"pool.autoscale_formula={formula}")
    body = wire(pool_body(config, "img", make_cluster(config).access, "k", None))
    assert body["enableAutoScale"] is True and body["autoScaleFormula"] == formula
    assert body["autoScaleEvaluationInterval"] == "PT05M00S"
    assert "targetDedicatedNodes" not in body and "targetLowPriorityNodes" not in body


def test_existing_pool_is_reused_or_grown_never_shrunk(fake_azure_account, tmp_path: Path) -> None:
    batch = fake_azure_account.batch
    config = azure_config(tmp_path, "pool.dedicated_nodes=2")
    cluster = make_cluster(config)
    small = wire(pool_body(config, cluster.image, cluster.access, SHARE_KEY, REGISTRY_PASSWORD))
    batch.add_pool({**small, "targetDedicatedNodes": 1})

    grown = cluster.ensure_pool()
    assert grown["action"] == "resized" and grown["nodes"] == 2
    assert batch.bodies("POST", "/pools") == [] or len(batch.bodies("POST", "/pools")) == 0
    (resize,) = batch.bodies("POST", f"/pools/{config.pool.id}/resize")
    assert resize["targetDedicatedNodes"] == 2 and resize["targetLowPriorityNodes"] == 0

    again = cluster.ensure_pool()
    assert again["action"] == "reused"
    assert len(batch.bodies("POST", f"/pools/{config.pool.id}/resize")) == 1  # no second resize


def test_pool_with_different_immutable_settings_is_refused(
    fake_azure_account, tmp_path: Path
) -> None:
    batch = fake_azure_account.batch
    config = azure_config(tmp_path)
    cluster = make_cluster(config)
    existing = wire(pool_body(config, cluster.image, cluster.access, SHARE_KEY, None))
    existing["metadata"] = []  # made by hand, not by this pipeline: never deleted by it
    batch.add_pool(
        {**existing, "vmSize": "Standard_NC6s_v3", "enableInterNodeCommunication": False}
    )

    with pytest.raises(PoolError) as err:
        cluster.ensure_pool()
    message = str(err.value)
    assert config.pool.id in message and "vm_size" in message and "standard_nc6s_v3" in message
    assert "enable_inter_node_communication" in message
    assert "not created by this pipeline" in message
    assert batch.bodies("POST", "/pools") == []
    assert batch.bodies("POST", f"/pools/{config.pool.id}/resize") == []


def test_nodes_that_fail_to_start_fail_the_step_with_their_errors(
    fake_azure_account, tmp_path: Path
) -> None:
    batch = fake_azure_account.batch
    batch.node_state = "unusable"
    batch.node_errors = [{"code": "NfsMountFailed", "message": "mount.nfs: Connection timed out"}]
    config = azure_config(tmp_path)
    with pytest.raises(PoolError) as err:
        make_cluster(config).ensure_pool()
    assert "tvmps_0000d unusable" in str(err.value)
    assert "NfsMountFailed: mount.nfs: Connection timed out" in str(err.value)


def _training_outputs() -> dict[str, bytes]:
    return {
        "outputs/model.pt": b"weights",
        "outputs/metrics.json": json.dumps({"accuracy": 0.9}).encode(),
        "outputs/tensorboard/events.out": b"tb",
    }


def test_training_task_request_streaming_and_outputs(fake_azure_account, tmp_path: Path) -> None:
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=2", "pool.processes_per_node=4")
    batch.scripts["train-"] = [
        Attempt(0, "launch: 8 processes on 2 node(s)\nepoch 1 loss 0.5\n", _training_outputs())
    ]
    spec = training_task(config, "train-run1", "key123", "runs/run1")
    lines: list[str] = []

    result = cluster.run_task(spec, lines.append)

    assert result.exit_code == 0 and result.attempts == 1
    job_id = f"{config.pool.id}-train-run1"
    (job,) = batch.bodies("POST", "/jobs")
    assert job["id"] == job_id and job["poolInfo"] == {"poolId": config.pool.id}
    assert job["onAllTasksComplete"] == "noaction"  # terminatejob only once the task is in
    (task,) = batch.bodies("POST", f"/jobs/{job_id}/tasks")
    assert task["multiInstanceSettings"]["numberOfInstances"] == 2
    assert "prepare_node.sh" in task["multiInstanceSettings"]["coordinationCommandLine"]
    assert "launch.sh" in task["commandLine"] and "--checkpoint-dir" in task["commandLine"]
    assert task["constraints"] == {
        "maxWallClockTime": "PT06H00M00S",
        "maxTaskRetryCount": 2,
        "retentionTime": "P2D",
    }
    assert task["containerSettings"]["imageName"] == image_reference(config)
    assert "--network=host" in task["containerSettings"]["containerRunOptions"]
    assert task["userIdentity"] == {"autoUser": {"scope": "pool", "elevationLevel": "admin"}}
    env = {e["name"]: e["value"] for e in task["environmentSettings"]}
    assert env["RETRAIN_PROCESSES_PER_NODE"] == "4" and env["NCCL_IB_DISABLE"] == "1"
    assert "RETRAIN_DATA_URL" not in env  # the trainer reads NFS, not Blob
    outputs = {o["filePattern"]: o for o in task["outputFiles"]}
    assert set(outputs) == {"outputs/**/*", "../std*.txt"}
    # Spelled as the spec spells them (the service refuses taskCompletion with a 400).
    assert outputs["../std*.txt"]["uploadOptions"]["uploadCondition"] == "taskcompletion"
    assert outputs["outputs/**/*"]["uploadOptions"]["uploadCondition"] == "tasksuccess"
    destination = outputs["outputs/**/*"]["destination"]["container"]
    assert destination["path"] == "runs/run1"
    assert _sas_permissions(destination["containerUrl"]) == "rcwl"
    # Streamed from stdout.txt into the caller's log, in order.
    assert "launch: 8 processes on 2 node(s)" in lines and "epoch 1 loss 0.5" in lines
    # Uploaded by the "node" to Azurite through that SAS, and listed back.
    assert result.uploaded == [
        "runs/run1/logs/stderr.txt",
        "runs/run1/logs/stdout.txt",
        "runs/run1/metrics.json",
        "runs/run1/model.pt",
        "runs/run1/tensorboard/events.out",
    ]
    assert cluster.outputs.download_blob("runs/run1/model.pt").readall() == b"weights"


def test_failed_attempt_is_retried_by_batch_and_reported(
    fake_azure_account, tmp_path: Path
) -> None:
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=1")
    batch.scripts["train-"] = [
        Attempt(1, "rank 1 killed\n"),
        Attempt(0, "resuming from checkpoint-2.pt: starting at epoch 3\n", _training_outputs()),
    ]
    lines: list[str] = []
    result = cluster.run_task(training_task(config, "train-r", "k", "runs/r"), lines.append)
    assert result.exit_code == 0 and result.attempts == 2
    assert any("attempt 2 of 3" in line for line in lines)
    assert "resuming from checkpoint-2.pt: starting at epoch 3" in lines


def test_a_hung_attempt_is_terminated_and_the_attempts_left_resume(
    fake_azure_account, tmp_path: Path
) -> None:
    """A rank stuck in a collective: epoch 1 is reported, then nothing. The deadline ends the
    attempt through the API (terminate task); Batch does not retry a terminated task, so the
    next attempt is a task of its own, which resumes from the checkpoint."""
    from backends.progress_deadline import ProgressDeadline

    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=1")
    epoch_1 = {"epoch": 1, "epochs": 3, "seconds": 0.1}
    batch.scripts["train-h-2"] = [
        Attempt(0, "resuming from checkpoint-1.pt: starting at epoch 2\n", _training_outputs())
    ]
    batch.scripts["train-h"] = [Attempt(0, f"PROGRESS {json.dumps(epoch_1)}\n", seconds=120)]
    deadline = ProgressDeadline(first_epoch_seconds=60, factor=2, floor_seconds=1)
    lines: list[str] = []

    def on_line(line: str) -> None:  # as the training step feeds it (tasks/train_and_score.py)
        lines.append(line)
        if line.startswith("PROGRESS "):
            record = json.loads(line.removeprefix("PROGRESS "))
            deadline.progress(record["epoch"], record["seconds"])

    spec = training_task(config, "train-h", "k", "runs/h")
    result = cluster.run_task(spec, on_line, deadline)
    assert result.exit_code == 0, lines
    assert result.stalls == ["no progress for 1 s after epoch 1"]
    assert result.attempts == 2
    job = cluster.job_id(spec)
    assert batch.requests.find("POST", f"/jobs/{job}/tasks/train-h/terminate")
    assert batch.tasks[(job, "train-h")].execution["failureInfo"]["code"] == "TaskEnded"
    assert "task train-h: attempt 2 of 3 as task train-h-2, from the last checkpoint" in lines
    assert "resuming from checkpoint-1.pt: starting at epoch 2" in lines
    # The second task may use only the attempts left: 3 in all, one spent.
    (second,) = batch.bodies("POST", f"/jobs/{job.replace('train-h', 'train-h-2')}/tasks")
    assert second["constraints"]["maxTaskRetryCount"] == 1
    report.record(
        "training",
        "a Batch attempt hung after epoch 1 (real SDK, fake Batch)",
        "task terminated through the API (TaskEnded); the attempts left ran as task train-h-2, "
        "which resumed from the checkpoint",
        message=result.stalls[0],
    )


def test_a_rerun_after_a_hung_attempt_follows_the_newest_attempt(
    fake_azure_account, tmp_path: Path
) -> None:
    """The step run again after the orchestrator stopped (a crash after the hung attempt was
    ended and its successor submitted): it follows the successor, train-r-2, with the
    attempts it has left, and creates nothing. Before, it followed the ended task, reported its
    TaskEnded failure as the step's end, and left train-r-2's job to run unfollowed."""
    from backends.progress_deadline import ProgressDeadline

    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=1")
    epoch_1 = {"epoch": 1, "epochs": 3, "seconds": 0.1}
    batch.scripts["train-r-2"] = [Attempt(0, "resumed\n", _training_outputs(), seconds=2.0)]
    batch.scripts["train-r"] = [Attempt(0, f"PROGRESS {json.dumps(epoch_1)}\n", seconds=120)]
    spec = training_task(config, "train-r", "k", "runs/r")
    deadline = ProgressDeadline(first_epoch_seconds=60, factor=2, floor_seconds=1)
    first: list[str] = []

    def on_line(line: str) -> None:
        first.append(line)
        if line.startswith("PROGRESS "):
            record = json.loads(line.removeprefix("PROGRESS "))
            deadline.progress(record["epoch"], record["seconds"])

    crashed = threading.Thread(target=cluster.run_task, args=(spec, on_line, deadline))
    crashed.daemon = True  # the orchestrator that stops following
    crashed.start()
    wait_until(lambda: getattr(_task(batch, config, "train-r-2"), "state", "") == "running")
    tasks_before = set(batch.tasks)

    lines: list[str] = []
    result = make_cluster(config).run_task(spec, lines.append)
    assert result.exit_code == 0, lines
    assert result.attempts == 2  # one ended as hung, one that resumed
    followed = (
        "task train-r was ended as hung; its attempts left run as task train-r-2: following it"
    )
    assert followed in lines
    assert "task train-r-2 already submitted: following it" in lines
    assert "resumed" in lines
    assert set(batch.tasks) == tasks_before  # nothing submitted again
    newest = f"{config.pool.id}-train-r-2"
    wait_until(lambda: cluster.client.get_job(newest).state == "completed")
    crashed.join(timeout=20)
    report.record(
        "training",
        "the step run again (real SDK, fake Batch) after a hung attempt was ended and its "
        "successor task submitted",
        "the re-run followed the newest attempt (train-r-2) to its end with the attempts "
        "left; nothing submitted again; its job completed",
        before_fix="followed the ended task and reported its TaskEnded failure; the "
        "successor's job was left running, followed by nobody",
    )


def test_task_that_keeps_failing_returns_its_exit_code(fake_azure_account, tmp_path: Path) -> None:
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(
        tmp_path, "pool.dedicated_nodes=1", "retries.training_attempts=2"
    )
    batch.scripts["train-"] = [Attempt(3, "bad\n")]
    lines: list[str] = []
    result = cluster.run_task(training_task(config, "train-x", "k", "runs/x"), lines.append)
    assert result.exit_code == 3 and result.attempts == 2
    assert any("FailureExitCode" in line for line in lines)
    # Logs are uploaded on failure too (taskcompletion); the model is not (tasksuccess).
    assert result.uploaded == ["runs/x/logs/stderr.txt", "runs/x/logs/stdout.txt"]


def test_scoring_task_reads_the_model_through_a_resource_file(
    fake_azure_account, tmp_path: Path
) -> None:
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=1")
    batch.scripts["score-"] = [Attempt(0, "", {"outputs/score.json": b'{"accuracy": 0.9}'})]
    result = cluster.run_task(scoring_task("score-r", "runs/r/model.pt", "runs/r"))
    (task,) = batch.bodies("POST", f"/jobs/{config.pool.id}-score-r/tasks")
    (resource,) = task["resourceFiles"]
    assert resource["filePath"] == "model.pt"
    assert urlparse(resource["httpUrl"]).path.endswith(
        f"/{config.output.container}/runs/r/model.pt"
    )
    assert "multiInstanceSettings" not in task
    assert result.uploaded == ["runs/r/score.json"]


IDENTITY = (
    "/subscriptions/s/resourceGroups/g/providers/Microsoft.ManagedIdentity/"
    "userAssignedIdentities/retrain"
)


def _identity_config(tmp_path: Path) -> PipelineConfig:
    return azure_config(
        tmp_path,
        f"azure.identity_resource_id={IDENTITY}",
        "azure.identity_client_id=11111111-2222-3333-4444-555555555555",
        "image.registry_username=null",
        "image.registry_password_secret=null",
        "pool.dedicated_nodes=1",
    )


def test_identity_pool_made_through_arm_is_used_and_no_token_is_sent(
    fake_azure_account, tmp_path: Path
) -> None:
    batch = fake_azure_account.batch
    config = _identity_config(tmp_path)
    cluster = make_cluster(config)
    # Created through Azure Resource Manager with the identity, as docs/azure.md says.
    batch.add_pool(
        wire(pool_body(config, cluster.image, cluster.access, SHARE_KEY, None)), identity=IDENTITY
    )
    assert cluster.ensure_pool()["action"] == "reused"
    batch.scripts["stage-"] = [Attempt(0, "staged\n", {"outputs/staging.json": b"{}"})]
    from backends.taskspec import staging_task

    result = cluster.run_task(staging_task(config, "stage-r-1", "runs/r"))
    assert result.exit_code == 0 and "runs/r/staging.json" in result.uploaded
    (body,) = batch.bodies("POST", f"/jobs/{config.pool.id}-stage-r-1/tasks")
    env = {e["name"]: e["value"] for e in body["environmentSettings"]}
    assert "?" not in env["RETRAIN_DATA_URL"]
    assert env["AZURE_CLIENT_ID"] == "11111111-2222-3333-4444-555555555555"
    for out in body["outputFiles"]:
        assert out["destination"]["container"]["identityReference"] == {"resourceId": IDENTITY}
    assert not any("sig=" in r.body.decode() for r in batch.requests.all() if r.body)


def test_a_pool_made_by_arm_is_used_without_reading_any_secret_block(
    fake_azure_account, tmp_path: Path
) -> None:
    """The pool `make azure-up` creates through ARM (backends/azure/batch_requests.arm_pool:
    the nodes' identity attached, the scripts container mounted with it, no key, no credentials
    digest) is reused and resized without the Prefect Secret blocks: on that path none exists.
    Before, ensure-pool read them first, and the nightly on a fresh setup failed on the missing
    block."""
    from backends.azure.access import AccessIssuer
    from backends.azure.batch import BatchCluster
    from backends.azure.batch_requests import CREDENTIALS_KEY
    from backends.azure.clients import batch_client

    batch = fake_azure_account.batch
    config = azure_config(
        tmp_path,
        f"azure.identity_resource_id={IDENTITY}",
        "azure.identity_client_id=11111111-2222-3333-4444-555555555555",
        "image.registry_username=null",
        "image.registry_password_secret=null",
        "pool.dedicated_nodes=1",
        "share.account_url=https://acct.blob.core.windows.net",
        "share.account_key_secret=null",  # the ARM path's config has no key block at all
    )
    body = wire(
        pool_body(config, make_cluster(config).image, make_cluster(config).access, "", None)
    )
    body["metadata"] = [m for m in body["metadata"] if m["name"] != CREDENTIALS_KEY]
    body["targetDedicatedNodes"] = 0  # released after the last run
    batch.add_pool(body, identity=IDENTITY)

    def no_blocks() -> tuple[str, str | None]:
        raise AssertionError("a Secret block was read for a pool made through ARM")

    from backends.target import image_reference

    outputs = container_client(config.output, create=True)
    data = container_client(config.data, create=True)
    cluster = BatchCluster(
        config,
        batch_client(config.azure),
        outputs,
        AccessIssuer(config, data, outputs),
        image_reference(config),
        no_blocks,
        FAST,
    )
    assert cluster.ensure_pool()["action"] == "resized"


def test_identity_without_a_pool_fails_with_the_arm_explanation(
    fake_azure_account, tmp_path: Path
) -> None:
    """The Batch API cannot attach an identity: no data-plane body the service would refuse."""
    batch = fake_azure_account.batch
    config = _identity_config(tmp_path)
    with pytest.raises(PoolError) as err:
        make_cluster(config).ensure_pool()
    assert "Azure Resource Manager" in str(err.value) and "azure.identity_resource_id" in str(
        err.value
    )
    assert batch.bodies("POST", "/pools") == []
    # A pool made without the identity (by the data plane) is refused the same way.
    cluster = make_cluster(config)
    plain = azure_config(tmp_path, "pool.dedicated_nodes=1", f"pool.id={config.pool.id}")
    batch.add_pool(wire(pool_body(plain, cluster.image, make_cluster(plain).access, "k", "p")))
    with pytest.raises(PoolError, match="exists without that identity"):
        cluster.ensure_pool()


def test_cancellation_terminates_the_job_and_release_resizes_to_zero(
    fake_azure_account, tmp_path: Path
) -> None:
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=2")
    batch.scripts["train-"] = [Attempt(0, "epoch 1\n", _training_outputs(), seconds=60)]
    results = []
    runner = threading.Thread(
        target=lambda: results.append(cluster.run_task(training_task(config, "train-c", "k", "p")))
    )
    runner.start()
    job_id = f"{config.pool.id}-train-c"
    deadline = time.monotonic() + 20
    while (
        batch.tasks.get((job_id, "train-c")) is None
        or batch.tasks[(job_id, "train-c")].state != "running"
    ):
        assert time.monotonic() < deadline, "the task never started"
        time.sleep(0.01)

    # What the flow's cancellation hook does, from a fresh cluster object as the hook builds.
    released = make_cluster(config).release()
    runner.join(timeout=20)

    assert released["killed_tasks"] == [job_id]
    assert batch.requests.find("POST", f"/jobs/{job_id}/terminate")
    assert results and results[0].exit_code != 0  # the task ended without success
    (resize,) = batch.bodies("POST", f"/pools/{config.pool.id}/resize")
    assert resize["targetDedicatedNodes"] == 0 and resize["targetLowPriorityNodes"] == 0
    assert batch.pools[config.pool.id]["currentDedicatedNodes"] == 0
    assert make_cluster(config).release()["killed_tasks"] == []  # twice is harmless


def test_release_can_delete_the_pool(fake_azure_account, tmp_path: Path) -> None:
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.release=delete")
    assert cluster.release()["action"] == "delete"
    assert batch.requests.find("DELETE", f"/pools/{config.pool.id}")
    assert config.pool.id not in batch.pools
    assert cluster.release()["was"] == "absent"


def _start(cluster: BatchCluster, spec: TaskSpec, lines: list[str]) -> tuple[Any, list[Any]]:
    """run_task in a thread, as the flow's task would; (thread, [result or exception])."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(cluster.run_task(spec, lines.append))
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _task(batch: Any, config: PipelineConfig, task_id: str) -> Any:
    return batch.tasks.get((f"{config.pool.id}-{task_id}", task_id))


def test_job_ends_with_its_task_not_before_it(fake_azure_account, tmp_path: Path) -> None:
    """Batch may complete an empty job with terminatejob at once; adding its task then fails
    (409). Jobs start with noaction and are set to terminatejob once their task exists."""
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=1")
    batch.scripts["score-"] = [Attempt(0, "", {"outputs/score.json": b"{}"})]
    result = cluster.run_task(scoring_task("score-q", "runs/q/model.pt", "runs/q"))
    assert result.exit_code == 0 and result.uploaded == ["runs/q/score.json"]
    job_id = f"{config.pool.id}-score-q"
    (job,) = batch.bodies("POST", "/jobs")
    assert job["onAllTasksComplete"] == "noaction"
    assert batch.bodies("PATCH", f"/jobs/{job_id}") == [{"onAllTasksComplete": "terminatejob"}]
    wait_until(lambda: cluster.client.get_job(job_id).state == "completed")


def test_a_rerun_after_an_orchestrator_crash_follows_its_task(
    fake_azure_account, tmp_path: Path
) -> None:
    """The same step, started again while its task runs or after it ended, finds the task and
    follows it: no duplicate, and the job still ends with the task."""
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=1")
    batch.scripts["train-"] = [Attempt(0, "done\n", _training_outputs(), seconds=1.0)]
    spec = training_task(config, "train-again", "k", "runs/a")
    first: list[str] = []
    crashed, _ = _start(cluster, spec, first)  # the orchestrator that will "crash"
    wait_until(lambda: getattr(_task(batch, config, "train-again"), "state", "") == "running")
    lines: list[str] = []
    result = make_cluster(config).run_task(spec, lines.append)
    assert result.exit_code == 0
    assert "task train-again already submitted: following it" in lines
    assert len(batch.tasks) == 1
    later: list[str] = []
    again = make_cluster(config).run_task(spec, later.append)  # after the job completed
    assert again.exit_code == 0 and any("has already completed" in line for line in later)
    crashed.join(timeout=20)


def test_outputs_outlive_every_attempt_of_a_long_task(fake_azure_account, tmp_path: Path) -> None:
    """Three 6-hour attempts: the last one uploads the model 18 h after submission. The SAS
    must still be valid then (Batch does not retry an upload; the model would be lost)."""
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=1")
    hours6 = 6 * 3600
    batch.scripts["train-"] = [
        Attempt(1, "out of memory\n", service_seconds=hours6),
        Attempt(1, "out of memory\n", service_seconds=hours6),
        Attempt(0, "done\n", _training_outputs(), service_seconds=hours6),
    ]
    result = cluster.run_task(training_task(config, "train-long", "k", "runs/l"))
    task = _task(batch, config, "train-long")
    assert "failureInfo" not in task.execution, task.execution.get("failureInfo")
    assert result.exit_code == 0 and result.attempts == 3
    assert "runs/l/model.pt" in result.uploaded
    (body,) = batch.bodies("POST", f"/jobs/{config.pool.id}-train-long/tasks")
    url = body["outputFiles"][0]["destination"]["container"]["containerUrl"]
    expiry = datetime.fromisoformat(parse_qs(urlparse(url).query)["se"][0].replace("Z", "+00:00"))
    assert expiry - datetime.now(UTC) > timedelta(hours=18)


def test_kept_pool_with_another_image_or_password_is_recreated(
    fake_azure_account, tmp_path: Path
) -> None:
    batch = fake_azure_account.batch
    config = azure_config(tmp_path, "pool.dedicated_nodes=1")
    cluster = make_cluster(config)
    old = "retrainacr.azurecr.io/retrain/horovod:0123456789ab"
    batch.add_pool(wire(pool_body(config, old, cluster.access, SHARE_KEY, REGISTRY_PASSWORD)))

    info = cluster.ensure_pool()

    assert info["action"] == "recreated" and info["nodes"] == 1
    assert batch.requests.find("DELETE", f"/pools/{config.pool.id}")
    (created,) = batch.bodies("POST", "/pools")
    names = created["virtualMachineConfiguration"]["containerConfiguration"]["containerImageNames"]
    assert names == [cluster.image]
    assert cluster.ensure_pool()["action"] == "reused"
    # A rotated registry password: the service never returns it, the pool's digest tells.
    rotated = make_cluster(config)
    rotated._secrets = lambda: (SHARE_KEY, "rotated-password-value")
    assert rotated.ensure_pool()["action"] == "recreated"
    # With recreation switched off, the differences are reported instead.
    refuse = azure_config(tmp_path, f"pool.id={config.pool.id}", "pool.recreate_on_change=false")
    other = make_cluster(refuse)
    other.image = old
    with pytest.raises(PoolError, match=r"container_image_names.*recreate_on_change is false"):
        other.ensure_pool()


def test_pool_in_use_is_not_recreated_under_a_running_task(
    fake_azure_account, tmp_path: Path
) -> None:
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=1")
    batch.scripts["train-"] = [Attempt(0, "epoch 1\n", _training_outputs(), seconds=30)]
    runner, _ = _start(cluster, training_task(config, "train-busy", "k", "p"), [])
    wait_until(lambda: getattr(_task(batch, config, "train-busy"), "state", "") == "running")
    other = make_cluster(config)
    other.image = "retrainacr.azurecr.io/retrain/horovod:fedcba987654"
    with pytest.raises(PoolError, match="is in use"):
        other.ensure_pool()
    assert not batch.requests.find("DELETE", f"/pools/{config.pool.id}")
    make_cluster(config).release()
    runner.join(timeout=20)


def test_preempted_spot_node_requeues_the_task_and_its_log_restarts(
    fake_azure_account, tmp_path: Path
) -> None:
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=0", "pool.low_priority_nodes=1")
    long_log = "".join(f"epoch {i} loss 0.{i}\n" for i in range(1, 40))
    batch.scripts["train-"] = [
        Attempt(0, long_log, seconds=30),  # preempted before it ends
        Attempt(0, "resuming from checkpoint-3.pt\n", _training_outputs()),
    ]
    lines: list[str] = []
    runner, out = _start(cluster, training_task(config, "train-spot", "k", "runs/s"), lines)
    wait_until(lambda: "epoch 39 loss 0.39" in lines)
    batch.preempt(config.pool.id, recover_after=1)
    runner.join(timeout=30)
    assert out and not isinstance(out[0], Exception), out
    assert out[0].exit_code == 0 and out[0].attempts == 1  # a requeue is not a retry
    assert any("was requeued" in line for line in lines)
    assert "resuming from checkpoint-3.pt" in lines
    assert _task(batch, config, "train-spot").execution["retryCount"] == 0


def test_a_preemption_between_reading_the_log_size_and_its_lines_is_a_requeue(
    fake_azure_account, tmp_path: Path
) -> None:
    """The node goes after the log's size was read and before its lines are: the file is gone
    (404), which is the requeue the next poll sees, not a failed training."""
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=0", "pool.low_priority_nodes=1")
    batch.scripts["train-"] = [
        Attempt(0, "epoch 1 loss 0.5\n", seconds=30),  # preempted before it ends
        Attempt(0, "resuming from checkpoint-1.pt\n", _training_outputs()),
    ]
    record, preempted = batch.requests.add, threading.Event()

    def add(req: Any) -> None:
        record(req)
        reading = req.method == "GET" and req.path.endswith("/files/stdout.txt")
        if reading and not preempted.is_set():
            preempted.set()
            batch.preempt(config.pool.id, recover_after=1)  # before the read is answered

    batch.requests.add = add
    lines: list[str] = []
    runner, out = _start(cluster, training_task(config, "train-gone", "k", "runs/g"), lines)
    runner.join(timeout=30)
    assert preempted.is_set()
    assert out and not isinstance(out[0], Exception), out
    assert out[0].exit_code == 0 and out[0].attempts == 1  # a requeue is not a retry
    assert "resuming from checkpoint-1.pt" in lines


@pytest.mark.parametrize(
    ("fallback", "why"),
    [
        ("after_preemptions=1", "1 preemptions of Spot nodes (limit 1)"),
        ("after_minutes_without_capacity=10", "no Spot capacity for"),
    ],
)
def test_a_run_without_spot_capacity_moves_to_dedicated_nodes(
    fallback: str, why: str, fake_azure_account, tmp_path: Path
) -> None:
    """pool.spot_fallback: the Spot node is preempted and Azure gives no capacity back. After
    one preemption, or 10 minutes of service time waiting, the pool is resized to a dedicated
    node and no Spot node; the requeued task runs there and the run says so."""
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(
        tmp_path,
        "pool.dedicated_nodes=0",
        "pool.low_priority_nodes=1",
        f"pool.spot_fallback.{fallback}",
    )
    batch.scripts["train-"] = [
        Attempt(0, "epoch 1\n", seconds=30),  # preempted before it ends
        Attempt(0, "resuming from checkpoint-1-40.pt\n", _training_outputs()),
    ]
    lines: list[str] = []
    runner, out = _start(cluster, training_task(config, "train-fb", "k", "runs/fb"), lines)
    wait_until(lambda: getattr(_task(batch, config, "train-fb"), "state", "") == "running")
    batch.preempt(config.pool.id, recover_after=None)  # the capacity is gone
    if "minutes" in fallback:
        wait_until(
            lambda: any("moving to" in line for line in lines) or len(batch.requests.all()) > 200
        )
        assert not any("moving to" in line for line in lines)  # not before the 10 minutes
        batch.clock_offset += timedelta(minutes=11)
    runner.join(timeout=30)
    assert out and not isinstance(out[0], Exception), out
    result = out[0]
    assert result.exit_code == 0 and result.attempts == 1  # requeued, never retried
    assert result.preemptions == 1 and result.spot_fallback.startswith(why)
    moved = [line for line in lines if "moving to 1 dedicated node(s)" in line]
    assert len(moved) == 1 and why in moved[0] and "pool.spot_fallback" in moved[0]
    resize = batch.bodies("POST", f"/pools/{config.pool.id}/resize")[-1]
    assert (resize["targetDedicatedNodes"], resize["targetLowPriorityNodes"]) == (1, 0)
    task = _task(batch, config, "train-fb")
    assert task.execution["retryCount"] == 0
    assert task.nodes == ["tvmps_0001d"]  # the requeued attempt ran on the dedicated node
    assert "resuming from checkpoint-1-40.pt" in lines
    record = cluster.spot_record()
    assert record is not None
    assert [(k.dedicated, k.spot) for k in record.kinds] == [(0, 1), (1, 0)]


def test_the_spot_fallback_requeues_a_task_running_on_spot_nodes(
    fake_azure_account, tmp_path: Path
) -> None:
    """The Spot node comes back at once and the task runs on it again when the fallback
    comes: the resize requeues it (``requeue``), the Spot node goes, and the task resumes on
    the dedicated node. With ``taskcompletion`` the Spot node would keep the training to its
    end, the resize would not complete meanwhile, and the dedicated node would wait idle."""
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(
        tmp_path,
        "pool.dedicated_nodes=0",
        "pool.low_priority_nodes=1",
        "pool.spot_fallback.after_preemptions=1",
    )
    batch.scripts["train-"] = [
        Attempt(0, "epoch 1\n", seconds=20),  # preempted before it ends
        Attempt(0, "epoch 2 on spot\n", seconds=20),  # requeued by the fallback's resize
        Attempt(0, "resuming from checkpoint-2-10.pt\n", _training_outputs()),
    ]
    lines: list[str] = []
    runner, out = _start(cluster, training_task(config, "train-rq", "k", "runs/rq"), lines)
    wait_until(lambda: "epoch 1" in lines)
    batch.preempt(config.pool.id, recover_after=0)  # back before any listing sees it gone
    runner.join(timeout=15)
    assert out and not isinstance(out[0], Exception), out
    assert out[0].exit_code == 0 and out[0].attempts == 1 and out[0].preemptions == 1
    resize = batch.bodies("POST", f"/pools/{config.pool.id}/resize")[-1]
    assert resize["nodeDeallocationOption"] == "requeue"
    assert any("starts again on tvmps_0000p" in line for line in lines)  # on Spot again
    assert "resuming from checkpoint-2-10.pt" in lines
    task = _task(batch, config, "train-rq")
    assert task.nodes == ["tvmps_0001d"] and task.requeues == 1
    assert [n["id"] for n in batch.nodes[config.pool.id]] == ["tvmps_0001d"]


@pytest.mark.parametrize("step", ["staging", "scoring"])
def test_a_preemption_during_staging_or_scoring_requeues_that_task(
    step: str, fake_azure_account, tmp_path: Path
) -> None:
    """Staging (incremental, verified: a second attempt copies what the first did not) and
    scoring (reads the model, writes one file) start again on the new VM; the requeue is no
    retry, and the run counts the preemption."""
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=0", "pool.low_priority_nodes=1")
    if step == "staging":
        spec = staging_task(config, "stage-p", "runs/p")
        done = {"outputs/staging.json": b"{}"}
    else:
        spec = scoring_task("score-p", "runs/p/model.pt", "runs/p")
        done = {"outputs/score.json": b"{}"}
    batch.scripts[spec.id] = [Attempt(0, "working\n", seconds=30), Attempt(0, "done\n", done)]
    lines: list[str] = []
    runner, out = _start(cluster, spec, lines)
    wait_until(lambda: getattr(_task(batch, config, spec.id), "state", "") == "running")
    batch.preempt(config.pool.id, recover_after=1)
    runner.join(timeout=30)
    assert out and not isinstance(out[0], Exception), out
    assert out[0].exit_code == 0 and out[0].attempts == 1 and out[0].preemptions == 1
    assert _task(batch, config, spec.id).execution["retryCount"] == 0
    assert any("was requeued (a node was preempted" in line for line in lines)
    assert f"runs/p/{next(iter(done)).split('/')[1]}" in out[0].uploaded  # the new attempt's


def test_task_that_never_gets_nodes_fails_at_its_deadline(
    fake_azure_account, tmp_path: Path
) -> None:
    """Spot capacity gone: the task stays queued. Past its longest possible life (on the
    service's clock) the run stops it and says why, instead of waiting forever."""
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=0", "pool.low_priority_nodes=1")
    batch.preempt(config.pool.id, recover_after=None)
    spec = scoring_task("score-never", "runs/n/model.pt", "runs/n")
    runner, out = _start(cluster, spec, [])
    wait_until(lambda: _task(batch, config, "score-never") is not None)
    batch.clock_offset += timedelta(hours=3)  # scoring: 1 h x 1 attempt + 30 min start timeout
    runner.join(timeout=20)
    assert not runner.is_alive(), "the run kept waiting for a task that cannot start"
    assert isinstance(out[0], TaskFailedError), out
    assert "did not finish within" in str(out[0]) and "preempted" in str(out[0])
    assert batch.requests.find("POST", f"/jobs/{config.pool.id}-score-never/terminate")


def test_stale_resize_errors_do_not_fail_the_retry(fake_azure_account, tmp_path: Path) -> None:
    batch = fake_azure_account.batch
    config = azure_config(tmp_path, "pool.dedicated_nodes=2")
    batch.capacity["dedicated"] = 1  # the region has one VM of the size right now
    with pytest.raises(PoolError, match="AllocationTimedOut"):
        make_cluster(config).ensure_pool()
    batch.capacity["dedicated"] = None  # capacity is back when the step is retried
    info = make_cluster(config).ensure_pool()
    assert info["action"] == "resized" and info["nodes"] == 2


def test_quota_error_fails_fast_and_gives_back_what_was_allocated(
    fake_azure_account, tmp_path: Path
) -> None:
    batch = fake_azure_account.batch
    batch.quota["dedicated"] = 1
    config = azure_config(tmp_path, "pool.dedicated_nodes=2")
    with pytest.raises(PoolError) as err:
        make_cluster(config).ensure_pool()
    assert "AccountCoreQuotaReached" in str(err.value) and "quota" in str(err.value)
    resizes = batch.bodies("POST", f"/pools/{config.pool.id}/resize")
    assert resizes and resizes[-1]["targetDedicatedNodes"] == 0
    wait_until(
        lambda: (
            batch.pools[config.pool.id]["currentDedicatedNodes"] == 0
            or bool(cluster_get(config).current_dedicated_nodes == 0)
        )
    )


def cluster_get(config: PipelineConfig) -> Any:
    return make_cluster(config).client.get_pool(config.pool.id)


@pytest.mark.parametrize(
    ("size", "overrides", "topology"),
    [
        ("Standard_ND96asr_v4", [], "/opt/microsoft/ndv4-topo.xml"),
        ("Standard_ND96isr_H100_v5", [], "/opt/microsoft/ndv5-topo.xml"),
        ("Standard_ND96isr_H100_v5", ["pool.nccl_topo_file=null"], None),
        ("Standard_NC24ads_A100_v4", [], None),
    ],
)
def test_infiniband_sizes_get_the_hosts_nccl_topology(
    fake_azure_account, tmp_path: Path, size: str, overrides: list[str], topology: str | None
) -> None:
    config, cluster = ready_cluster(
        tmp_path, f"pool.vm_size={size}", "pool.dedicated_nodes=2", *overrides
    )
    cluster.run_task(training_task(config, "train-ib", "k", "runs/ib"))
    (task,) = fake_azure_account.batch.bodies("POST", f"/jobs/{config.pool.id}-train-ib/tasks")
    env = {e["name"]: e["value"] for e in task["environmentSettings"]}
    options = task["containerSettings"]["containerRunOptions"]
    assert env.get("NCCL_TOPO_FILE") == topology
    if topology:
        assert "-v /etc/nccl.conf:/etc/nccl.conf:ro" in options
        assert "-v /opt/microsoft:/opt/microsoft:ro" in options
    else:
        assert "/opt/microsoft" not in options


def test_throttled_requests_are_retried_after_the_advised_delay(
    fake_azure_account, tmp_path: Path
) -> None:
    batch = fake_azure_account.batch
    _config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=1")
    batch.throttle_every, batch.retry_after = 5, 0
    batch.scripts["score-"] = [Attempt(0, "", {"outputs/score.json": b"{}"})]
    result = cluster.run_task(scoring_task("score-t", "runs/t/model.pt", "runs/t"))
    assert result.exit_code == 0 and batch.throttled > 0


@pytest.mark.parametrize("release", ["resize_to_zero", "delete"])
@pytest.mark.parametrize("skew", [timedelta(hours=-1), timedelta(hours=1)])
def test_cost_is_measured_on_the_service_clock_alone(
    fake_azure_account, tmp_path: Path, skew: timedelta, release: str
) -> None:
    """The pool, node and task timestamps are Batch's; a run measured partly on this machine's
    clock (its start, or "now" for a pool already deleted) gained or lost the clocks' whole
    difference: an hour of skew added 60 node-minutes, or zeroed the run."""
    from tasks.cost import PoolMeter

    batch = fake_azure_account.batch
    batch.clock_offset = skew  # Batch's clock against this machine's
    config = azure_config(tmp_path, "pool.dedicated_nodes=2", f"pool.release={release}")
    cluster = make_cluster(config)
    run_id = "20261125-020000-abcdef12"
    meter = PoolMeter(config, cluster, run_id)
    meter.start()
    cluster.ensure_pool()
    batch.scripts["train-"] = [Attempt(0, "epoch 1\n", _training_outputs(), service_seconds=120)]
    assert cluster.run_task(training_task(config, f"train-{run_id}", "k", "p")).exit_code == 0
    meter.before_release()
    cluster.release()
    cost = meter.report()

    minutes = cost["node_minutes"]
    assert minutes["training"] == pytest.approx(2 * 2, abs=0.2)  # 2 nodes x the task's 2 min
    # (less a second a node at most: an HTTP Date header counts whole seconds)
    assert 3.9 < cost["total_node_minutes"] < 5, cost  # and seconds of allocating and idling


@pytest.mark.parametrize("price", ["inf", "nan", "1e6"])
def test_an_hourly_price_no_node_has_is_refused(tmp_path: Path, price: str) -> None:
    with pytest.raises(ConfigError, match=r"pool\.hourly_price"):
        azure_config(tmp_path, f"pool.hourly_price={price}")
