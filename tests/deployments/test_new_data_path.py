"""The README's path for new data, end to end, on the real Prefect server and Azurite.

The seeded data is version v1 (as `make azurite` seeds it); v2 arrives through the Event Grid
relay, then the nightly runs; v3 arrives while only the polling sensor looks, then the nightly
runs again, and a person starts a manual run with nothing new. Every run is started by its
deployment in prefect.yaml (the relay's and the sensor's through the on-new-data trigger, the
automation the server runs) and executed as the process worker executes one: its Pending state
proposed (which takes the deployment's concurrency slot), then `prefect flow-run execute`, the
command the worker starts. They run one at a time, in the scenario's order, so what each one
finds is the scenario's and not a race's.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.blob import container_client, upload_directory
from core.config import PipelineConfig, load_config
from imagedata.make_images import write_digits
from registry.store import list_runs
from servers.relay import RelaySettings
from tests.conftest import ROOT, child_env, prefect_api_env
from tests.deployments.test_deployments import (
    SECRET,
    _eg_event,
    _post,
    _runs_for,
    _wait_for_runs,
    serving_relay,
)
from tests.pipeline_helpers import deployment_defaults, execute_as_worker, task_runs_and_artifacts

pytestmark = pytest.mark.usefixtures("prefect_api", "horovodrun")


def _service_config(tmp_path: Path) -> Path:
    """configs/local.yaml on containers and folders of the test's own, with tiny training: the
    config every deployment's runs use here, as configs/local.yaml is theirs in the README."""
    suffix = uuid.uuid4().hex[:8]
    config = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    config["data"] = {**config["data"], "container": f"path-{suffix}", "prefix": "digits"}
    config["output"] = {**config["output"], "container": f"path-out-{suffix}"}
    config["share"] = {"local_dir": str(tmp_path / "share")}
    config["nfs"] = {"local_dir": str(tmp_path / "nfs")}
    config["work_dir"] = str(tmp_path / "work")
    config["pool"] = {**config["pool"], "id": f"pool-{suffix}", "processes_per_node": 1}
    config["training"] = {**config["training"], "epochs": 1, "batch_size": 16, "model": "cnn"}
    config["validation"] = {**config["validation"], "min_images_per_class": 2}
    # One epoch is near chance: no floor, or whether the first model is promoted is chance.
    config["promotion"] = {**config["promotion"], "minimum": {"class_recall": None}}
    config["tracking"] = {"mlflow_uri": None}  # not `make service`'s MLflow server
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _digits(tmp_path: Path, name: str, seed: int) -> Path:
    """160 real digits; the seeds used give every class 3 test images or more."""
    source = tmp_path / name
    write_digits(source, test_fraction=0.3, seed=seed, per_class=16)
    return source


def _execute(run: Any, azurite: str) -> Any:
    """Run one flow run as the process worker does; its final state."""
    env = {**child_env(), **prefect_api_env(), "AZURE_STORAGE_CONNECTION_STRING": azurite}
    state, output = execute_as_worker(run, env)
    assert state is not None and state.is_completed(), (
        f"{run.name}: {state and state.message}\n{output}"
    )
    return state


def _start(deployment: str) -> Any:
    from prefect.deployments import run_deployment

    return run_deployment(deployment, timeout=0)


def _upload_version(config: PipelineConfig, source: Path, version: str) -> list[tuple[str, str]]:
    """Upload ``source`` as ``version`` of the data root, marker last; (blob, ETag) of each in
    the order written, as Event Grid would report them."""
    container = container_client(config.data)
    folder = config.data.root.folder(version)
    upload_directory(container, source, folder)
    written = [(b.name, b.etag) for b in container.list_blobs(name_starts_with=f"{folder}/")]
    marker = container.upload_blob(config.data.root.marker(version), b"")
    return [*written, (marker.blob_name, marker.get_blob_properties().etag)]


def test_each_version_is_trained_once_whichever_way_it_arrives(
    deployed: dict[str, Any],
    azurite: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cli.models import main as models
    from scripts.demo import seed

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)
    config_file = _service_config(tmp_path)
    config = load_config(config_file)
    container = config.data.container
    on_new_data = deployed["retrain/on-new-data"].id
    seed(config, _digits(tmp_path, "v1", 0), azurite)  # `make azurite`: the seeded data is v1

    with deployment_defaults(deployed, {"config_path": str(config_file)}):
        # v2 through Event Grid: every blob reported, the marker last; one run, for v2.
        relay = RelaySettings.from_env(
            {"RETRAIN_RELAY_CONFIG": str(config_file), "RETRAIN_RELAY_SECRET": SECRET}
        )
        blobs = _upload_version(config, _digits(tmp_path, "v2", 1), "v2")
        with serving_relay(relay) as (url, _):
            for start in range(0, len(blobs), 50):
                batch = [_eg_event(container, name, etag) for name, etag in blobs[start:][:50]]
                outcomes = _post(url, batch).json()["outcomes"]
            assert outcomes[-1] == "started" and set(outcomes[:-1]) <= {"waiting for the marker"}
            marker = _eg_event(container, *blobs[-1])
            assert _post(url, [marker]).json()["outcomes"] == ["version already started"]
        (v2_run,) = _wait_for_runs(on_new_data, container, 1)
        assert (v2_run.parameters["data_prefix"], v2_run.parameters["data_version"]) == (
            "digits",
            "v2",
        )
        _execute(v2_run, azurite)

        _execute(_start("retrain/nightly"), azurite)  # v2, the newest, is trained already

        # v3 while only the sensor looks: it reports v3, and v1, which no event reported.
        _upload_version(config, _digits(tmp_path, "v3", 3), "v3")
        _execute(_start("watch-new-data/poll"), azurite)
        runs = _wait_for_runs(on_new_data, container, 3)
        # The sensor reports v1 before v3 (their markers' order), but the trigger's automation
        # may create their runs in either order: run them oldest version first.
        sensed = sorted(
            (r for r in runs if r.id != v2_run.id), key=lambda r: r.parameters["data_version"]
        )
        assert [r.parameters["data_version"] for r in sensed] == ["v1", "v3"]
        for run in sensed:
            _execute(run, azurite)

        _execute(_start("retrain/nightly"), azurite)
        manual = _start("retrain/manual")
        _execute(manual, azurite)
        assert len(_runs_for(on_new_data, container)) == 3  # nothing reported twice

    outputs = container_client(config.output)
    entries = list_runs(outputs, config.output.prefix, [config.data.root])
    assert [(e.data, e.outcome) for e in entries] == [
        ("v2", "promoted"),  # the first model
        ("v2", "up to date"),
        ("v1", entries[2].outcome),
        ("v3", entries[3].outcome),
        ("v3", "up to date"),
        ("v3", "up to date"),
    ]
    trained = Counter(e.data for e in entries if e.outcome in ("promoted", "not promoted"))
    assert trained == {"v1": 1, "v2": 1, "v3": 1}
    assert all(e.accuracy is not None for e in entries if e.outcome != "up to date")
    by_id = {e.run_id: e for e in entries}
    for e in entries:
        if e.outcome == "up to date":  # it matched the run that trained this version
            matched = e.reason.rsplit("run ", 1)[1]
            assert by_id[matched].data == e.data and by_id[matched].accuracy is not None

    # What a person reads: the data version and the decision of each run.
    capsys.readouterr()
    assert models(["--config", str(config_file), "list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["run", "data", "root", "version", "accuracy", "decision"]
    for line, e in zip(table[1:], entries, strict=True):
        assert line.split()[:3] == [e.run_id, config.data.root.where, e.data]
        assert e.outcome in line
    # Up-to-date runs rented nothing: no training step ran in the manual run.
    steps, artifacts = task_runs_and_artifacts(manual.id)
    assert "run-training" not in steps and "stage-data" not in steps
    summary = next(a for a in artifacts if a.key == "retrain-summary").data
    assert "version v3 of" in summary and "up to date" in summary
