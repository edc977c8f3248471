"""Orchestrator faults: cancellation through the Prefect API while Horovod trains, the flow
process killed midway and run again, and the pool released on every failure path."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from backends.local.processes import read_record
from flows.retrain import retrain
from imagedata.make_images import write_digits
from tests.conftest import ROOT, prefect_api_env
from tests.pipeline_helpers import deployment_defaults, make_config, process_worker, seed
from tests.reliability import report

pytestmark = pytest.mark.usefixtures("prefect_api", "horovodrun")


@pytest.fixture(scope="module")
def digits_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits-src")
    write_digits(root, test_fraction=0.25, seed=0, per_class=60)
    return root


@pytest.fixture(autouse=True)
def _storage(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)


def _wait(what: str, check: Any, seconds: float = 240) -> Any:
    deadline = time.monotonic() + seconds
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def _training_pid(config: Any) -> int | None:
    running = config.work_dir / "pools" / config.pool.id / "running"
    pidfiles = list(running.glob("train-*.pid")) if running.exists() else []
    record = read_record(pidfiles[0]) if pidfiles else None
    return record.pid if record else None


def _pool_state(config: Any) -> str:
    state = config.work_dir / "pools" / config.pool.id / "pool.json"
    return json.loads(state.read_text())["state"] if state.exists() else "absent"


def _group_alive(pgid: int) -> bool:
    return any(_safe_pgid(p.pid) == pgid for p in psutil.process_iter())


def _safe_pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_cancellation_through_the_api_stops_training_and_releases_the_pool(
    prefect_database: str,
    deployed: dict[str, Any],
    azurite: str,
    tmp_path: Path,
    digits_source: Path,
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    config = make_config(tmp_path, "training.epochs=60")
    seed(config, digits_source)
    config_file = tmp_path / "deployment.yaml"  # the deployment's config: the run changes none
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**prefect_api_env(), "AZURE_STORAGE_CONNECTION_STRING": azurite}
    # The run reads its deployment's config file while it runs: the default stays until it ends.
    with (
        deployment_defaults(deployed, {"config_path": str(config_file)}),
        process_worker(env) as queue,
    ):
        run = run_deployment("retrain/manual", timeout=0, work_queue_name=queue)
        pgid = _wait("the training task", lambda: _training_pid(config))
        started = time.monotonic()

        async def cancel() -> None:
            async with get_client() as client:
                await client.set_flow_run_state(run.id, Cancelling())

        asyncio.run(cancel())

        async def state() -> Any:
            async with get_client() as client:
                return (await client.read_flow_run(run.id)).state

        final = _wait(
            "the Cancelled state",
            lambda: (s := asyncio.run(state())) and s.is_cancelled() and s,
            120,
        )
        seconds = time.monotonic() - started
        assert final.is_cancelled()
        _wait("the pool's release", lambda: _pool_state(config) == "released", 30)
        assert _training_pid(config) is None
        assert not _group_alive(pgid), "training processes outlived the cancellation"
    report.record(
        "orchestrator",
        f"cancel through the Prefect API during training (server on {prefect_database})",
        "flow run Cancelled; Horovod job killed; pool released",
        seconds_to_cancelled=round(seconds, 1),
    )


def test_killed_flow_process_rerun_skips_finished_steps_and_resumes(
    azurite: str, tmp_path: Path, digits_source: Path
) -> None:
    config = make_config(tmp_path, "training.epochs=6")
    seed(config, digits_source)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**prefect_api_env(), "AZURE_STORAGE_CONNECTION_STRING": azurite}
    flow_process = subprocess.Popen(
        [sys.executable, "-m", "flows.retrain", "--config", str(path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    checkpoints = config.nfs.local_dir / "checkpoints"
    _wait("a first checkpoint", lambda: list(checkpoints.glob("*/checkpoint-1.pt")))
    flow_process.send_signal(signal.SIGKILL)  # the orchestrator dies; the node's job does not
    flow_process.wait()

    state = retrain(config=config, return_state=True)

    assert state.is_completed(), state.message
    steps = {s["step"]: s for s in state.result()["steps"]}
    assert steps["upload-scripts"]["status"] == "skipped"
    assert steps["stage-data"]["status"] == "skipped"
    resumed = steps["run-training"]["details"]["resumed_from_epoch"]
    assert resumed is not None and resumed >= 1
    assert _pool_state(config) == "released"
    report.record(
        "orchestrator",
        "flow process SIGKILLed during training, run again",
        "scripts and data skipped; training resumed",
        resumed_from_epoch=resumed,
        epochs_rerun=len(steps["run-training"]["details"]["epochs_run"]),
    )


@pytest.mark.parametrize(
    ("where", "overrides"),
    [
        # A repeat in `make test` of tests/flows/test_retrain_local.py's gate refusal, which
        # checks the pool too: run by `make reliability`.
        pytest.param("data gate", ["validation.min_images_per_class=1000"], marks=pytest.mark.slow),
        ("training", ["training.extra_args=['--no-such-option']", "retries.training_attempts=1"]),
    ],
)
def test_pool_is_released_on_every_failure_path(
    where: str, overrides: list[str], tmp_path: Path, digits_source: Path
) -> None:
    config = make_config(tmp_path, *overrides)
    seed(config, digits_source)
    state = retrain(config=config, return_state=True)
    assert state.is_failed()
    assert _pool_state(config) in ("released", "absent")
    assert _training_pid(config) is None
    report.record(
        "orchestrator",
        f"failure in {where} (local cluster)",
        f"flow failed; pool {_pool_state(config)}",
    )
