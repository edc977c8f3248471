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
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from backends.azure.access import node_access
from backends.azure.batch import BatchCluster, Polling, PoolError
from backends.azure.batch_requests import pool_body, wire
from backends.azure.clients import batch_client
from backends.blob import container_client
from backends.factory import image_reference
from backends.taskspec import scoring_task, training_task
from flows.config import PipelineConfig
from tests.azure_helpers import azure_config
from tests.fakes.batch import Attempt

FAST = Polling(first=0.01, factor=1.0, cap=0.01, lro_seconds=0)
SHARE_KEY, REGISTRY_PASSWORD = "ZmlsZXMta2V5LXZhbHVl", "acr-token-password-value"


def make_cluster(config: PipelineConfig) -> BatchCluster:
    outputs = container_client(config.output, create=True)
    data = container_client(config.data, create=True)
    return BatchCluster(
        config,
        batch_client(config),
        outputs,
        node_access(config, data, outputs),
        image_reference(config),
        lambda: (SHARE_KEY, REGISTRY_PASSWORD),
        FAST,
    )


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
    config = azure_config(tmp_path, f"pool.autoscale_formula='{formula}'")
    body = wire(pool_body(config, "img", make_cluster(config).access, "k", None))
    assert body["enableAutoScale"] is True and body["autoScaleFormula"] == formula
    assert body["autoScaleEvaluationInterval"] == "PT05M00S"
    assert "targetDedicatedNodes" not in body and "targetLowPriorityNodes" not in body


def test_existing_pool_is_reused_or_grown_never_shrunk(fake_azure_account, tmp_path: Path) -> None:
    batch = fake_azure_account.batch
    config = azure_config(tmp_path, "pool.dedicated_nodes=2")
    cluster = make_cluster(config)
    small = wire(pool_body(config, cluster.image, cluster.access, "k", None))
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
    existing = wire(pool_body(config, cluster.image, cluster.access, "k", None))
    batch.add_pool(
        {**existing, "vmSize": "Standard_NC6s_v3", "enableInterNodeCommunication": False}
    )

    with pytest.raises(PoolError) as err:
        cluster.ensure_pool()
    message = str(err.value)
    assert config.pool.id in message and "vm_size" in message and "standard_nc6s_v3" in message
    assert "enable_inter_node_communication" in message
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
    assert "tvmps_0000 unusable" in str(err.value)
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
    assert job["onAllTasksComplete"] == "terminatejob"
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
    assert outputs["../std*.txt"]["uploadOptions"]["uploadCondition"] == "taskCompletion"
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
    # Logs are uploaded on failure too (taskCompletion); the model is not (taskSuccess).
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


def test_identity_mode_sends_no_token_anywhere(fake_azure_account, tmp_path: Path) -> None:
    identity = (
        "/subscriptions/s/resourceGroups/g/providers/Microsoft.ManagedIdentity/"
        "userAssignedIdentities/retrain"
    )
    config = azure_config(
        tmp_path,
        f"azure.identity_resource_id={identity}",
        "azure.identity_client_id=11111111-2222-3333-4444-555555555555",
        "image.registry_username=null",
        "image.registry_password_secret=null",
    )
    cluster = make_cluster(config)
    assert "?" not in cluster.access.data_url and "?" not in cluster.access.output_url
    from backends.azure.batch_requests import task_body
    from backends.taskspec import staging_task

    body = wire(
        task_body(config, staging_task(config, "stage-r-1", "runs/r"), "img", cluster.access)
    )
    env = {e["name"]: e["value"] for e in body["environmentSettings"]}
    assert env["RETRAIN_DATA_URL"] == cluster.access.data_url
    assert env["AZURE_CLIENT_ID"] == "11111111-2222-3333-4444-555555555555"
    for out in body["outputFiles"]:
        assert out["destination"]["container"]["identityReference"] == {"resourceId": identity}
    pool = wire(pool_body(config, "img", cluster.access, "k", None))
    registry = pool["virtualMachineConfiguration"]["containerConfiguration"]["containerRegistries"]
    assert registry == [
        {"registryServer": "retrainacr.azurecr.io", "identityReference": {"resourceId": identity}}
    ]


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


def test_a_rerun_follows_the_task_it_already_submitted(fake_azure_account, tmp_path: Path) -> None:
    """After an orchestrator crash the same step finds its task and follows it (no duplicate)."""
    batch = fake_azure_account.batch
    config, cluster = ready_cluster(tmp_path, "pool.dedicated_nodes=1")
    batch.scripts["train-"] = [Attempt(0, "done\n", _training_outputs())]
    spec = training_task(config, "train-again", "k", "runs/a")
    cluster.run_task(spec)
    lines: list[str] = []
    result = cluster.run_task(spec, lines.append)
    assert result.exit_code == 0
    assert "task train-again already submitted: following it" in lines
    assert len(batch.bodies("POST", f"/jobs/{config.pool.id}-train-again/tasks")) == 2
    assert len(batch.tasks) == 1
