"""The stopping rule, the watched metric and the slice held out of train, at unit level: the
trainer's decisions across ranks and resumes are tests/training/test_early_stop.py's."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, balanced_accuracy_score, f1_score

from training.stopping import (
    HOLDOUT_FRACTION,
    METRICS,
    MIN_HELD_OUT,
    StoppingRule,
    hold_out,
    metric_value,
)


@pytest.mark.parametrize("seed", range(5))
def test_metrics_agree_with_scikit_learn(seed: int) -> None:
    rng = np.random.default_rng(seed)
    classes = 5
    truth = rng.integers(0, classes - 1, 60)  # the last class has no image: left out
    predicted = np.where(rng.random(60) < 0.6, truth, rng.integers(0, classes, 60))
    true = np.bincount(truth, minlength=classes)
    labelled = np.bincount(predicted, minlength=classes)
    correct = np.bincount(truth[truth == predicted], minlength=classes)
    present = sorted(set(truth))
    expected = {
        "accuracy": accuracy_score(truth, predicted),
        "balanced_accuracy": balanced_accuracy_score(truth, predicted),
        "macro_f1": f1_score(truth, predicted, labels=present, average="macro", zero_division=0),
    }
    for name in METRICS:
        got = metric_value(name, correct.tolist(), true.tolist(), labelled.tolist())
        assert got == pytest.approx(expected[name]), name


def test_a_metric_of_no_image_is_nan_and_an_unknown_metric_is_named() -> None:
    assert math.isnan(metric_value("accuracy", [0, 0], [0, 0], [0, 0]))
    with pytest.raises(ValueError, match="'top5'"):
        metric_value("top5", [1], [1], [1])


def _run(rule: StoppingRule, values: list[float], losses: list[float] | None = None) -> list[int]:
    """The epochs trained before the rule stopped (all of them when it never did)."""
    for epoch, value in enumerate(values, start=1):
        loss = losses[epoch - 1] if losses else math.inf
        if rule.update(epoch, value, loss).stop:
            return list(range(1, epoch + 1))
    return list(range(1, len(values) + 1))


def test_stops_after_patience_epochs_without_improvement_and_keeps_the_best() -> None:
    rule = StoppingRule(patience=2)
    assert _run(rule, [0.5, 0.7, 0.6, 0.69, 0.9]) == [1, 2, 3, 4]
    assert rule.best_epoch == 2 and rule.best_value == 0.7 and rule.stopped


def test_patience_zero_trains_to_the_cap_and_still_keeps_the_best() -> None:
    rule = StoppingRule(patience=0)
    assert _run(rule, [0.5, 0.9, 0.1, 0.1, 0.1, 0.1]) == [1, 2, 3, 4, 5, 6]
    assert rule.best_epoch == 2 and not rule.stopped


def test_a_rise_within_min_improvement_does_not_reset_patience() -> None:
    rule = StoppingRule(patience=2, min_improvement=0.05)
    # 0.73 and 0.74 are better models (kept) but not improvements enough to wait longer.
    assert _run(rule, [0.7, 0.73, 0.74, 0.9]) == [1, 2, 3]
    assert rule.best_epoch == 3


def test_a_tie_keeps_the_lower_loss_without_prolonging_training() -> None:
    rule = StoppingRule(patience=2)
    assert _run(rule, [0.8, 0.8, 0.8], losses=[0.5, 0.3, 0.4]) == [1, 2, 3]
    assert rule.best_epoch == 2


def test_an_epoch_without_a_figure_is_never_the_best() -> None:
    rule = StoppingRule(patience=3)
    _run(rule, [math.nan, 0.2, math.nan])
    assert rule.best_epoch == 2


def test_replaying_the_history_gives_the_same_state_as_living_it() -> None:
    """What a resumed training relies on: the rule is a function of the epochs' records."""
    values, losses = [0.5, 0.7, 0.7, 0.65, 0.71, 0.6], [1.0, 0.8, 0.7, 0.9, 0.6, 1.1]
    for cut in range(len(values) + 1):
        live = StoppingRule(patience=3, min_improvement=0.005)
        for epoch in range(1, cut + 1):
            live.update(epoch, values[epoch - 1], losses[epoch - 1])
        records = [
            {"epoch": e, "val_metric": values[e - 1], "val_loss": losses[e - 1]}
            for e in range(1, cut + 1)
        ]
        assert StoppingRule.replay(3, 0.005, records) == live


def test_records_without_a_metric_replay_as_no_decision() -> None:
    """Checkpoints written before early stopping existed hold records without val_metric."""
    rule = StoppingRule.replay(2, 0.0, [{"epoch": 1, "val_accuracy": 0.5}, {"epoch": 2}])
    assert rule.best_epoch is None and not rule.stopped


def test_the_held_out_slice_is_a_stratified_seeded_share_of_each_class() -> None:
    labels = [0] * 120 + [1] * 60 + [2] * 200
    cut = hold_out(labels, seed=4)
    assert cut.refused is None
    assert sorted(cut.train + cut.held) == list(range(len(labels)))
    assert not set(cut.train) & set(cut.held)
    held = Counter(labels[i] for i in cut.held)
    assert held == {0: 12, 1: 6, 2: 20}  # HOLDOUT_FRACTION of each class
    assert HOLDOUT_FRACTION == 0.1
    assert hold_out(labels, seed=4) == cut  # every rank cuts the same slice
    assert hold_out(labels, seed=5).held != cut.held


@pytest.mark.parametrize(
    "labels",
    [
        [0] * 60 + [1] * 60,  # 12 images: fewer than MIN_HELD_OUT
        [0] * 300 + [1] * 4,  # class 1 cannot spare an image
    ],
)
def test_a_split_too_small_to_hold_out_a_slice_is_refused_by_name(labels: list[int]) -> None:
    cut = hold_out(labels, seed=0)
    assert cut.held == [] and cut.train == list(range(len(labels)))
    assert cut.refused is not None
    assert f"train split ({len(labels)} images) is too small" in cut.refused
    assert f"at least {MIN_HELD_OUT} images" in cut.refused and "epoch cap" in cut.refused
