"""MLflow's registry kept in line with the champion record (registry/mlflow_registry.py), against
a real MLflow store (MLflow's own SQLite store, in this process: no server is needed to check
what the repairs decide; tests/flows/test_tracking.py runs them through a server that refused a
run's calls)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.data_versions import DataRoot
from core.mlflow_env import mlflow_environment
from registry.champion import Champion
from registry.mlflow_registry import (
    CHAMPION_ALIAS,
    ModelFiles,
    alias_version,
    reconcile,
    register,
    version_of,
)
from tests.reliability import report

NAME = "retrain-c.images-0123456789"
ROOT = DataRoot("c", "images")


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty store, its tables made once (MLflow's migrations take seconds)."""
    mlflow_environment()
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow") / "empty.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def store(migrated: Path, tmp_path: Path) -> Iterator[tuple[Any, str]]:
    """A client of a store of this test's own, and its experiment."""
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    shutil.copy(migrated, db)
    client = MlflowClient(tracking_uri=f"sqlite:///{db}", registry_uri=f"sqlite:///{db}")
    experiment = client.create_experiment("retrain", artifact_location=str(tmp_path / "art"))
    yield client, experiment


def _champion(run_id: str) -> Champion:
    return Champion(run_id, "accuracy", 0.97, f"runs/{run_id}/model.pt", "v", "2026", root=ROOT)


def _files(champion: Champion) -> ModelFiles:
    return ModelFiles({"run_id": champion.run_id, "model_pt": champion.model})


def _run(client: Any, experiment: str, run_id: str) -> str:
    made = client.create_run(experiment, run_name=run_id, tags={"retrain.run_id": run_id})
    return str(made.info.run_id)


def _registered(client: Any, experiment: str, run_id: str, promoted: bool) -> str:
    mlflow_run = _run(client, experiment, run_id)
    files = _files(_champion(run_id))
    version = register(client, NAME, "d", mlflow_run, run_id, files, promoted, "why")
    client.set_terminated(mlflow_run, "FINISHED")
    return version


def test_a_stale_alias_is_moved_to_the_recorded_champion(store: tuple[Any, str]) -> None:
    """The run that promoted B registered it, but its alias move never reached MLflow: the
    alias still names A's version. The next run moves it and says so."""
    client, experiment = store
    assert _registered(client, experiment, "r-a", True) == "1"
    assert _registered(client, experiment, "r-b", False) == "2"
    assert alias_version(client, NAME) == "1"
    notes = reconcile(client, NAME, experiment, _champion("r-b"), _files, lambda r: None)
    assert notes == [
        f"the `champion` alias of {NAME} named version 1, not the recorded champion's (run "
        "r-b): moved to version 2"
    ]
    assert alias_version(client, NAME) == "2"
    assert reconcile(client, NAME, experiment, _champion("r-b"), _files, lambda r: None) == []


def test_an_unregistered_champion_is_registered_and_ended_runs_are_ended(
    store: tuple[Any, str],
) -> None:
    """The champion's run never got past its epochs in MLflow: its model unregistered, its
    MLflow run RUNNING. The next run registers the model from that MLflow run, moves the alias
    and ends the runs whose flow runs have ended (as their records say), and only those."""
    client, experiment = store
    _registered(client, experiment, "r-a", True)
    promoted = _run(client, experiment, "r-c")  # the champion, left RUNNING
    crashed = _run(client, experiment, "r-d")  # its record says failed
    busy = _run(client, experiment, "r-e")  # its record says running: maybe it is
    current = _run(client, experiment, "r-now")  # this run's own
    outcomes = {"r-c": "promoted", "r-d": "failed", "r-e": "running", "r-now": "running"}
    notes = reconcile(
        client, NAME, experiment, _champion("r-c"), _files, outcomes.get, current=current
    )
    assert sorted(notes) == sorted(
        [
            "MLflow run r-c was left RUNNING after its flow run ended (promoted): ended as "
            "FINISHED",
            "MLflow run r-d was left RUNNING after its flow run ended (failed): ended as FAILED",
            f"the recorded champion, run r-c, was not registered in MLflow: registered as "
            f"version 2 of {NAME}",
            f"the `champion` alias of {NAME} named version 1, not the recorded champion's (run "
            "r-c): moved to version 2",
        ]
    )
    version = client.get_model_version_by_alias(NAME, CHAMPION_ALIAS)
    assert (str(version.version), version.run_id) == ("2", promoted)
    assert version.tags == {"retrain.run_id": "r-c", "retrain.promoted": "true"}
    status = {r: client.get_run(r).info.status for r in (promoted, crashed, busy, current)}
    assert status == {
        promoted: "FINISHED",
        crashed: "FAILED",
        busy: "RUNNING",
        current: "RUNNING",
    }


def test_a_champion_with_no_mlflow_run_gets_one(store: tuple[Any, str], tmp_path: Path) -> None:
    client, experiment = store
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"onnx bytes")

    def files(champion: Champion) -> ModelFiles:
        return ModelFiles({"run_id": champion.run_id}, onnx)

    notes = reconcile(client, NAME, experiment, _champion("r-f"), files, lambda r: None)
    assert len(notes) == 2 and "registered as version 1" in notes[0]
    version = client.get_model_version_by_alias(NAME, CHAMPION_ALIAS)
    made = client.get_run(version.run_id)
    assert made.info.run_name == "r-f" and made.info.status == "FINISHED"
    assert made.data.tags["retrain.reconciled"] == "1"
    got = client.download_artifacts(version.run_id, "model/model.onnx", str(tmp_path / "dl"))
    assert Path(got).read_bytes() == b"onnx bytes"


def test_registration_is_found_before_it_is_made_again(store: tuple[Any, str]) -> None:
    """A retry after a lost answer registers nothing twice."""
    client, experiment = store
    mlflow_run = _run(client, experiment, "r-g")
    files = _files(_champion("r-g"))
    first = register(client, NAME, "d", mlflow_run, "r-g", files, False, "why")
    again = register(client, NAME, "d", mlflow_run, "r-g", files, True, "why")
    assert first == again == version_of(client, NAME, "r-g") == "1"
    assert len(client.search_model_versions(f"name = '{NAME}'")) == 1
    assert alias_version(client, NAME) == "1"


def test_no_champion_record_or_a_hostile_one_leaves_the_alias(store: tuple[Any, str]) -> None:
    client, experiment = store
    _registered(client, experiment, "r-a", True)
    assert reconcile(client, NAME, experiment, None, _files, lambda r: None) == []
    hostile = _champion("r-a' or name != 'x")  # a record edited to hold a quote
    assert reconcile(client, NAME, experiment, hostile, _files, lambda r: None) == []
    assert alias_version(client, NAME) == "1"


def test_mlflows_telemetry_is_off_wherever_the_project_sets_its_environment() -> None:
    """MLflow's documented switch, set in this process for the tracker and in the server's
    environment (deployments/tracking_server.py)."""
    from deployments.tracking_server import mlflow_component

    env: dict[str, str] = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "7"}
    mlflow_environment(env, {"MLFLOW_HTTP_REQUEST_TIMEOUT": "15", "X": "1"})
    assert env == {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_HTTP_REQUEST_TIMEOUT": "7", "X": "1"}
    server = mlflow_component("127.0.0.1", 5000, "sqlite:///x.db", Path("/tmp/x"), {})
    assert server.env["MLFLOW_DISABLE_TELEMETRY"] == "true"
    report.record(
        "adversarial",
        "MLflow's telemetry, in the tracker's process and the server of `make service`",
        "off: MLFLOW_DISABLE_TELEMETRY=true (MLflow's documented switch) set wherever the "
        "project sets MLflow's environment, before mlflow is imported",
        before_fix="on: its thread, on a machine with no route out, failed 1 of 8 tracked runs' "
        "calls with KeyError '_MLFLOW_TELEMETRY_SESSION_ID'",
    )
