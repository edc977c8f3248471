"""Which checkpoint inside an epoch can resume a run (training/train.py ``partial_mismatch``):
only one written in the same batch order and on as many ranks; another is skipped, so the
search falls back to the last whole-epoch checkpoint rather than train that epoch again on
weights that saw part of it."""

from __future__ import annotations

from typing import Any

import pytest

from training.args import parse_trainer_args
from training.train import partial_mismatch

ARGV = ["--data-dir", "data", "--output-dir", "out", "--batch-size", "16", "--seed", "3"]


def _state(batch: int, ranks: int = 2, **changed: Any) -> dict[str, Any]:
    record = {**parse_trainer_args(ARGV).as_record(), **changed}
    partial = [{"loss": 0.0}] * ranks if batch else None
    return {"epoch": 3, "batch": batch, "args": record, "partial": partial}


def test_a_checkpoint_inside_an_epoch_in_the_same_order_resumes() -> None:
    args = parse_trainer_args(ARGV)
    assert partial_mismatch(_state(7), args, 2) is None
    assert partial_mismatch(_state(0, batch_size=32), args, 1) is None  # an epoch's end


@pytest.mark.parametrize(
    ("state", "ranks", "named"),
    [
        (_state(7, batch_size=32), 2, "batch_size"),
        (_state(7, seed=4), 2, "seed"),
        (_state(7), 4, "number of ranks"),
    ],
)
def test_a_checkpoint_inside_an_epoch_in_another_order_is_skipped(
    state: dict[str, Any], ranks: int, named: str
) -> None:
    why = partial_mismatch(state, parse_trainer_args(ARGV), ranks)
    assert why is not None and named in why and "inside epoch 3" in why
