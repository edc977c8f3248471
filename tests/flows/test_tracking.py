"""The retrain flow logged to a real MLflow tracking server (``mlflow server``, as `make service`
starts it): the run, its epochs as they arrived, its final metrics, charts and model, the model
registered and the ``champion`` alias moved by a promotion and only by one; a server that is
down is a warning in the flow run's log."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.blob import container_client
from core.data_versions import DataVersion
from core.run import Run, output_prefix
from deployments.tracking_server import running_mlflow
from flows.retrain import retrain
from imagedata.make_images import write_digits
from registry.promotion import Decision
from tasks.tracking import CHAMPION_ALIAS, Tracker, registered_model_name
from tests.fakes.batch import wait_until
from tests.pipeline_helpers import flow_run_logs, make_config, seed, task_runs_and_artifacts
from tests.reliability import report

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
    # Both in MLflow's classic view (its UI otherwise opens on GenAI pages), and the experiment
    # says it is one of machine learning.
    runs = f"{mlflow_uri}/#/experiments/{experiment.experiment_id}/runs"
    link = f"{runs}/{run_id}?workflowType=machine_learning"
    assert (
        f"Tracked in MLflow: [the run's page]({link}), among [the experiment's runs]"
        f"({runs}?workflowType=machine_learning)."
    ) in summary
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert result["tracking"] == f"{runs}?workflowType=machine_learning"
    report.record(
        "adversarial",
        "first week: the MLflow links a run gives (its summary; a command-line run prints one)",
        "the run's page and the experiment's runs, in MLflow's classic view "
        "(?workflowType=machine_learning); the experiment tagged as one of machine learning",
        before_fix="no link to the experiment's runs; docs/tracking.md sent users to the "
        "server's bare address, which MLflow 3 opens on its GenAI pages",
    )

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


class Gate:
    """A TCP forwarder to the MLflow server on a port of its own. Open, it forwards; shut,
    nothing listens on its port (a client's connection is refused, as by a server that is
    down) and the connections it held are closed."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self._listener: socket.socket | None = None
        self._held: list[socket.socket] = []
        self.open()

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.port, self._listener = listener.getsockname()[1], listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def shut(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            # Stops the listening (close alone leaves the accept blocked on it, and listening).
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for held in self._held:
            with contextlib.suppress(OSError):
                held.shutdown(socket.SHUT_RDWR)
            held.close()
        self._held.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # shut
            server = socket.create_connection(("127.0.0.1", self.target))
            self._held += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def test_the_alias_and_the_run_follow_the_champion_record_through_a_server_that_refused(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The case found: MLflow refused connections during a promoting run's epochs; tracking
    went off, so the alias stayed on the 0.07 model, the new one was never registered and its
    MLflow run stayed RUNNING, for good. Now the run's end tries them again (the server is back:
    done); and a run whose end was refused too is put right by the next run's start, which
    names the stale alias in its summary."""
    from core.text import markdown_text
    from registry.champion import Champion, champion_for, replace_champion
    from registry.run_record import RunRecord, write_run_record
    from tasks.report import tracking_lines

    for name, value in (("MAX_RETRIES", "0"), ("BACKOFF_FACTOR", "0"), ("TIMEOUT", "5")):
        monkeypatch.setenv(f"MLFLOW_HTTP_REQUEST_{name}", value)
    gate = Gate(int(mlflow_uri.rsplit(":", 1)[1]))
    config = make_config(tmp_path, f"tracking.mlflow_uri=http://127.0.0.1:{gate.port}")
    outputs = container_client(config.output, create=True)
    root = config.data.root
    data = DataVersion(root.container, root.prefix, None, None, None, "a root without versions")
    client = _client(mlflow_uri)  # around the gate
    name = registered_model_name("retrain", root)
    said: list[str] = []

    def run(n: int) -> Run:
        run_id = f"20261201-00000{n}-0000000{n}"
        return Run(run_id, output_prefix(config.output.prefix, run_id), tmp_path)

    def crowned(run: Run, accuracy: float) -> Decision:
        """As the pipeline's promotion does: the record first, then the tracker is told."""
        model = f"{run.output_prefix}/model.pt"
        new = Champion(run.id, "accuracy", accuracy, model, "s", "t", root=root)
        replace_champion(outputs, "", root, new, champion_for(outputs, "", root))
        ended = RunRecord(run.id, "promoted", "2026-12-01T00:00:00+00:00", data.as_record())
        write_run_record(outputs, run.output_prefix, ended)
        return Decision(True, f"accuracy {accuracy}", "", {})

    def tracked_until_refused(run: Run) -> Tracker:
        tracker = Tracker(config, said.append)
        tracker.start(run, data, "code", "staged")
        gate.shut()
        tracker.epoch({"epoch": 1, "epochs": 2, "train_loss": 0.5})
        wait_until(lambda: tracker.off is not None)
        return tracker

    first = run(1)
    tracker = Tracker(config, said.append)
    tracker.start(first, data, "code", "staged")
    tracker.decided(first, crowned(first, 0.0708), {})
    tracker.end()
    assert said == []
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == "1"

    # Refused during the epochs, back before the end: the end registers and moves the alias.
    second = run(2)
    tracker = tracked_until_refused(second)
    gate.open()
    tracker.decided(second, crowned(second, 0.9735), {})
    tracker.end()
    assert "tracking: logging epoch 1 failed: " in said[0], said
    assert said[1] == (
        "tracking: at the run's end, the model's registration and the champion alias, the run's "
        "end reached MLflow after all"
    )
    champion = client.get_model_version_by_alias(name, CHAMPION_ALIAS)
    assert champion.tags["retrain.run_id"] == second.id
    assert client.get_run(tracker.run_id).info.status == "FINISHED"

    # Refused from the epochs to the end, retry included: left for the next run.
    third = run(3)
    tracker = tracked_until_refused(third)
    tracker.decided(third, crowned(third, 0.98), {})
    tracker.end()
    assert said[-1].startswith(
        "tracking: at the run's end, the model's registration and the champion alias, the run's "
        "end failed again ("
    ), said[-1]
    left_running = tracker.run_id
    assert client.get_model_version_by_alias(name, CHAMPION_ALIAS).version == champion.version
    assert client.get_run(left_running).info.status == "RUNNING"

    # The next run's start: the record's champion registered, the alias moved, the run ended.
    gate.open()
    fourth = run(4)
    tracker = Tracker(config, said.append)
    tracker.start(fourth, data, "code", "staged")
    tracker.end()
    moved = client.get_model_version_by_alias(name, CHAMPION_ALIAS)
    assert moved.tags["retrain.run_id"] == third.id and moved.run_id == left_running
    assert client.get_run(left_running).info.status == "FINISHED"
    summary = tracker.summary()
    assert summary is not None
    stale = (
        f"the `champion` alias of {name} named version {champion.version}, not the recorded "
        f"champion's (run {third.id}): moved to version {moved.version}"
    )
    assert stale in summary.notes
    assert f"- {markdown_text(stale)}" in tracking_lines(summary)
    gate.shut()
    report.record(
        "orchestrator",
        "MLflow refused connections during a promoting run's epochs (then back; then, for "
        "another run, refused through its end)",
        "the run's end registered the model, moved the alias and ended the run; the run whose "
        "end was refused too was put right by the next run's start, the stale alias named in "
        "its summary",
        before_fix="tracking off for the rest of the run: the alias stayed on the 0.07 model, "
        "the new one unregistered, its MLflow run RUNNING for good",
    )
