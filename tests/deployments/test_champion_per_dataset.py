"""One champion per data root, through the deployment as a person uses it: two runs of
retrain/manual started as the run form starts them (the second with another data_prefix, a
dataset of other classes), executed by a real `prefect worker` on the session's Prefect server,
with Azurite and the real trainer.

Before, the second run found the first dataset's champion under the same output prefix, could
not score it on its own classes, and replaced it: the first dataset's pipeline then served (and
labelled with) the second one's classes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from backends.blob import container_client, upload_directory
from core.config import load_config
from core.data_versions import DataRoot
from imagedata.make_images import write_synthetic
from registry.champion import champion_for
from registry.store import list_runs
from tests.conftest import child_env, prefect_api_env
from tests.deployments.test_new_data_path import _digits, _service_config
from tests.pipeline_helpers import deployment_defaults, process_worker
from tests.reliability import report

pytestmark = pytest.mark.usefixtures("prefect_api", "horovodrun")


def _final_state(run_id: Any, seconds: float) -> Any:
    from prefect.client.orchestration import get_client

    async def read() -> Any:
        async with get_client() as client:
            state = (await client.read_flow_run(run_id)).state
        return state if state and state.is_final() else None

    deadline = time.monotonic() + seconds
    while (state := asyncio.run(read())) is None:
        assert time.monotonic() < deadline, f"flow run {run_id} not finished after {seconds} s"
        time.sleep(1)
    return state


# In `make test`, each part has its own test: a champion per data root, tests/registry/
# test_promotion.py::test_another_data_root_has_a_champion_of_its_own; a form run executed by a
# worker, tests/flows/test_adversarial_params.py::test_deployment_run_from_the_form_trains_with_
# the_form_values; runs over other data_prefix values by a worker, tests/deployments/
# test_new_data_path.py. The two worker runs here together: `make reliability`.
@pytest.mark.slow
def test_a_form_run_over_another_data_root_leaves_the_first_champion_in_place(
    deployed: dict[str, Any],
    azurite: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from prefect.deployments import run_deployment

    from cli.models import main as models

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)  # the worker has it too
    config_file = _service_config(tmp_path)
    config = load_config(config_file)
    data = container_client(config.data, create=True)
    upload_directory(data, _digits(tmp_path, "digits", 0), "digits")  # the config's data root
    faces = tmp_path / "faces"  # another dataset: two classes of its own
    write_synthetic(faces, classes=2, per_class=12, size=16, test_fraction=0.3, seed=1)
    upload_directory(data, faces, "faces")
    digits_root, faces_root = config.data.root, DataRoot(config.data.container, "faces")
    env = {**child_env(), **prefect_api_env(), "AZURE_STORAGE_CONNECTION_STRING": azurite}

    with (
        deployment_defaults(deployed, {"config_path": str(config_file)}),
        process_worker(env) as queue,
    ):
        first = run_deployment("retrain/manual", timeout=0, work_queue_name=queue)
        state = _final_state(first.id, 600)
        assert state.is_completed(), state.message
        # The form, with only its data root changed.
        other = run_deployment(
            "retrain/manual",
            parameters={"data_prefix": "faces"},
            timeout=0,
            work_queue_name=queue,
        )
        state = _final_state(other.id, 600)
        assert state.is_completed(), state.message

    outputs = container_client(config.output)
    entries = {e.root: e for e in list_runs(outputs, config.output.prefix, [digits_root])}
    digits_run, faces_run = entries[digits_root.where], entries[faces_root.where]
    assert digits_run.outcome == faces_run.outcome == "promoted"
    assert faces_run.reason.startswith(f"no champion of {faces_root.where} yet")
    kept = champion_for(outputs, config.output.prefix, digits_root).champion
    assert kept is not None and kept.run_id == digits_run.run_id
    assert kept.classes == tuple(f"digit_{i}" for i in range(10))
    their = champion_for(outputs, config.output.prefix, faces_root).champion
    assert their is not None and their.run_id == faces_run.run_id
    assert their.classes == ("class_0", "class_1")

    # What a person reads: both champions marked, each with its data root; a download names
    # the dataset whose champion it is.
    capsys.readouterr()
    assert models(["--config", str(config_file), "list"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert sorted(r.split()[1] for r in rows if r.endswith("<- champion")) == sorted(
        [digits_root.where, faces_root.where]
    )
    to = tmp_path / "model.pt"
    assert models(["--config", str(config_file), "download", "--to", str(to)]) == 0
    out = capsys.readouterr().out
    assert f"the champion of data root {digits_root.where}: run {digits_run.run_id}" in out
    report.record(
        "adversarial",
        "a form run of retrain/manual over another data root (other classes), by a worker",
        "promoted as that root's first champion; the first root's champion stays",
    )
