"""The champion's recipe read from a record anyone with write access to the output container
may edit: a retrain that follows the champion (``training.follow_champion``, the nightly's) takes
its settings from the champion run's ``metrics.json``. Each value is checked as a run's own
would be, and the run stops before its pool is provisioned, naming every value refused; nothing
stored changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.blob import container_client
from registry.champion import Champion, champion_for, replace_champion
from tasks.follow_champion import follow
from tasks.init_from import InitFromConfigError
from tests.core.test_recipe import CHAMPION_ARGS
from tests.pipeline_helpers import make_config
from tests.reliability import report

RUN = "20261101-000000-aaaaaaaa"


@pytest.fixture(autouse=True)
def _storage(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)


def test_a_tampered_recipe_stops_the_run_before_provisioning_naming_each_value(
    tmp_path: Path,
) -> None:
    config = make_config(tmp_path, "training.follow_champion=true")
    outputs = container_client(config.output, create=True)
    args = {**CHAMPION_ARGS, "batch_size": 100000, "lr": -5, "epochs": 1e6}
    args["momentum"] = float("nan")  # json writes NaN, as a trainer's float would be
    metrics = json.dumps({"args": args, "model": "cnn", "input_size": 64})
    outputs.upload_blob(f"runs/{RUN}/metrics.json", metrics)
    root = config.data.root
    crowned = Champion(RUN, "accuracy", 0.9, f"runs/{RUN}/model.pt", None, "2026", root=root)
    replace_champion(outputs, "", root, crowned, champion_for(outputs, "", root))
    before = {b.name: b.etag for b in outputs.list_blobs()}

    with pytest.raises(InitFromConfigError) as refused:
        follow(config, {})  # the step before resolve-init-from, the pool and staging
    message = str(refused.value)
    assert message.startswith(f"follow_champion: the champion's recipe (run {RUN})")
    for name in ("epochs 1000000.0", "batch_size 100000", "lr -5", "momentum nan"):
        assert name in message, message
    assert {b.name: b.etag for b in outputs.list_blobs()} == before
    report.record(
        "adversarial",
        "follow_champion: the champion's metrics.json edited to batch_size 100000, lr -5, "
        "epochs 1e6, momentum nan",
        "refused at the follow-champion step, before the pool and staging, naming each value; "
        "nothing stored changed",
        message=message,
        before_fix="applied as they were: the pool was provisioned and the data staged before "
        "the trainer on the node refused them",
    )
