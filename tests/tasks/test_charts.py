"""The run's pictures (tasks/charts.py) and where the summary puts them (tasks/report.py)."""

from __future__ import annotations

import base64
import io
import re
from typing import Any

import pytest
from PIL import Image

from tasks.charts import confusion_png, curves_png
from tasks.report import charts_markdown, draw_charts
from tasks.steps import StepRecord
from tasks.train_and_score import Scored

EPOCHS = [
    {"epoch": 1, "train_loss": 2.1, "train_accuracy": 0.31, "val_accuracy": 0.42},
    {"epoch": 2, "train_loss": 1.2, "train_accuracy": 0.64, "val_accuracy": 0.70},
    {"epoch": 3, "train_loss": 0.7, "train_accuracy": 0.81},  # no validation split this epoch
]
CLASSES = ["cat", "dog", "ship"]
MATRIX = [[30, 2, 1], [4, 25, 0], [0, 1, 37]]


def decoded(png: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(png))
    image.load()  # a truncated or corrupt file fails here, not only at the header
    return image


def test_curves_are_a_png_of_about_600_by_400() -> None:
    image = decoded(curves_png(EPOCHS))
    assert image.format == "PNG" and image.size == (600, 400)
    # drawn, not blank: lines and text give many colours
    assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 10


def test_confusion_matrix_draws_the_classes_of_score_json() -> None:
    png = confusion_png(MATRIX, CLASSES)
    image = decoded(png)
    assert image.format == "PNG" and image.size == (600, 400)
    many = [f"class-{i}" for i in range(25)]  # past the size where counts are written in cells
    big = [[10 if i == j else 0 for j in range(25)] for i in range(25)]
    assert decoded(confusion_png(big, many)).size == (600, 400)


def test_a_matrix_that_does_not_match_the_class_names_is_named() -> None:
    with pytest.raises(ValueError, match=r"confusion_matrix is 2x3 but class_names names 3"):
        confusion_png(MATRIX[:2], CLASSES)
    with pytest.raises(ValueError, match=r"epochs\[0\] has no train_loss"):
        curves_png([{"epoch": 1, "train_accuracy": 0.5}])
    with pytest.raises(ValueError, match="epochs is empty"):
        curves_png([])


def scored(epochs: list[dict[str, Any]]) -> Scored:
    score = {"confusion_matrix": MATRIX, "class_names": CLASSES}
    return Scored({"epochs": epochs}, score, [])


def test_the_summary_embeds_each_picture_and_no_curves_for_a_run_that_trained_none() -> None:
    trained = [StepRecord("run-training", "ran", 1.0, {"epochs_run": [1, 2, 3]})]
    charts = draw_charts(scored(EPOCHS), trained)
    assert set(charts.drawn) == {"curves.png", "confusion.png"} and not charts.left_out
    text = "\n".join(charts_markdown(charts))
    embedded = re.findall(r"!\[[^\]]+\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", text)
    assert [base64.b64decode(e) for e in embedded] == list(charts.drawn.values())
    assert sum(len(e) for e in embedded) < 100_000  # light enough for the Prefect database

    resumed = [StepRecord("run-training", "ran", 1.0, {"epochs_run": [], "resumed_from_epoch": 3})]
    assert set(draw_charts(scored(EPOCHS), resumed).drawn) == {"confusion.png"}


# Folder names a class may have: matplotlib's mathtext syntax ("$x^$" is a syntax error in
# it, deep braces recurse past Python's limit), a backslash before a dollar, a 255-byte name.
MATHTEXT_NAMES = ["$x^$", "$" + "{" * 126 + "}" * 126 + "$", "a\\$b$c", "n" * 255]


def test_class_names_are_drawn_as_written_not_parsed_as_mathtext() -> None:
    names = [*MATHTEXT_NAMES, "plain"]
    matrix = [[5 if i == j else 0 for j in range(len(names))] for i in range(len(names))]
    assert decoded(confusion_png(matrix, names)).size == (600, 400)


def test_a_chart_that_cannot_be_drawn_is_left_out_and_named() -> None:
    trained = [StepRecord("run-training", "ran", 1.0, {"epochs_run": [1]})]
    broken = Scored(
        {"epochs": [{"epoch": 1, "train_accuracy": 0.5}]},  # no train_loss: no curves
        {"confusion_matrix": MATRIX, "class_names": CLASSES},
        [],
    )
    charts = draw_charts(broken, trained)
    assert set(charts.drawn) == {"confusion.png"}
    assert charts.left_out == {
        "curves.png": "ValueError: metrics.json: epochs[0] has no train_loss"
    }
    text = "\n".join(charts_markdown(charts))
    assert "`charts/confusion.png`" in text and "`charts/curves.png`" not in text
    assert (  # the reason as Markdown shows it as written (its brackets escaped)
        "The loss and accuracy per epoch could not be drawn (ValueError: metrics.json: "
        "epochs\\[0\\] has no train_loss): left out." in text
    )
