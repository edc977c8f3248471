"""The whole retrain flow on the Azure target: the real Batch, Files, ACR and Blob SDK clients,
against the fake Batch/Files/ACR services and Azurite, with the pool's two nodes emulated as
separate hosts that run the task command lines for real (staging through the SAS the pool gets,
horovodrun training across both nodes over SSH, the scorer), each task in the training image
as Batch runs a container task: the tag the pool names in the fake ACR is the cpu variant the
local build pushed to the local registry. Prefect is the real test server; credentials come
from Prefect Secret blocks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from backends.image import content_tag
from flows.retrain import retrain
from imagedata.make_images import write_digits
from tests.azure_helpers import ROOT, azure_config
from tests.fakes.acr import FakeAcr
from tests.fakes.container import ImagePuller
from tests.fakes.node import PoolNodes
from tests.nodes_helpers import require_emulated_nodes
from tests.pipeline_helpers import flow_run_logs, seed, task_runs_and_artifacts
from tests.reliability import report

pytestmark = pytest.mark.usefixtures("prefect_api", "horovodrun")

SHARE_KEY = "c2hhcmUta2V5LXZhbHVlLWZvci10ZXN0cw=="
REGISTRY_PASSWORD = "registry-password-value-for-tests"
HOURLY_PRICE = 3.0


@pytest.fixture(scope="module")
def digits_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits-src")
    write_digits(root, test_fraction=0.25, seed=0, per_class=60)
    return root


@pytest.fixture
def secrets() -> None:
    from prefect.blocks.system import Secret

    Secret(value=SHARE_KEY).save("retrain-files-key", overwrite=True)
    Secret(value=REGISTRY_PASSWORD).save("retrain-acr-pull", overwrite=True)


def _config(tmp_path: Path, *overrides: str) -> Any:
    return azure_config(
        tmp_path,
        "pool.dedicated_nodes=2",
        "pool.processes_per_node=1",
        "training.epochs=3",
        "training.lr=0.05",
        "training.batch_size=16",
        "training.model=cnn",
        f"pool.hourly_price={HOURLY_PRICE}",
        *overrides,
    )


@pytest.fixture
def nodes(
    fake_azure_account: Any, tmp_path: Path, training_image: str, image_puller: ImagePuller
) -> Iterator[PoolNodes]:
    """The pool's nodes as emulated hosts (made when the first task starts); the image the
    pool's tasks name (ACR's, built by the fake ACR Tasks) is pulled as the local cpu one."""
    require_emulated_nodes()
    acr = f"{FakeAcr.registry_host}/retrain/horovod:{content_tag(ROOT)}"
    with PoolNodes(
        tmp_path / "pool",
        None,
        tmp_path / "nfs",
        lambda _: None,
        images=image_puller,
        aliases={acr: training_image},
    ) as pool:
        pool.attach(fake_azure_account.batch)
        fake_azure_account.batch.allocation_ticks = 1
        yield pool


def _scripts(fakes: Any, config: Any, pool: PoolNodes) -> None:
    """Each node's scripts mount shows the share as it is when a task starts."""
    pool.scripts = lambda target: fakes.files.materialize(config.share.name, target)


def test_azure_flow_end_to_end(
    fake_azure_account: Any, nodes: PoolNodes, secrets: None, tmp_path: Path, digits_source: Path
) -> None:
    fakes = fake_azure_account
    config = _config(tmp_path)
    seed(config, digits_source)
    _scripts(fakes, config, nodes)

    state = retrain(config=config, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["accuracy"] > 0.4

    batch = fakes.batch
    # The pool: created once, with the secrets from the blocks in its body, released at the end.
    (pool,) = batch.bodies("POST", "/pools")
    mount = pool["mountConfiguration"][1]["azureFileShareConfiguration"]
    assert mount["accountKey"] == SHARE_KEY
    resizes = batch.bodies("POST", f"/pools/{config.pool.id}/resize")
    assert resizes[-1]["targetDedicatedNodes"] == 0
    assert batch.pools[config.pool.id]["currentDedicatedNodes"] == 0
    # Three jobs, each one task: staging on the node, training, scoring.
    jobs = [j["id"] for j in batch.bodies("POST", "/jobs")]
    assert [j.split(f"{config.pool.id}-")[1].split("-")[0] for j in jobs] == [
        "stage",
        "train",
        "score",
    ]
    stage_task = batch.bodies("POST", f"/jobs/{jobs[0]}/tasks")[0]
    env = {e["name"]: e["value"] for e in stage_task["environmentSettings"]}
    assert "sp=rl" in env["RETRAIN_DATA_URL"]  # read and list only, on the data container
    assert "sig=" not in stage_task["commandLine"]
    # The scripts share got the code the node ran; the image was built once by ACR Tasks.
    assert "training/train.py" in fakes.files.file_paths(config.share.name)
    assert "staging/task.py" in fakes.files.file_paths(config.share.name)
    assert len([r for r in fakes.acr.requests.all() if r.path.endswith("/scheduleRun")]) == 1
    # The node really ran the commands: staging fetched every blob into NFS.
    staged = sorted(p for p in (tmp_path / "nfs" / "data").rglob("*.png"))
    assert len(staged) == sum(1 for _ in digits_source.rglob("*.png"))
    # Training ran on both nodes: preparation on each, the launch on the primary only.
    prepared = [n for n, c in nodes.commands if "prepare_node.sh" in c]
    assert prepared == ["tvmps_0000d", "tvmps_0001d"]
    assert [n for n, c in nodes.commands if "launch.sh" in c] == ["tvmps_0000d"]
    # Every task ran in the image: staging, training on both nodes and scoring all had its
    # Python (this machine has none at that path).
    assert all(sub.container is not None for run in nodes.runs for sub in run.subtasks)
    training = next(run for run in nodes.runs if run.task_id.startswith("train"))
    for sub in training.subtasks:
        assert "python /opt/venv/bin/python" in sub.stdout()

    outputs = batch.tasks[(jobs[1], jobs[1].split(f"{config.pool.id}-")[1])].uploaded
    assert {f"runs/{result['run_id']}/{n}" for n in ("model.pt", "metrics.json")} <= set(outputs)
    by_step, artifacts = task_runs_and_artifacts(state.state_details.flow_run_id)
    assert {"validate-data", "stage-data", "run-training", "collect-and-score"} <= set(by_step)
    logs = flow_run_logs(state.state_details.flow_run_id)
    assert "PROGRESS" in logs  # the primary's stdout, streamed from Batch
    assert "launch: 2 processes on 2 node(s)" in logs
    assert "subtask 1 on tvmps_0001d: completed (exit 0)" in logs
    # Nothing secret reached the logs or the artifacts.
    texts = [logs, *(json.dumps(a.data) for a in artifacts)]
    for text in texts:
        assert SHARE_KEY not in text and REGISTRY_PASSWORD not in text and "sig=" not in text
    # The command lines sent to Batch carry no secret: SAS tokens travel in outputFiles and
    # environment settings, keys only in the pool's mount and registry settings.
    bodies = [b for job in jobs for b in batch.bodies("POST", f"/jobs/{job}/tasks")]
    commands = [b["commandLine"] for b in bodies] + [
        b.get("multiInstanceSettings", {}).get("coordinationCommandLine", "") for b in bodies
    ]
    leaks = [c for c in commands if "sig=" in c or SHARE_KEY in c or REGISTRY_PASSWORD in c]
    assert leaks == []
    report.record(
        "secrets",
        "Azure flow (fakes): share key, registry password, SAS tokens",
        "0 hits",
        places_scanned="logs, artifacts, Batch command lines",
        command_lines=len(commands),
        hits=0,
    )

    # What the run paid for, from the fake service's own pool, node and task timestamps.
    cost = result["cost"]
    minutes = cost["node_minutes"]
    assert cost["nodes"] == 2
    assert min(minutes["allocating"], minutes["staging"], minutes["training"]) > 0
    assert minutes["scoring"] > 0
    assert cost["total_node_minutes"] == pytest.approx(sum(minutes.values()), abs=0.01)
    assert cost["estimated_cost"] == pytest.approx(
        cost["total_node_minutes"] / 60 * HOURLY_PRICE, abs=0.01
    )
    summary = next(a for a in artifacts if a.key == "retrain-summary").data
    assert "## Cost" in summary and "| idle before release |" in summary
    # Idle node-minutes (no task of the run on the pool) are the orchestrator's own steps
    # between tasks and before the release. How long those take depends on the machine, so
    # what is checked is what bounds them: the pool held no task only across the two gaps
    # between the run's three tasks and the one after the last, the release reached zero
    # nodes before the report step began (a release after the report, or after any later
    # step, shows here), and training ran as one Batch task attempt with no Prefect retry
    # (a retry delay would hold the pool idle).
    assert minutes["idle between steps"] > 0 and minutes["idle before release"] > 0
    assert cost["idle_node_minutes"] == pytest.approx(
        minutes["idle between steps"] + minutes["idle before release"], abs=0.01
    )
    released = datetime.fromisoformat(
        batch.pools[config.pool.id]["allocationStateTransitionTime"].replace("Z", "+00:00")
    )
    assert released <= by_step["report"].start_time, (released, by_step["report"].start_time)
    assert by_step["run-training"].run_count == 1
    train_task = batch.tasks[(jobs[1], jobs[1].split(f"{config.pool.id}-")[1])]
    assert train_task.execution.get("retryCount", 0) == 0

    # Run again with nothing changed: up to date, and Batch gets not one request (no pool, no
    # job): 0 node-minutes.
    sent = len(batch.requests.all())
    again = retrain(config=config, return_state=True)
    assert again.is_completed(), again.message
    assert again.result()["up_to_date"] is True
    assert again.result()["cost"]["total_node_minutes"] == 0
    assert len(batch.requests.all()) == sent
    assert len(batch.bodies("POST", "/pools")) == 1
    report.record(
        "cost",
        "first run, then a re-run with nothing changed (up to date)",
        f"{cost['total_node_minutes']:.2f} node-minutes, then 0",
        **{phase.replace(" ", "_"): f"{m:.2f}" for phase, m in minutes.items()},
    )


def test_failed_training_still_releases_the_pool(
    fake_azure_account: Any, nodes: PoolNodes, secrets: None, tmp_path: Path, digits_source: Path
) -> None:
    fakes = fake_azure_account
    config = _config(
        tmp_path, "training.extra_args=['--no-such-option']", "retries.training_attempts=2"
    )
    seed(config, digits_source)
    _scripts(fakes, config, nodes)

    state = retrain(config=config, return_state=True)

    assert state.is_failed()
    assert "exited with 2" in str(state.message) or "exited with" in flow_run_logs(
        state.state_details.flow_run_id
    )
    batch = fakes.batch
    train_job = next(j for j in batch.jobs if "-train-" in j)
    task = next(t for (job, _), t in batch.tasks.items() if job == train_job)
    assert task.retry == 1  # Batch retried once (training_attempts=2), not Prefect
    assert batch.bodies("POST", f"/pools/{config.pool.id}/resize")[-1]["targetDedicatedNodes"] == 0
    assert batch.pools[config.pool.id]["currentDedicatedNodes"] == 0
