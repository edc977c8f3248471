"""The run summary says only what the run measured; its links and pictures show as meant in the
UI (tasks/report.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.report import epochs_markdown
from tasks.steps import StepRecord
from tests.conftest import ROOT

METRICS = {
    "epochs": [
        {"epoch": e, "train_loss": 1.0 / e, "train_accuracy": 0.5, "images_per_sec": 900.0}
        for e in (1, 2, 3)
    ],
    "world_size": 2,
    "images_per_sec": 1800.0,
    "images_per_sec_per_worker": 900.0,
}


def training(epochs_run: list[int], resumed: int | None) -> list[StepRecord]:
    details: dict[str, Any] = {"epochs_run": epochs_run, "resumed_from_epoch": resumed}
    return [StepRecord("run-training", "ran", 1.0, details)]


def test_a_run_that_trained_nothing_shows_no_epochs_or_throughput() -> None:
    text = "\n".join(epochs_markdown(training([], 3), METRICS))
    assert "| epoch |" not in text and "images/s" not in text
    assert "No epoch was trained in this run" in text and "epoch 3" in text


def test_only_the_epochs_this_attempt_trained_are_listed() -> None:
    text = "\n".join(epochs_markdown(training([2, 3], 1), METRICS))
    assert "| 2 |" in text and "| 3 |" in text and "| 1 |" not in text
    assert "1800 images/s in total" in text


def test_progress_says_where_training_is_how_fast_and_how_long_to_go() -> None:
    from tasks.train_and_score import progress_text

    seen = [
        {"epoch": 1, "epochs": 4, "seconds": 30.0},
        {"epoch": 2, "epochs": 4, "seconds": 50.0},
    ]
    record = {
        **seen[-1],
        "train_loss": 0.51234,
        "train_accuracy": 0.8,
        "images_per_sec": 912.4,
    }
    assert progress_text(record, seen) == (
        "epoch 2 of 4: loss 0.5123, accuracy 0.8000, 912 images/s, about 1 min 20 s left"
    )


def _outside_code_spans(markdown: str) -> str:
    return "".join(markdown.split("`")[0::2])


@pytest.mark.parametrize("links_url", ["http://127.0.0.1:4280", None])
@pytest.mark.parametrize("name", ["model.pt", "logs/stdout.txt", ""])
def test_link_descriptions_show_each_command_as_typed(links_url: str | None, name: str) -> None:
    """The UI renders a description as Markdown: a command outside a code span loses its
    ``<the config>`` (read as an HTML tag)."""
    from core.config import load_config
    from tasks.report import link_description

    config = load_config(
        ROOT / "configs" / "local.yaml", [f"output.links_url={links_url or 'null'}"]
    )
    text = link_description(config, "20261125-1-abc", name)
    outside = _outside_code_spans(text)
    assert "<" not in outside and "python -m" not in outside, text
    assert "`python -m cli.models --config <the config> serve`" in text
    if name:
        assert (
            "`python -m cli.models --config <the config> download --run 20261125-1-abc "
            f"--file {name}`"
        ) in text


@pytest.mark.usefixtures("prefect_api")
def test_each_picture_is_an_artifact_of_its_own() -> None:
    """An image artifact of the copy the gateway serves; without a gateway, the picture itself
    (a link to private Blob storage would show a broken image)."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from core.config import load_config
    from tasks.charts import confusion_png
    from tasks.report import chart_artifact

    png = confusion_png([[3, 1], [0, 4]], ["a", "b"])
    link = "http://127.0.0.1:4280/runs/r/charts/confusion.png"

    @flow
    def pictures(links_url: str | None) -> str:
        from prefect.runtime import flow_run

        config = load_config(
            ROOT / "configs" / "local.yaml", [f"output.links_url={links_url or 'null'}"]
        )
        chart_artifact(config, "r", "confusion.png", png, link)
        return str(flow_run.get_id())

    def artifacts(run_id: str) -> list[Any]:
        with get_client(sync_client=True) as client:
            return client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
            )

    (served,) = artifacts(pictures("http://127.0.0.1:4280"))
    assert (served.key, served.type, served.data) == ("chart-confusion", "image", link)
    assert served.description == "retrain r: confusion matrix on the test split"
    (embedded,) = artifacts(pictures(None))
    assert (embedded.key, embedded.type) == ("chart-confusion", "markdown")
    assert embedded.data.startswith("![confusion matrix on the test split](data:image/png;base64,")


def test_a_progress_line_with_another_line_glued_to_it_still_counts_its_epoch() -> None:
    """The line a CI run saw: the checkpoint writer's thread logged between the JSON and its
    newline; the training went on well, and its step must not fail on the log line."""
    from tasks.train_and_score import progress_record

    glued = (
        'PROGRESS {"epoch": 1, "epochs": 1, "train_loss": 2.18, "resumed_from": null}'
        "[rank 0] checkpoint-1.pt written in 0.00 s, in the background"
    )
    assert progress_record(glued) == {
        "epoch": 1,
        "epochs": 1,
        "train_loss": 2.18,
        "resumed_from": None,
    }
    assert progress_record('[rank 0] x PROGRESS {"epochs": 2}') == {"epochs": 2}
    assert progress_record("PROGRESS {cut") is None
    assert progress_record("PROGRESS [1, 2]") is None


def test_the_steps_table_holds_no_text_the_ui_would_cut() -> None:
    """The Prefect UI draws a table's columns at fixed widths and cuts a cell at its edge
    (``white-space: nowrap; overflow: hidden``): the details column showed a few words of each
    step's details. Every cell of the summary's tables is short; the details are in a list,
    each whole, as written."""
    import html
    import re

    from markdown_it import MarkdownIt

    from registry.promotion import Decision
    from tasks.provision import StagedData
    from tasks.report import summary_markdown
    from tasks.train_and_score import Scored

    run_id = "20261125-205247-3ba5a668"
    docs = f"http://127.0.0.1:4280/runs/{run_id}/data_docs/index.html"
    steps = [
        StepRecord(
            "validate-data",
            "ran",
            11.27,
            {"images": 1797, "listing": f"runs/{run_id}/data-listing.json", "data_docs": docs},
        ),
        StepRecord("upload-scripts", "skipped", 0.06, {}),
        StepRecord(
            "run-training",
            "ran",
            43.51,
            {"task": f"train-{run_id}", "checkpoint_key": "f7ffa5e87dc6a4c5", "epochs_run": [1]},
        ),
    ]
    score = {"accuracy": 0.9, "num_images": 10, "per_class": {}}
    markdown = summary_markdown(
        run_id,
        steps,
        Scored(METRICS, score, []),
        Decision(True, "no champion yet", "", {}),
        StagedData("47859ce8fb14dfc0", 1797, 0, 1797),
    )
    rendered = MarkdownIt("commonmark").enable("table").render(markdown)
    cells = [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", rendered)]
    assert "validate-data" in cells and "43.51" in cells
    assert max(len(c) for c in cells) <= 20, [c for c in cells if len(c) > 20]
    text = html.unescape(re.sub(r"<[^>]+>", "", rendered))
    assert f"validate-data: images=1797, listing=runs/{run_id}/data-listing.json, " in text
    assert f"data_docs={docs}" in text and "<a " not in rendered  # text, not a link
    assert f"run-training: task=train-{run_id}, checkpoint_key=f7ffa5e87dc6a4c5" in text
    assert "upload-scripts:" not in text  # a step with nothing to say has no line


def test_the_summary_says_where_training_stopped_and_what_was_fitted() -> None:
    from tasks.report import training_markdown

    fit = StepRecord(
        "fit-to-data",
        "ran",
        0.0,
        {"settings": ["training.image_size = 64: the train images' median shorter side is 71 px"]},
    )
    stopped = {
        "split": "val",
        "why": "the val split (90 images)",
        "metric": "accuracy",
        "epoch_cap": 34,
        "epochs_trained": 21,
        "patience": 10,
        "best_value": 1.0,
        "stopped_early": True,
        "kept_epoch": 11,
    }
    text = "\n".join(training_markdown([fit], {"early_stopping": stopped}))
    assert "- training.image_size = 64: the train images' median shorter side" in text
    assert "Stopped early after epoch 21 of at most 34" in text
    assert "The model kept is epoch 11's (accuracy 1.0000)." in text
    refused = {
        "split": None,
        "why": "no val split, and the train split (33 images) is too small to hold out a slice",
        "epoch_cap": 3,
        "epochs_trained": 3,
        "kept_epoch": 3,
    }
    text = "\n".join(training_markdown([], {"early_stopping": refused}))
    assert "No early stop (no val split, and the train split (33 images) is too small" in text
    assert "3 of 3 epochs trained; the model is the last epoch's." in text
    assert training_markdown([], {}) == []
