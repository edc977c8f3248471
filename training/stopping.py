"""When training stops: the watched metric of each epoch, the best epoch so far, and the rule
that ends a training once the metric has stopped improving.

No torch here: the trainer calls :class:`StoppingRule` at each epoch's end, and anything that
reads the trainer's ``PROGRESS`` lines (a sweep's pruner, a report) can replay the same rule on
the same numbers. The rule's state is a function of the epochs' records alone
(:meth:`StoppingRule.replay`), so a training resumed from a checkpoint, whose history holds those
records, takes the same decisions as one that never stopped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

# The metrics a training can watch: those a promotion decides on (promotion.metric), computed
# from the same counts: a class with no image is left out of the averages.
MetricName = Literal["accuracy", "macro_f1", "balanced_accuracy"]
METRICS: tuple[MetricName, ...] = ("accuracy", "macro_f1", "balanced_accuracy")


def metric_value(
    name: str, correct: Sequence[float], true: Sequence[float], predicted: Sequence[float]
) -> float:
    """``name`` from per-class counts: images of class c labelled c (``correct``), images of
    class c (``true``), images labelled c (``predicted``). NaN when no class has an image."""
    kept = [c for c, n in enumerate(true) if n > 0]
    if not kept:
        return math.nan
    if name == "accuracy":
        return sum(correct[c] for c in kept) / sum(true[c] for c in kept)
    recall = {c: correct[c] / true[c] for c in kept}
    if name == "balanced_accuracy":
        return sum(recall.values()) / len(kept)
    if name == "macro_f1":
        f1 = []
        for c in kept:
            precision = correct[c] / predicted[c] if predicted[c] else 0.0
            both = precision + recall[c]
            f1.append(2 * precision * recall[c] / both if both else 0.0)
        return sum(f1) / len(f1)
    raise ValueError(f"unknown metric {name!r}; choose one of {list(METRICS)}")


@dataclass(frozen=True)
class Verdict:
    """What the rule says after one epoch."""

    best: bool  # this epoch's model is the best so far (the one kept)
    stop: bool  # no further epoch: the watched metric stopped improving


@dataclass
class StoppingRule:
    """Stops once the watched metric (higher is better) has not risen by more than
    ``min_improvement`` over its best for ``patience`` epochs in a row; ``patience`` 0 never
    stops (the training runs to its epoch cap).

    The model kept is the best epoch's: the highest metric, and between epochs whose metric is
    equal, the one with the lower loss on the same images (a tie on a small split is common, and
    the lower loss is the surer model). Only a rise beyond ``min_improvement`` resets the
    patience, so a tie never prolongs a training.
    """

    patience: int
    min_improvement: float = 0.0
    best_epoch: int | None = None
    best_value: float = -math.inf
    best_loss: float = math.inf
    reference: float = -math.inf  # the value the next epoch must beat by min_improvement
    waited: int = 0  # epochs since the metric last rose beyond min_improvement
    stopped: bool = False

    def update(self, epoch: int, value: float, loss: float = math.inf) -> Verdict:
        """The verdict after ``epoch``, whose watched metric is ``value`` (NaN: no figure,
        never the best) and whose loss on the same images is ``loss``."""
        if math.isnan(value):
            value = -math.inf
        loss = math.inf if math.isnan(loss) else loss
        best = self.best_epoch is None or (value, -loss) > (self.best_value, -self.best_loss)
        if best:
            self.best_epoch, self.best_value, self.best_loss = epoch, value, loss
        if value > self.reference + self.min_improvement or self.reference == -math.inf:
            self.reference = value
            self.waited = 0
        else:
            self.waited += 1
        self.stopped = self.patience > 0 and self.waited >= self.patience
        return Verdict(best, self.stopped)

    @classmethod
    def replay(
        cls,
        patience: int,
        min_improvement: float,
        records: Iterable[Mapping[str, Any]],
        metric_key: str = "val_metric",
        loss_key: str = "val_loss",
    ) -> StoppingRule:
        """The rule as it stood after ``records`` (epoch records in order; those without the
        metric are skipped)."""
        rule = cls(patience, min_improvement)
        for record in records:
            value = record.get(metric_key)
            if isinstance(value, int | float):
                loss = record.get(loss_key)
                loss_value = float(loss) if isinstance(loss, int | float) else math.inf
                rule.update(int(record["epoch"]), float(value), loss_value)
        return rule

    def as_record(self) -> dict[str, Any]:
        return {
            "patience": self.patience,
            "min_improvement": self.min_improvement,
            "best_epoch": self.best_epoch,
            "best_value": None if self.best_epoch is None else self.best_value,
            "stopped_early": self.stopped,
        }


# A data set without a val split gives this share of each class's training images to a slice
# the rule watches instead; a slice of fewer images than MIN_HELD_OUT (or none of a class)
# would make the stopping decision a coin toss, so such a training runs to its cap.
HOLDOUT_FRACTION = 0.1
MIN_HELD_OUT = 20


@dataclass(frozen=True)
class Holdout:
    """The train split cut in two: the images trained on and the slice watched (indices into
    the train split), or, when the split is too small to spare one, why not (``train`` is then
    every index and ``held`` empty)."""

    train: list[int]
    held: list[int]
    refused: str | None = None


def hold_out(labels: Sequence[int], seed: int) -> Holdout:
    """:data:`HOLDOUT_FRACTION` of each class's images, drawn with ``seed`` (the same on every
    rank, so every rank cuts the same slice)."""
    import random

    by_class: dict[int, list[int]] = {}
    for index, label in enumerate(labels):
        by_class.setdefault(int(label), []).append(index)
    rng = random.Random(seed)
    held: list[int] = []
    short = []
    for label in sorted(by_class):
        members = by_class[label]
        take = round(len(members) * HOLDOUT_FRACTION)
        if take < 1 or take >= len(members):
            short.append(label)
            continue
        held += rng.sample(members, take)
    everything = list(range(len(labels)))
    if short or len(held) < MIN_HELD_OUT:
        why = (
            f"no val split, and the train split ({len(labels)} images) is too small to hold out "
            f"a slice of {HOLDOUT_FRACTION:.0%} of each class with at least {MIN_HELD_OUT} "
            "images: no early stop, the training runs to its epoch cap"
        )
        return Holdout(everything, [], why)
    chosen = set(held)
    return Holdout([i for i in everything if i not in chosen], sorted(held))
