"""The estimate of a run's node time and cost, from the config and from past runs."""

from __future__ import annotations

from typing import Any

import pytest

from core.config import PipelineConfig, load_config
from core.cost_estimate import (
    DataCounts,
    NodeMix,
    PastRun,
    Work,
    estimate_run,
    history_record,
    theil_sen,
)
from core.pricing import NodePrices
from tests.conftest import ROOT
from training.stopping import hold_out

PRICES = NodePrices(4.0, 0.5, "USD", "test prices")


def _config(*overrides: str) -> PipelineConfig:
    return load_config(
        ROOT / "configs" / "azure.example.yaml",
        ["azure.batch_account_url=https://acct.eastus.batch.azure.com", *overrides],
    )


def _past(
    run_id: str,
    *,
    allocating: float = 5.0,
    startup: float = 2.0,
    epochs: int = 10,
    train: int = 60_000,
    per_image: float = 1e-4,  # minutes per image per node
    nodes: int = 2,
    complete: bool = True,
    cap: int | None = None,
    reached: int | None = None,
) -> PastRun:
    """A past run of the config's shape whose training took ``startup + per_image x work``."""
    training = startup + per_image * epochs * train / nodes
    minutes = {
        "allocating": allocating,
        "staging": 1.0,
        "training": training,
        "scoring": 1.5,
        "idle between steps": 0.5,
        "idle before release": 0.25,
    }
    work = Work("resnet50", 1, 128, epochs, train, nodes / (per_image * 60), 10_000, cap, reached)
    record = history_record(
        "Standard_NC24ads_A100_v4",
        nodes,
        {k: v * nodes for k, v in minutes.items()},
        None,
        80_000,
        work,
        None,
    )
    run = PastRun.from_record(run_id, record, complete)
    assert run is not None
    return run


COUNTS = DataCounts(images=80_000, train=60_000, test=10_000, val=10_000)


def test_without_history_the_config_and_the_projects_own_figures_are_used() -> None:
    config = _config("training.epochs=30")
    estimate = estimate_run(config, [], COUNTS, PRICES)
    # ResNet-50 on the GPU: 2,528 images/s per process (docs/bench-gpu), 1 process per node.
    work = 30 * 60_000 / 2
    assert estimate.phases["training"].minutes == pytest.approx(3.0 + work / 2528 / 60)
    assert "measured" in estimate.phases["training"].basis
    assert estimate.phases["allocating"].basis == "no past run: assumed"
    assert estimate.history_runs == 0
    hours = sum(p.minutes for p in estimate.phases.values()) / 60
    assert estimate.cost == pytest.approx(hours * 2 * 4.0)  # two dedicated nodes
    assert estimate.cost_with(NodeMix(0, 2)) == pytest.approx(hours * 2 * 0.5)
    record = estimate.as_record()
    assert record["all_spot"] == pytest.approx(hours * 2 * 0.5, abs=1e-3)
    assert set(record["node_minutes"]) == {"allocating", "staging", "training", "scoring", "idle"}
    # Without the data's size, training is left out and the note says why and at what rate.
    unsized = estimate_run(config, [], None, PRICES)
    assert "training" not in unsized.phases
    assert "not known yet" in unsized.notes[0] and "images/s per node" in unsized.notes[0]


def test_past_runs_of_different_sizes_give_the_line_and_outliers_do_not_move_it() -> None:
    sizes = [(5, 30_000), (10, 60_000), (20, 60_000), (8, 45_000), (12, 50_000)]
    history = [_past(f"r{i}", epochs=e, train=t) for i, (e, t) in enumerate(sizes)]
    # One run waited an hour for nodes, another had its training stall for an hour.
    history.append(_past("waited", allocating=65.0))
    slow = _past("stalled")
    history.append(
        PastRun.from_record(
            "stalled",
            history_record(
                slow.vm_size,
                2,
                {**slow.node_minutes, "training": (slow.minutes("training") + 60) * 2},
                None,
                slow.images,
                slow.work,
                None,
            ),
            True,
        )
        or slow
    )
    config = _config("training.epochs=40", "training.batch_size=128")
    estimate = estimate_run(config, history, COUNTS, PRICES)
    assert estimate.phases["allocating"].minutes == pytest.approx(5.0)  # not an hour longer
    expected = 2.0 + 1e-4 * 40 * 60_000 / 2
    assert estimate.phases["training"].minutes == pytest.approx(expected, rel=1e-6)
    assert "Theil-Sen" in estimate.phases["training"].basis
    assert estimate.history_runs == len(history)
    # Four nodes share the same images: training per node halves, the fixed start does not.
    four = estimate_run(config, history, COUNTS, PRICES, NodeMix(4, 0))
    assert four.phases["training"].minutes == pytest.approx(2.0 + 1e-4 * 40 * 60_000 / 4)


def test_one_past_run_gives_its_own_speed_and_another_shape_is_not_used() -> None:
    config = _config("training.epochs=20", "training.batch_size=128")
    one = [_past("r1", epochs=10, per_image=2e-4, startup=4.0)]
    estimate = estimate_run(config, one, COUNTS, PRICES)
    assert estimate.phases["training"].minutes == pytest.approx(4.0 + 2e-4 * 20 * 60_000 / 2)
    assert "past run(s) of resnet50" in estimate.phases["training"].basis
    other = estimate_run(_config("training.batch_size=64"), one, COUNTS, PRICES)
    assert "no past run of this shape" in other.phases["training"].basis
    # Staging and scoring scale with the images; allocation does not.
    half = estimate_run(config, one, DataCounts(40_000, 30_000, 5_000), PRICES)
    assert half.phases["staging"].minutes == pytest.approx(0.5)
    assert half.phases["scoring"].minutes == pytest.approx(0.75)
    assert half.phases["allocating"].minutes == estimate.phases["allocating"].minutes


def test_a_stopped_run_counts_for_its_training_speed_not_for_scoring() -> None:
    stopped = _past("stopped", epochs=3, complete=False)
    done = _past("done", epochs=10)
    estimate = estimate_run(_config(), [stopped, done], COUNTS, PRICES)
    assert "2 past runs" in estimate.phases["training"].basis
    assert "1 past run(s)" in estimate.phases["scoring"].basis


@pytest.mark.parametrize(
    "cost",
    [
        None,
        "x",
        {"nodes": 2},
        {"nodes": True, "node_minutes": {}},
        {"nodes": 2, "node_minutes": {"training": -1}},
        {"nodes": 2, "node_minutes": {"training": float("nan")}},
    ],
)
def test_a_cost_record_that_is_not_one_is_no_history(cost: Any) -> None:
    assert PastRun.from_record("r", cost, True) is None


def test_theil_sen_needs_two_distinct_sizes() -> None:
    assert theil_sen([(1.0, 2.0)]) is None and theil_sen([(1.0, 2.0), (1.0, 3.0)]) is None
    assert theil_sen([(0, 1), (1, 3), (2, 5), (3, 7), (4, 100)]) == pytest.approx((2.0, 1.0))


def test_staging_and_scoring_past_two_sizes_are_a_fixed_part_and_a_part_per_image() -> None:
    def run(images: int, test: int) -> PastRun:
        minutes = {"staging": (0.5 + 2e-5 * images) * 2, "scoring": (1.0 + 1e-4 * test) * 2}
        work = Work("resnet50", 1, 128, 1, images, 1000.0, test)
        past = PastRun.from_record(
            f"r{images}",
            history_record("Standard_NC24ads_A100_v4", 2, minutes, None, images, work, None),
            True,
        )
        assert past is not None
        return past

    history = [run(10_000, 1_000), run(50_000, 5_000), run(20_000, 2_000)]
    estimate = estimate_run(_config(), history, DataCounts(100_000, 80_000, 20_000), PRICES)
    assert estimate.phases["staging"].minutes == pytest.approx(0.5 + 2e-5 * 100_000)
    assert estimate.phases["scoring"].minutes == pytest.approx(1.0 + 1e-4 * 20_000)
    assert "Theil-Sen" in estimate.phases["scoring"].basis


def test_the_epochs_priced_are_the_share_of_the_cap_past_runs_trained() -> None:
    """Early stopping ends runs before their cap: the estimate prices the median share of the
    cap the root's finished runs trained, and without one, the cap, said to be an upper bound."""
    config = _config("training.epochs=40", "training.batch_size=128")
    capped = estimate_run(config, [_past("r0", epochs=10)], COUNTS, PRICES)  # an older record
    assert capped.phases["training"].minutes == pytest.approx(2.0 + 1e-4 * 40 * 60_000 / 2)
    assert "up to 40 epoch(s): the cap, an upper bound" in capped.phases["training"].basis
    history = [
        _past("r1", epochs=10, cap=40),  # a quarter of the cap
        _past("r2", epochs=15, cap=30),  # a half
        _past("r3", epochs=6, cap=20, train=30_000),  # 30%
        _past("r4", epochs=3, cap=60, complete=False),  # stopped by its budget: not counted
    ]
    estimate = estimate_run(config, history, COUNTS, PRICES)
    epochs = 40 * 0.3
    assert estimate.phases["training"].minutes == pytest.approx(2.0 + 1e-4 * epochs * 60_000 / 2)
    assert "12.0 of the 40 epoch(s) capped" in estimate.phases["training"].basis
    assert "3 past run(s) trained: 30%" in estimate.phases["training"].basis


def test_a_resumed_run_counts_the_epochs_it_reached_in_the_share_of_the_cap() -> None:
    """A run resumed from epoch 8 that trained 2 more reached 10 of its 40: a quarter, not the
    2 of 40 its own attempt trained."""
    config = _config("training.epochs=40", "training.batch_size=128")
    history = [_past("r1", epochs=2, cap=40, reached=10), _past("r2", epochs=10, cap=40)]
    estimate = estimate_run(config, history, COUNTS, PRICES)
    assert "10.0 of the 40 epoch(s) capped" in estimate.phases["training"].basis
    assert "2 past run(s) trained: 25%" in estimate.phases["training"].basis
    record = history_record("x", 1, {"training": 1.0}, None, 10, history[0].work, None)
    record["work"]["epochs_reached"] = "10"
    past = PastRun.from_record("r", record, True)
    assert past is not None and past.work is not None and past.work.epochs_reached is None


def test_a_cap_kept_in_a_record_is_read_back_and_a_bad_one_ignored() -> None:
    run = _past("r1", epochs=10, cap=40)
    assert run.work is not None and run.work.epoch_cap == 40
    record = history_record("x", 1, {"training": 1.0}, None, 10, run.work, None)
    for bad in (0, -3, "40", True, 2.5):
        record["work"]["epoch_cap"] = bad
        past = PastRun.from_record("r", record, True)
        assert past is not None and past.work is not None and past.work.epoch_cap is None


@pytest.mark.parametrize(
    "classes",
    [(200, 150, 85), (44,) * 5 + (43,) * 5, (300,), (5,) * 10, (100, 3), (), (12, 12)],
)
def test_without_val_the_images_trained_are_the_split_less_the_trainers_slice(
    classes: tuple[int, ...],
) -> None:
    """The images an epoch trains are what the trainer's own cut leaves of the train split."""
    labels = [c for c, n in enumerate(classes) for _ in range(n)]
    counts = DataCounts(train=len(labels), test=50, train_classes=classes)
    assert counts.trained_per_epoch() == len(hold_out(labels, seed=7).train)
    assert DataCounts(train=len(labels), val=30, train_classes=classes).trained_per_epoch() == (
        len(labels)
    )


def test_without_val_the_estimate_trains_the_split_less_the_held_out_slice() -> None:
    config = _config("training.epochs=30")
    per_image = 1 / 2528 / 60  # ResNet-50's measured rate, one process per node
    split = DataCounts(images=535, train=435, test=100, train_classes=(200, 150, 85))
    estimate = estimate_run(config, [], split, PRICES)
    # 20 + 15 + 8 of the classes are held out (the trainer's rounding): 392 trained.
    assert estimate.phases["training"].minutes == pytest.approx(3.0 + per_image * 30 * 392 / 2)
    assert "392 images" in estimate.phases["training"].basis
    with_val = DataCounts(images=635, train=435, test=100, val=100)
    trained = estimate_run(config, [], with_val, PRICES).phases["training"]
    assert trained.minutes == pytest.approx(3.0 + per_image * 30 * 435 / 2)
