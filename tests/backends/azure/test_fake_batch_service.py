"""The fake Batch account itself, driven by the real azure-batch client: strict as the service
on request bodies (400 with Batch's error body), and alive the way the service is (pool, node,
job and task lifecycles, preemption, throttling, range reads). What it does here is what the
spec, the SDK's recorded sessions and the Batch documentation say the service does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from azure.core.exceptions import HttpResponseError, ResourceExistsError
from azure.core.rest import HttpRequest

from backends.azure.clients import batch_client
from tests.azure_helpers import azure_config
from tests.fakes.batch import API_VERSION as BATCH_API_VERSION
from tests.fakes.batch import Attempt, FakeBatch


def _client(tmp_path: Path) -> Any:
    return batch_client(azure_config(tmp_path).azure)


def _pool(pool_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": pool_id,
        "vmSize": "Standard_NC24ads_A100_v4",
        "virtualMachineConfiguration": {
            "imageReference": {"publisher": "microsoft-dsvm", "offer": "ubuntu-hpc", "sku": "2204"},
            "nodeAgentSKUId": "batch.node.ubuntu 22.04",
        },
        "targetDedicatedNodes": 1,
        **extra,
    }


def _refusal(exc: HttpResponseError) -> tuple[int, str, dict[str, str]]:
    exc.response.read()  # type: ignore[union-attr]  # a streamed download's error body
    body = exc.response.json()  # type: ignore[union-attr]
    values = {v["key"]: v["value"] for v in body.get("values", [])}
    return exc.status_code or 0, body["code"], values


@pytest.mark.parametrize(
    ("body", "code", "name"),
    [
        (_pool("p1", vmSzie="Standard_D2_v5"), "UnsupportedProperty", "vmSzie"),
        (_pool("p2", resizeTimeout="PT1M"), "InvalidPropertyValue", "resizeTimeout"),
        (_pool("p3", resizeTimeout="5 minutes"), "InvalidPropertyValue", "resizeTimeout"),
        (_pool("p4", taskSlotsPerNode="1"), "InvalidPropertyValue", "taskSlotsPerNode"),
        ({"id": "p5"}, "MissingRequiredProperty", "vmSize"),
        (
            _pool("p6", enableAutoScale=True, autoScaleFormula="$TargetDedicatedNodes=1;"),
            "InvalidPropertyValue",
            "targetDedicatedNodes",
        ),
    ],
    ids=["unknown", "below-minimum", "not-a-duration", "wrong-type", "missing", "cross-field"],
)
def test_request_bodies_are_checked_against_the_spec(
    fake_azure_account, tmp_path: Path, body: dict[str, Any], code: str, name: str
) -> None:
    fake_azure_account.batch.allow_refusals = True
    with pytest.raises(HttpResponseError) as err:
        _client(tmp_path).create_pool(body)
    status, got, values = _refusal(err.value)
    assert (status, got, values["PropertyName"]) == (400, code, name)
    assert body["id"] not in fake_azure_account.batch.pools


def test_enum_values_must_be_spelled_as_the_spec_spells_them(
    fake_azure_account, tmp_path: Path
) -> None:
    fake_azure_account.batch.allow_refusals = True
    client = _client(tmp_path)
    client.create_job({"id": "j1", "poolInfo": {"poolId": "p"}})
    task = {
        "id": "t1",
        "commandLine": "/bin/true",
        "outputFiles": [
            {
                "filePattern": "out/*",
                "destination": {"container": {"containerUrl": "https://a.blob.core.windows.net/c"}},
                "uploadOptions": {"uploadCondition": "taskSuccess"},
            }
        ],
    }
    with pytest.raises(HttpResponseError) as err:
        client.create_task("j1", task)
    status, code, values = _refusal(err.value)
    assert (status, code, values["PropertyValue"]) == (400, "InvalidPropertyValue", "taskSuccess")
    assert "outputFiles[0].uploadOptions.uploadCondition" in values["Reason"]


def test_pool_and_node_lifecycle(fake_azure_account, tmp_path: Path) -> None:
    batch: FakeBatch = fake_azure_account.batch
    client = _client(tmp_path)
    batch.boot_ticks = 2  # requests a node spends creating, then starting
    client.create_pool(_pool("life", targetDedicatedNodes=2))
    seen_pool = [client.get_pool("life").allocation_state]
    while seen_pool[-1] != "steady":
        seen_pool.append(client.get_pool("life").allocation_state)
    assert seen_pool[0] == "resizing" and len(seen_pool) > 1
    seen = [tuple(n.state for n in client.list_nodes("life")) for _ in range(5)]
    order = [s for i, s in enumerate(seen) if s not in seen[:i]]
    assert order == [("creating",) * 2, ("starting",) * 2, ("idle",) * 2]
    # The resize is sent without the SDK's poller: its thread polls the pool concurrently, and
    # every request it makes ages the nodes, so the test could miss the leaving state.
    resize = HttpRequest(
        "POST",
        "/pools/life/resize",
        params={"api-version": BATCH_API_VERSION},
        json={"targetDedicatedNodes": 1},
    )
    assert client.send_request(resize).status_code == 202
    shrinking = [sorted(n.state for n in client.list_nodes("life")) for _ in range(4)]
    assert ["idle", "leavingpool"] in shrinking and shrinking[-1] == ["idle"]
    while client.get_pool("life").allocation_state != "steady":
        pass
    client.begin_delete_pool("life", polling_interval=0).result()
    assert "life" not in batch.pools


def test_quota_shows_as_resize_errors_once_steady(fake_azure_account, tmp_path: Path) -> None:
    batch: FakeBatch = fake_azure_account.batch
    batch.quota["lowPriority"] = 1
    client = _client(tmp_path)
    client.create_pool(_pool("spot", targetDedicatedNodes=0, targetLowPriorityNodes=3))
    pool = client.get_pool("spot")
    assert pool.allocation_state == "resizing" and not pool.resize_errors
    while pool.allocation_state != "steady":
        pool = client.get_pool("spot")
    assert [e.code for e in pool.resize_errors] == ["AccountLowPriorityCoreQuotaReached"]
    assert (pool.current_low_priority_nodes, pool.target_low_priority_nodes) == (1, 3)
    assert all(n.is_dedicated is False for n in client.list_nodes("spot"))


def test_empty_job_that_terminates_when_complete_refuses_its_task(
    fake_azure_account, tmp_path: Path
) -> None:
    """Documented: a job without tasks has all its tasks complete; with terminatejob it ends."""
    client = _client(tmp_path)
    client.create_job(
        {"id": "empty", "poolInfo": {"poolId": "p"}, "onAllTasksComplete": "terminatejob"}
    )
    states = [client.get_job("empty").state for _ in range(3)]
    assert states[-1] == "completed" and "terminating" in states
    assert client.get_job("empty").execution_info.termination_reason == "AllTasksComplete"
    with pytest.raises(ResourceExistsError) as err:
        client.create_task("empty", {"id": "late", "commandLine": "/bin/true"})
    assert _refusal(err.value)[1] == "JobCompleted"


def test_multi_instance_task_waits_for_a_pool_that_can_run_it(
    fake_azure_account, tmp_path: Path
) -> None:
    batch: FakeBatch = fake_azure_account.batch
    client = _client(tmp_path)
    batch.add_pool(_pool("solo", targetDedicatedNodes=2))  # no inter-node communication
    client.create_job({"id": "mpi", "poolInfo": {"poolId": "solo"}})
    multi = {"numberOfInstances": 2, "coordinationCommandLine": "/bin/true"}
    client.create_task(
        "mpi", {"id": "t", "commandLine": "/bin/true", "multiInstanceSettings": multi}
    )
    assert {client.get_task("mpi", "t").state for _ in range(5)} == {"active"}
    batch.add_pool(_pool("pair", targetDedicatedNodes=2, enableInterNodeCommunication=True))
    client.create_job({"id": "mpi2", "poolInfo": {"poolId": "pair"}})
    client.create_task(
        "mpi2", {"id": "t", "commandLine": "/bin/true", "multiInstanceSettings": multi}
    )
    while client.get_task("mpi2", "t").state == "active":
        pass
    (sub,) = client.list_subtasks("mpi2", "t")
    assert sub.id == 1 and sub.node_info.node_id != client.get_task("mpi2", "t").node_info.node_id


def test_preempted_task_is_requeued_without_a_retry_and_with_a_new_stdout(
    fake_azure_account, tmp_path: Path
) -> None:
    batch: FakeBatch = fake_azure_account.batch
    client = _client(tmp_path)
    batch.add_pool(_pool("spot", targetDedicatedNodes=0, targetLowPriorityNodes=1))
    batch.scripts["t"] = [Attempt(0, "first attempt\n", seconds=30), Attempt(0, "again\n")]
    client.create_job({"id": "j", "poolInfo": {"poolId": "spot"}})
    client.create_task("j", {"id": "t", "commandLine": "/bin/true"})
    while client.get_task("j", "t").state != "running":
        pass
    assert b"".join(client.download_task_file("j", "t", "stdout.txt")) == b"first attempt\n"
    node = batch.preempt("spot", recover_after=3)
    assert [n.state for n in client.list_nodes("spot")] == ["preempted"]
    task = client.get_task("j", "t")
    assert task.state == "active" and task.execution_info.retry_count == 0
    while (task := client.get_task("j", "t")).state != "completed":
        pass
    assert task.execution_info.retry_count == 0 and task.execution_info.requeue_count == 0
    assert task.node_info.node_id == node  # a new VM in the same node slot
    assert b"".join(client.download_task_file("j", "t", "stdout.txt")) == b"again\n"


def test_range_reads_and_reads_past_the_end(fake_azure_account, tmp_path: Path) -> None:
    batch: FakeBatch = fake_azure_account.batch
    client = _client(tmp_path)
    batch.add_pool(_pool("files"))
    batch.scripts["t"] = [Attempt(0, "0123456789\n", seconds=30)]
    client.create_job({"id": "j", "poolInfo": {"poolId": "files"}})
    client.create_task("j", {"id": "t", "commandLine": "/bin/true"})
    while client.get_task("j", "t").state != "running":
        pass
    assert client.get_task_file_properties("j", "t", "stdout.txt").content_length == 11
    part = client.download_task_file("j", "t", "stdout.txt", ocp_range="bytes=2-4")
    assert b"".join(part) == b"234"
    with pytest.raises(HttpResponseError) as err:
        b"".join(client.download_task_file("j", "t", "stdout.txt", ocp_range="bytes=11-"))
    assert err.value.status_code == 416 and _refusal(err.value)[1] == "InvalidRange"


def test_throttling_answers_with_retry_after(fake_azure_account, tmp_path: Path) -> None:
    batch: FakeBatch = fake_azure_account.batch
    batch.add_pool(_pool("busy"))
    batch.throttle_every, batch.throttle_status, batch.retry_after = 2, 503, 0
    client = _client(tmp_path)
    with pytest.raises(HttpResponseError) as err:
        for _ in range(2):
            client.get_pool("busy", retry_total=0)
    assert err.value.status_code == 503
    assert err.value.response.headers["Retry-After"] == "0"  # type: ignore[union-attr]
    assert [client.get_pool("busy").id for _ in range(4)] == ["busy"] * 4  # the SDK retries
