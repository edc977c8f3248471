"""The run summary says only what the run measured (tasks/report.py)."""

from __future__ import annotations

from typing import Any

from tasks.report import epochs_markdown
from tasks.steps import StepRecord

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
