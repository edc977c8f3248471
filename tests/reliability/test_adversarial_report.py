"""The end of a run: its report and the records the next run reads.

Class folders named like matplotlib's mathtext failed the report after the promotion and the
last-run record were written: the run ended FAILED with no summary, and the next run said "up to
date" on the strength of a record of a failed run. Recorded for docs/reliability.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from azure.core.exceptions import ResourceNotFoundError

import tasks.report
from backends.blob import container_client
from flows.retrain import retrain
from imagedata.make_images import write_digits
from registry.layout import last_run_blob
from tests.pipeline_helpers import make_config, seed, task_runs_and_artifacts
from tests.reliability import report

pytestmark = pytest.mark.usefixtures("prefect_api", "horovodrun")

# Folder names a class may have: "$x^$" is a mathtext syntax error, deep braces inside dollars
# recursed past Python's limit (RecursionError) when matplotlib parsed them.
HOSTILE_CLASSES = {"digit_1": "$x^$", "digit_2": "$" + "{" * 120 + "}" * 120 + "$"}


@pytest.fixture(autouse=True)
def _storage(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)


def _digits_with_hostile_class_names(root: Path) -> Path:
    write_digits(root, test_fraction=0.3, seed=0, per_class=14)
    for split in ("train", "test"):
        for old, new in HOSTILE_CLASSES.items():
            (root / split / old).rename(root / split / new)
    return root


def _last_run(config: Any) -> bytes | None:
    try:
        return bytes(
            container_client(config.output)
            .download_blob(last_run_blob(config.output.prefix, config.data.root))
            .readall()
        )
    except ResourceNotFoundError:
        return None


def test_mathtext_class_names_get_a_report_and_a_failed_report_leaves_no_last_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """First run: the Prefect API refuses the summary artifact (a server fault injected where
    the report calls Prefect's client), so the run fails in its report, after the promotion:
    no last-run record may exist, or the next run would end as up to date. Second run, same
    data and settings: it is not up to date (nothing says a run of these inputs succeeded), and
    with the mathtext class names its report, summary and pictures are complete."""
    config = make_config(tmp_path, "training.epochs=1", "pool.processes_per_node=1")
    seed(config, _digits_with_hostile_class_names(tmp_path / "digits"))
    create_markdown_artifact = tasks.report.create_markdown_artifact

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the Prefect API answered 503 to the summary artifact")

    monkeypatch.setattr(tasks.report, "create_markdown_artifact", refused)
    failed = retrain(config=config, return_state=True)
    assert failed.is_failed(), failed.message
    assert _last_run(config) is None, "a run that failed in its report left a last-run record"

    monkeypatch.setattr(tasks.report, "create_markdown_artifact", create_markdown_artifact)
    state = retrain(config=config, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert not result.get("up_to_date") and result["run_id"] in (_last_run(config) or b"").decode()
    _, artifacts = task_runs_and_artifacts(state.state_details.flow_run_id)
    summary = next(a for a in artifacts if a.key == "retrain-summary").data
    assert "![confusion matrix on the test split](data:image/png;base64," in summary
    assert "could not be drawn" not in summary
    outputs = container_client(config.output)
    charts = {
        b.name.rsplit("/", 1)[-1]
        for b in outputs.list_blobs(name_starts_with=f"runs/{result['run_id']}/charts/")
    }
    # It resumed the failed run's finished checkpoint (same data, code and settings), so it
    # trained no epoch and draws no curves: the confusion matrix is its picture.
    training = next(s for s in result["steps"] if s["step"] == "run-training")["details"]
    assert training["resumed_from_epoch"] == 1 and training["epochs_run"] == []
    assert charts == {"confusion.png"}
    report.record(
        "adversarial",
        "class folders named `$x^$` and `${{{…}}}$` (mathtext); the summary artifact refused",
        "report drawn with the names as written; a run failed in its report leaves no "
        "last-run record, so the next run trains instead of saying up to date",
    )
