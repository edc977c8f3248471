"""The retrain flow logged to a real MLflow tracking server (``mlflow server``, as `make service`
starts it): the run, its epochs as they arrived, its final metrics, charts and model, the model
registered and the ``champion`` alias moved by a promotion and only by one; a server that is
down is a warning in the flow run's log."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.blob import container_client
from core.data_versions import DataVersion
from core.run import Run
from deployments.tracking_server import running_mlflow
from flows.retrain import retrain
from imagedata.make_images import write_digits
from registry.promotion import Decision
from tasks.tracking import CHAMPION_ALIAS, Tracker, registered_model_name
from tests.pipeline_helpers import flow_run_logs, make_config, seed, task_runs_and_artifacts

pytestmark = pytest.mark.usefixtures("prefect_api", "horovodrun")


@pytest.fixture(autouse=True)
def _storage(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_mlflow(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def _client(uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_a_flow_run_is_tracked_and_only_a_promotion_moves_the_champion_alias(
    tmp_path: Path, mlflow_uri: str
) -> None:
    source = tmp_path / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=20)
    config = make_config(tmp_path, f"tracking.mlflow_uri={mlflow_uri}", "training.epochs=2")
    seed(config, source)
    state = retrain(config=config, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["promoted"] is True  # the data root's first champion
    flow_run_id = str(state.state_details.flow_run_id)
    client = _client(mlflow_uri)

    experiment = client.get_experiment_by_name("retrain")
    (tracked,) = client.search_runs(
        [experiment.experiment_id], f"tags.`retrain.run_id` = '{result['run_id']}'"
    )
    run_id = tracked.info.run_id
    assert tracked.info.status == "FINISHED" and tracked.info.run_name == result["run_id"]
    tags, params, metrics = tracked.data.tags, tracked.data.params, tracked.data.metrics
    assert tags["prefect.flow_run_id"] == flow_run_id
    assert tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{flow_run_id}")
    assert f"({tags['prefect.flow_run_url']})" in tags["mlflow.note.content"]
    steps = {s["step"]: s for s in result["steps"]}
    assert params["code_version"] == steps["upload-scripts"]["details"]["code_version"]
    assert params["training.epochs"] == "2" and params["training.model"] == "cnn"
    assert params["data.container"] == config.data.container and params["data.version"] == ""

    # One point per epoch, the trainer's own numbers, at their epochs.
    outputs = container_client(config.output)
    prefix = f"runs/{result['run_id']}"
    trained = json.loads(outputs.download_blob(f"{prefix}/metrics.json").readall())
    for key in ("train_loss", "train_accuracy"):
        history = client.get_metric_history(run_id, key)
        assert sorted((m.step, m.value) for m in history) == [
            (e["epoch"], pytest.approx(e[key])) for e in trained["epochs"]
        ]
    assert metrics["test_accuracy"] == pytest.approx(result["accuracy"])
    assert metrics["trainer.test_accuracy"] == pytest.approx(trained["test_accuracy"])

    # The charts, the same bytes as the run's outputs, and where the model is.
    local = tmp_path / "artifacts"
    client.download_artifacts(run_id, "", str(local))
    for name in ("curves.png", "confusion.png"):
        png = outputs.download_blob(f"{prefix}/charts/{name}").readall()
        assert (local / "charts" / name).read_bytes() == png
    pointer = json.loads((local / "model" / "model.json").read_text())
    assert pointer["model_pt"] == f"{prefix}/model.pt"
    assert pointer["model_md5"] == trained["model_md5"] and pointer["promoted"] is True

    # Registered, and the champion alias on it: the pipeline promoted it.
    name = registered_model_name("retrain", config.data.root)
    champion = client.get_model_version_by_alias(name, CHAMPION_ALIAS)
    assert champion.run_id == run_id

    # The run's summary links to its page on the server.
    _, artifacts = task_runs_and_artifacts(state.state_details.flow_run_id)
    summary = next(a for a in artifacts if a.key == "retrain-summary").data
    link = f"{mlflow_uri}/#/experiments/{experiment.experiment_id}/runs/{run_id}"
    assert f"Tracked in MLflow: [the run's page]({link})" in summary

    # A model the pipeline does not promote is registered too, and the alias stays; with
    # model.onnx beside it (the trainer's export), the ONNX file is the version's model.
    later = Run("20991231-000000-later000", f"{prefix}-later", tmp_path)
    outputs.upload_blob(f"{later.output_prefix}/model.onnx", b"onnx bytes", overwrite=True)
    outputs.upload_blob(f"{later.output_prefix}/charts/curves.png", b"png", overwrite=True)
    warnings: list[str] = []
    tracker = Tracker(config, warnings.append)
    data = DataVersion.from_record(result["data"])
    tracker.start(later, data, "code", "staged")
    tracker.decided(later, Decision(False, "worse than the champion", "", {}), trained)
    tracker.reported(later)
    tracker.end(RuntimeError("the report failed"))
    assert warnings == []
    assert client.get_model_version_by_alias(name, CHAMPION_ALIAS).version == champion.version
    latest = client.get_model_version(name, tracker.version)
    assert latest.run_id == tracker.run_id and latest.tags["retrain.promoted"] == "false"
    assert client.get_run(tracker.run_id).info.status == "FAILED"
    got = Path(client.download_artifacts(tracker.run_id, "model/model.onnx", str(tmp_path)))
    assert got.read_bytes() == b"onnx bytes"
    assert len(client.search_runs([experiment.experiment_id])) == 2


def test_a_tracking_server_that_is_down_is_a_warning_in_the_runs_log(tmp_path: Path) -> None:
    """What the flow does with its tracker (tasks/tracking.py), in a flow run of its own: the
    warning comes from the tracker's thread and lands in the run's log; the run completes."""
    from prefect import flow, get_run_logger

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # nothing listens on it
        closed = s.getsockname()[1]
    config = make_config(tmp_path, f"tracking.mlflow_uri=http://127.0.0.1:{closed}")
    data = DataVersion("c", "digits", None, None, None, "a root without versions")

    @flow(name="tracked-while-down")
    def tracked() -> str:
        tracker = Tracker(config, get_run_logger().warning)
        run = Run("20261128-000000-down0000", "runs/20261128-000000-down0000", tmp_path)
        tracker.start(run, data, "code", "staged")
        tracker.epoch({"epoch": 1, "epochs": 1, "train_loss": 0.5})
        tracker.end()
        return "trained"

    state = tracked(return_state=True)
    assert state.is_completed() and state.result() == "trained"
    logs = flow_run_logs(state.state_details.flow_run_id)
    assert "tracking: starting the MLflow run failed" in logs
    assert f"server http://127.0.0.1:{closed}" in logs
    assert logs.count("tracking: ") == 1
