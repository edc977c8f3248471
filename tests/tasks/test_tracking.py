"""MLflow tracking (tasks/tracking.py): what a run logs, a tracking URI never holding a
credential, and a tracking server that is down or silent costing a run one bounded wait and a
warning, never a failure."""

from __future__ import annotations

import math
import socket
import time

import pytest

from core.config import ConfigError, load_config
from core.data_versions import DataVersion
from core.run import Run
from registry.promotion import Decision
from tasks.tracking import HTTP_BOUNDS, Tracker, final_metrics, registered_model_name, run_params
from tests.conftest import ROOT

LOCAL = ROOT / "configs" / "local.yaml"
DATA = DataVersion("training-data", "digits", "v1", "0x1", "2026-11-28T00:00:00+00:00", "named")


@pytest.mark.parametrize(
    "uri",
    [
        "http://user:secret@127.0.0.1:5000",
        "https://mlflow.example.com/?token=secret",
        "azureml://user:secret@eastus.api.azureml.ms/mlflow/v1.0/subscriptions/s",
        "azureml://eastus.api.azureml.ms/mlflow/v1.0/subscriptions/s?sig=secret",
    ],
)
def test_a_tracking_uri_with_a_credential_is_refused_without_repeating_it(uri: str) -> None:
    with pytest.raises(ConfigError, match=r"tracking\.mlflow_uri") as refused:
        load_config(LOCAL, [f"tracking.mlflow_uri={uri}"])
    assert "secret" not in str(refused.value)


def test_tracking_uris_a_server_or_an_azure_ml_workspace() -> None:
    workspace = (
        "azureml://eastus.api.azureml.ms/mlflow/v1.0/subscriptions/s/resourceGroups/r/providers"
        "/Microsoft.MachineLearningServices/workspaces/w"
    )
    for given, kept in (
        ("http://127.0.0.1:5000/", "http://127.0.0.1:5000"),
        (workspace, workspace),
        ("null", None),
    ):
        assert load_config(LOCAL, [f"tracking.mlflow_uri={given}"]).tracking.mlflow_uri == kept
    with pytest.raises(ConfigError, match="http\\(s\\) URL"):
        load_config(LOCAL, ["tracking.mlflow_uri=file:///tmp/mlruns"])


def test_the_final_metrics_are_the_scorers_and_the_trainers_numbers_only() -> None:
    score = {
        "accuracy": 0.9,
        "num_images": 40,
        "class_names": ["cat", "dog/wolf"],
        "per_class": {"cat": {"recall": 1.0, "f1": 0.9}, "dog/wolf": {"recall": 0.8, "f1": 0.85}},
    }
    metrics = {
        "test_accuracy": 0.91,
        "test_loss": math.nan,  # not a measurement: left out
        "world_size": 2,
        "timeline": True,  # a bool is no metric
        "model": "cnn",
        "onnx": {"top1_agreement": 1.0, "max_prob_diff": 2e-6, "provider": "cpu"},
    }
    assert final_metrics(metrics, score) == {
        "test_accuracy": 0.9,
        "test_num_images": 40.0,
        "test_recall.cat": 1.0,
        "test_f1.cat": 0.9,
        "test_recall.dog/wolf": 0.8,
        "test_f1.dog/wolf": 0.85,
        "trainer.test_accuracy": 0.91,
        "trainer.world_size": 2.0,
        "trainer.onnx.top1_agreement": 1.0,
        "trainer.onnx.max_prob_diff": 2e-6,
    }


def test_the_parameters_name_the_training_the_data_and_the_code() -> None:
    config = load_config(LOCAL, ["training.epochs=3", "training.extra_args=[--fp16-allreduce]"])
    params = run_params(config, DATA, "code123", "staged456")
    assert params["training.epochs"] == "3" and params["training.model"] == "cnn"
    assert params["training.extra_args"] == '["--fp16-allreduce"]'
    assert (params["data.version"], params["data.root"]) == ("v1", "digits")
    assert (params["code_version"], params["data.staged_version"]) == ("code123", "staged456")
    name = registered_model_name("retrain", config.data.root)
    assert name.startswith("retrain-training-data.digits-") and "/" not in name


def _tracker(uri: str, warnings: list[str]) -> Tracker:
    config = load_config(LOCAL, [f"tracking.mlflow_uri={uri}"])
    return Tracker(config, warnings.append)


def _whole_run(tracker: Tracker) -> None:
    """Every call a run makes of its tracker, in order."""
    run = Run("20261128-000000-abcdef12", "runs/20261128-000000-abcdef12", ROOT / ".work")
    tracker.start(run, DATA, "code", "staged", "abcdef12-0000", "http://127.0.0.1:4200/x")
    for epoch in (1, 2):
        tracker.epoch({"epoch": epoch, "epochs": 2, "train_loss": 0.5, "train_accuracy": 0.8})
    tracker.trained({"test_accuracy": 0.9}, {"accuracy": 0.9})
    decision = Decision(True, "no champion yet", "", {})
    tracker.decided(run, decision, {})
    tracker.reported(run)
    tracker.end()


def test_a_tracking_server_that_is_down_is_one_warning_and_tracking_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing listens: the first call fails at once, the run is warned once, and the calls
    after it are not made (no wait per epoch)."""
    for name in HTTP_BOUNDS:
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # a port of this machine that nothing listens on
        port = s.getsockname()[1]
    warnings: list[str] = []
    tracker = _tracker(f"http://127.0.0.1:{port}", warnings)
    began = time.monotonic()
    _whole_run(tracker)
    assert time.monotonic() - began < 60  # MLflow's own defaults retry for minutes
    assert len(warnings) == 2, warnings
    assert "starting the MLflow run failed" in warnings[0]
    assert "tracking is off for the rest of this run" in warnings[0]
    # The model was promoted: the run, its registration, the alias and its end are tried once
    # more at the end, and the warning says who repairs them.
    assert warnings[1].startswith(
        "tracking: at the run's end, the MLflow run, the model's registration and the champion "
        "alias, the run's end failed again ("
    )
    assert warnings[1].endswith(
        "the next run puts MLflow in line with the champion record when it starts"
    )
    assert tracker.link is None and tracker.run_id is None
    # MLflow's client reads its bounds from the environment: set where the user has not.
    assert {name: value for name in HTTP_BOUNDS if (value := _env(name))} == HTTP_BOUNDS


def _env(name: str) -> str | None:
    import os

    return os.environ.get(name)


@pytest.mark.processes  # listens on a socket: a server that never answers
def test_a_tracking_server_that_never_answers_costs_one_bounded_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It accepts connections and says nothing: the user's MLflow bounds are kept (here 1 s,
    one retry) and the run waits for them once, not once per call."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        warnings: list[str] = []
        tracker = _tracker(f"http://127.0.0.1:{silent.getsockname()[1]}", warnings)
        began = time.monotonic()
        _whole_run(tracker)
        waited = time.monotonic() - began
    assert len(warnings) == 2 and "Timeout" in warnings[0], warnings
    assert "failed again" in warnings[1] and "Timeout" in warnings[1], warnings
    assert waited < 30, waited  # one bounded wait at the start, one at the end
    assert _env("MLFLOW_HTTP_REQUEST_TIMEOUT") == "1"
    assert _env("MLFLOW_DISABLE_TELEMETRY") == "true"


def test_with_tracking_off_nothing_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    warnings: list[str] = []
    tracker = _tracker("null", warnings)
    _whole_run(tracker)
    assert warnings == [] and tracker.off == "tracking is off" and tracker.link is None
