"""The numbers a promotion compares, computed from a scorer's confusion matrix.

``training.score`` reports the confusion matrix of a model on a test split, its rows the true
classes and its columns the predicted ones, in the order of its ``class_names``. Every metric a
promotion may decide on (``promotion.metric``) and each class's recall are computed here from
those counts, over all the classes or over a subset of them: when a new data version added or
removed a class, the challenger and the champion are compared on the classes both know, which
is the rows of those classes in each one's matrix. A class with no test image has no recall and
is left out of the averages.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

METRICS = ("accuracy", "macro_f1", "balanced_accuracy")


@dataclass(frozen=True)
class Scores:
    """One model on one test split, over ``classes`` (those with test images)."""

    classes: tuple[str, ...]
    accuracy: float
    macro_f1: float
    balanced_accuracy: float
    recall: dict[str, float]
    images: int | None  # the test images counted; None for scores read from a record

    def metric(self, name: str) -> float:
        return float(getattr(self, name))

    def as_record(self) -> dict[str, Any]:
        return {
            **{name: round(self.metric(name), 6) for name in METRICS},
            "images": self.images,
            "recall": {name: round(value, 6) for name, value in self.recall.items()},
        }


def _matrix(report: Mapping[str, Any]) -> tuple[list[str], list[list[int]]] | str:
    names, matrix = report.get("class_names"), report.get("confusion_matrix")
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        return "the score has no class_names"
    if not (
        isinstance(matrix, list)
        and len(matrix) == len(names)
        and all(
            isinstance(row, list)
            and len(row) == len(names)
            and all(type(n) is int and n >= 0 for n in row)
            for row in matrix
        )
    ):
        return f"the score's confusion_matrix is not {len(names)} x {len(names)} counts"
    return names, matrix


def scores_of(report: Mapping[str, Any], only: Collection[str] | None = None) -> Scores | str:
    """``report``'s metrics over the classes in ``only`` (all of its classes when None), or why
    they cannot be computed."""
    parsed = _matrix(report)
    if isinstance(parsed, str):
        return parsed
    names, matrix = parsed
    kept = [
        i for i, name in enumerate(names) if (only is None or name in only) and sum(matrix[i]) > 0
    ]
    if not kept:
        return "no test image of the classes compared"
    total = sum(sum(matrix[i]) for i in kept)
    recall = {names[i]: matrix[i][i] / sum(matrix[i]) for i in kept}
    f1 = []
    for i in kept:
        predicted = sum(matrix[r][i] for r in kept)
        precision = matrix[i][i] / predicted if predicted else 0.0
        both = precision + recall[names[i]]
        f1.append(2 * precision * recall[names[i]] / both if both else 0.0)
    return Scores(
        classes=tuple(names[i] for i in kept),
        accuracy=sum(matrix[i][i] for i in kept) / total,
        macro_f1=sum(f1) / len(f1),
        balanced_accuracy=sum(recall.values()) / len(recall),
        recall=recall,
        images=total,
    )
