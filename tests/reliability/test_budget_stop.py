"""The budget's stop, end to end on the local target: a run whose estimate passes its budget but
whose spend passes it while training stops at a checkpoint, released, reported as stopped by
budget (not failed), its checkpoints kept for the next run to resume from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.blob import container_client
from backends.taskspec import stop_request
from core.cost_estimate import Work, history_record
from imagedata.make_images import write_digits
from registry.run_record import RunRecord, write_run_record
from tests.pipeline_helpers import make_config, seed
from tests.reliability import report
from training.checkpoint import FINISHED

BUDGET = 17


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_api", "horovodrun")
def test_a_run_whose_spend_passes_its_budget_stops_at_a_checkpoint(
    tmp_path: Path, azurite: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.retrain import retrain

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)

    source = tmp_path / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=40)
    # 1000 a node-hour, 17 to spend (about a minute): the estimate (from two earlier runs whose
    # records say the root trains in seconds) passes, then 200 epochs run past the budget.
    config = make_config(
        tmp_path, "training.epochs=200", "pool.hourly_price=1000", f"budget.max_run_cost={BUDGET}"
    )
    seed(config, source)
    outputs = container_client(config.output, create=True)
    root = {"container": config.data.container, "root": config.data.prefix}
    for i, epochs in enumerate((1, 2)):
        minutes = {"allocating": 0.01, "training": 0.001 * epochs, "scoring": 0.01}
        work = Work("cnn", 1, config.training.batch_size, epochs, 300, 1e5, 100)
        cost = history_record("local", 1, minutes, 0.01, 400, work, None)
        record = RunRecord(f"20260101-00000{i}-past", "promoted", "", root, 0.9, cost=cost)
        write_run_record(outputs, f"runs/{record.run_id}", record)

    state = retrain(config=config, return_state=True)

    assert state.is_completed(), state.message  # stopped by budget is not a failure
    result = state.result()
    k = result["stopped_after_epoch"]
    assert result["stopped"] == "budget" and 0 <= k < 200, result
    assert "the run's spend reached its budget" in result["reason"]
    steps = {s["step"]: s for s in result["steps"]}
    assert steps["estimate-cost"]["details"]["history_runs"] == 2
    assert steps["run-training"]["details"]["stopped_after_epoch"] == k
    assert "collect-and-score" not in steps and "promote" not in steps
    assert steps["release-pool"]["status"] == "ran"
    record = json.loads(outputs.download_blob(f"runs/{result['run_id']}/run.json").readall())
    assert record["outcome"] == "stopped by budget" and record["cost"]["paid"] > BUDGET * 0.5
    assert not (config.share.local_dir / stop_request(f"train-{result['run_id']}")).exists()
    if k:  # on a busy machine the trainer may not have reached its first epoch in a minute
        (folder,) = (config.nfs.local_dir / "checkpoints").iterdir()
        # Kept, unfinished: the next run of these inputs resumes there.
        assert (folder / f"checkpoint-{k}.pt").exists() and not (folder / FINISHED).exists()
    report.record(
        "cost",
        "a run whose spend passes budget.max_run_cost while training",
        f"stopped after epoch {k} of 200, paid {record['cost']['paid']:.1f} of {BUDGET}",
    )
