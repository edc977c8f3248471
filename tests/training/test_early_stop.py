"""Early stopping in real 2-rank trainings under both engines' launchers: every rank stops
after the same epoch, and the model exported is the best epoch's weights, also when the
training resumes from a checkpoint written after that epoch (a retry), at an epoch's end or
inside a later epoch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from imagedata.make_images import write_synthetic
from tests.conftest import ENGINES, Result, run_trainer
from training.checkpoint import checkpoint_position, list_checkpoints

pytestmark = pytest.mark.usefixtures("horovodrun")


@pytest.fixture(scope="module")
def worsening_val(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Learnable classes whose val split carries the labels shifted by one class: the better
    the model learns train, the lower its val accuracy, so the first epoch is the best one and
    training stops after ``patience`` more (the data decides it, not a hook in the trainer)."""
    root = tmp_path_factory.mktemp("worsening") / "data"
    write_synthetic(root, classes=3, per_class=24, size=16, test_fraction=0.3, seed=2)
    names = sorted(p.name for p in (root / "test").iterdir())
    for i, name in enumerate(names):
        shutil.copytree(root / "test" / name, root / "val" / names[(i + 1) % len(names)])
    return root


def _progress(result: Result) -> list[dict[str, object]]:
    return [
        json.loads(line.split("PROGRESS ", 1)[1])
        for line in result.output.splitlines()
        if "PROGRESS " in line and '"epoch"' in line
    ]


def _weights(path: Path, key: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)[key]  # type: ignore[no-any-return]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_rank_stops_together_and_the_best_epoch_survives_a_resume(
    engine: str, worsening_val: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = ("--batch-size", "8", "--seed", "1", "--patience", "2", "--engine", engine)
    # First attempt: a cap of 2 epochs, past the best one, so its last checkpoint carries the
    # best epoch's weights beside its own.
    first = run_trainer(2, worsening_val, out, "--epochs", "2", *args, engine=engine)
    assert first.returncode == 0, first.output
    records = _progress(first)
    best = records[-1]["best_epoch"]
    assert best == 1, records  # the data's design: epoch 1 is the best
    assert all(r["val_split"] == "val" and r["val_metric_name"] == "accuracy" for r in records)
    checkpoints = out / "checkpoints"
    best_weights = _weights(checkpoints / "checkpoint-1.pt", "model")
    assert _same(_weights(out / "model.pt", "state_dict"), best_weights)
    assert not _same(_weights(checkpoints / "checkpoint-2.pt", "model"), best_weights)

    # The retry: the best epoch's own checkpoint is gone, only checkpoint-2 tells its weights.
    (checkpoints / "checkpoint-1.pt").unlink()
    (out / "model.pt").unlink()
    retry = ("--epochs", "6", "--checkpoint-minutes", "0.00001", *args)
    again = run_trainer(2, worsening_val, out, *retry, engine=engine)
    assert again.returncode == 0, again.output
    assert "resuming from checkpoint-2.pt: starting at epoch 3" in again.output
    resumed = _progress(again)
    assert [r["epoch"] for r in resumed] == [3]  # patience 2 after epoch 1: stop after 3
    assert resumed[-1]["stop"] is True and resumed[-1]["best_epoch"] == 1
    stop = again.metrics["early_stopping"]
    assert stop["stopped_early"] and stop["kept_epoch"] == 1 and stop["epochs_trained"] == 3
    assert stop["per_rank"] == [{"epochs_trained": 3, "kept_epoch": 1}] * 2
    assert _same(_weights(out / "model.pt", "state_dict"), best_weights)
    digests = again.metrics["weights_digest_per_rank"]
    assert digests[0] == digests[1]

    # The retry also checkpointed by time inside epoch 3 (the first agreement point of an
    # attempt comes at its first batch; the interval is long over by then). A third attempt
    # from that checkpoint alone, inside an epoch after the best one: it carries the best
    # epoch's weights, and the attempt ends with the same records, decision and model.
    positions = [(checkpoint_position(path), path) for _, path in list_checkpoints(checkpoints)]
    inside = [(at, path) for at, path in positions if at is not None and at[1]]
    assert inside, again.output
    (whole, done), newest = inside[0]
    assert whole + 1 == 3, newest  # inside epoch 3, after the best epoch 1
    carried = torch.load(newest, map_location="cpu", weights_only=True)["best"]
    assert carried["epoch"] == 1 and _same(carried["model"], best_weights)
    for path in checkpoints.glob("checkpoint-*.pt"):
        if path != newest:
            path.unlink()
    (out / "model.pt").unlink()
    third = run_trainer(2, worsening_val, out, *retry, engine=engine)
    assert third.returncode == 0, third.output
    resuming = f"resuming from {newest.name} (written by time): epoch 3 goes on at batch"
    assert f"{resuming} {done + 1}" in third.output
    ended = _progress(third)
    assert [r["epoch"] for r in ended] == [3] and ended[0]["resumed_batch"] == done
    for key in ("images", "val_metric", "best_epoch", "stop"):
        assert ended[0][key] == resumed[0][key], key
    assert ended[0]["train_loss"] == pytest.approx(resumed[0]["train_loss"], rel=1e-9)
    assert third.metrics["early_stopping"]["per_rank"] == stop["per_rank"]
    assert _same(_weights(out / "model.pt", "state_dict"), best_weights)


def test_no_val_and_too_few_images_to_hold_out_trains_to_the_cap_and_says_why(
    small_folders: Path, tmp_path: Path
) -> None:
    """33 train images and no val split: a 10% slice would be 3 images, too few to decide on,
    so nothing is held out and no epoch stops the training; the outputs say why."""
    assert not (small_folders / "val").exists()
    args = ("--epochs", "3", "--patience", "1", "--batch-size", "8")
    result = run_trainer(1, small_folders, tmp_path / "out", *args)
    assert result.returncode == 0, result.output
    stop = result.metrics["early_stopping"]
    assert stop["split"] is None and stop["images"] is None
    assert "no val split, and the train split" in stop["why"] and "too small" in stop["why"]
    assert stop["epochs_trained"] == 3 and stop["kept_epoch"] == 3 and not stop["stopped_early"]
    trained = sum(r["images"] for r in result.metrics["epochs"][:1])
    assert trained == result.metrics["dataset"]["num_train"]  # nothing held out
    assert all("val_metric" not in r for r in _progress(result))
    assert "early stopping watches no val split, and the train split" in result.output
