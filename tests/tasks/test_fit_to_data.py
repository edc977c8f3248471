"""The training settings fitted to the gate's facts: only those left unset, each with why."""

from __future__ import annotations

from dataclasses import replace

import pytest

from core.config import TrainingConfig
from tasks.fit_to_data import (
    MAX_EPOCH_CAP,
    MIN_EPOCH_CAP,
    TARGET_STEPS,
    DataFacts,
    fit_training,
    fitted_epoch_cap,
    fitted_input_size,
)


def _rows(split: str, label: str, count: int, side: int) -> list[dict[str, object]]:
    return [
        {"split": split, "label": label, "width": side + 10, "height": side, "readable": True}
        for _ in range(count)
    ]


def test_facts_count_readable_images_and_measure_the_train_images_shorter_side() -> None:
    rows = [
        *_rows("train", "brick", 3, 50),
        *_rows("train", "grass", 2, 90),
        *_rows("val", "brick", 4, 500),  # not train: its sizes are not the training's
        {"split": "train", "label": "brick", "width": None, "height": None, "readable": False},
        {"split": None, "label": None, "width": 8, "height": 8, "readable": True},  # stray file
    ]
    facts = DataFacts.from_rows(rows)
    assert facts == DataFacts(images={"train": 5, "val": 4}, classes=2, median_side=50)


TEXTURES = DataFacts(images={"train": 360, "val": 90, "test": 90}, classes=3, median_side=71)
DIGITS = DataFacts(images={"train": 1347, "test": 450}, classes=10, median_side=8)


def test_unset_size_and_cap_are_fitted_and_each_says_why() -> None:
    fitted, lines = fit_training(TrainingConfig(), TEXTURES, processes=2)
    assert fitted.image_size == 64  # 71 px, in steps of 16
    # 360 images in batches of 64 x 2: 3 steps an epoch.
    assert fitted.epochs == min(MAX_EPOCH_CAP, -(-TARGET_STEPS // 3))
    assert lines[0].startswith("training.image_size = 64: the train images' median shorter")
    assert lines[1].startswith(f"training.epochs = {fitted.epochs} (a cap;")
    assert "360 train images make 3 steps of 64 x 2 processes" in lines[1]


def test_a_warm_start_from_the_champion_trains_a_third_of_the_fewer_epochs() -> None:
    """A third of the fewer of the champion's epochs and the cap scratch would get here."""
    warm = TrainingConfig(init_from="champion", image_size=64)
    scratch_cap = fitted_epoch_cap(360, 128)
    fitted, lines = fit_training(warm, TEXTURES, processes=2, warm_from=90)
    assert fitted.epochs == -(-scratch_cap // 3)
    fitted, lines = fit_training(warm, TEXTURES, processes=2, warm_from=13)
    assert fitted.epochs == 5
    assert lines[0].startswith("training.epochs = 5: a warm start from the champion trains")
    assert f"of the 13 epochs the champion's training ran and the {scratch_cap}" in lines[0]
    # Weights named another way than the followed champion: the cap of a start from scratch.
    other = TrainingConfig(init_from="nfs:w.pt", image_size=64)
    assert fit_training(other, TEXTURES, processes=2, warm_from=13)[0].epochs == scratch_cap


def test_without_val_the_held_out_slice_is_not_counted_as_training_images() -> None:
    fitted, lines = fit_training(TrainingConfig(), DIGITS, processes=2)
    assert fitted.image_size == 32  # 8 px digits: the cnn's smallest input
    assert "1212 train images (the 1347 less the 10% held out) make 10 steps" in lines[1]
    assert fitted.epochs == fitted_epoch_cap(1212, 128)


def test_settings_given_are_never_changed() -> None:
    given = TrainingConfig(epochs=4, image_size=40)
    fitted, lines = fit_training(given, TEXTURES, processes=2)
    assert fitted == given and lines == []


def test_a_start_from_weights_keeps_their_size() -> None:
    start = TrainingConfig(init_from="champion")
    fitted, lines = fit_training(start, TEXTURES, processes=1)
    assert fitted.image_size is None
    assert lines[0].startswith("training.image_size not fitted: the run starts from weights")


def test_no_measured_image_leaves_the_models_own_size() -> None:
    facts = replace(TEXTURES, median_side=None)
    fitted, lines = fit_training(TrainingConfig(model="resnet18"), facts, processes=1)
    assert fitted.image_size is None and "resnet18's own size" in lines[0]


@pytest.mark.parametrize(
    ("model", "side", "size"),
    [
        ("cnn", 8, 32),
        ("cnn", 71, 64),
        ("cnn", 4000, 96),
        ("resnet18", 100, 96),
        ("resnet50", 999, 224),
    ],
)
def test_input_size_bounds(model: str, side: int, size: int) -> None:
    assert fitted_input_size(model, side) == size


@pytest.mark.parametrize(
    ("images", "batch", "cap"),
    [(10, 64, TARGET_STEPS), (10**7, 64, MIN_EPOCH_CAP), (360, 128, -(-TARGET_STEPS // 3))],
)
def test_epoch_cap_bounds(images: int, batch: int, cap: int) -> None:
    assert fitted_epoch_cap(images, batch) == max(MIN_EPOCH_CAP, min(MAX_EPOCH_CAP, cap))
