"""Checkpoints are atomic, and a damaged newest one falls back to the previous epoch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import run_trainer
from training.checkpoint import atomic_save, list_checkpoints, newest_valid_checkpoint


@pytest.mark.processes
def test_damaged_newest_checkpoint_falls_back(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = run_trainer(1, "synthetic:300", out, "--epochs", "2")
    assert first.returncode == 0, first.output
    ckpts = out / "checkpoints"
    newest = ckpts / "checkpoint-2.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a full disk
    (ckpts / "checkpoint-7.pt").write_bytes(b"")  # zero bytes: an interrupted copy

    again = run_trainer(1, "synthetic:300", out, "--epochs", "3")
    assert again.returncode == 0, again.output
    assert "skipping damaged checkpoint" in again.output
    assert "checkpoint-7.pt" in again.output and "checkpoint-2.pt" in again.output
    assert "resuming from checkpoint-1.pt: starting at epoch 2" in again.output
    m = again.metrics
    assert m["resumed_from_epoch"] == 1
    assert [e["epoch"] for e in m["epochs"]] == [1, 2, 3]


@pytest.mark.processes
def test_only_damaged_checkpoints_start_fresh(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpt"
    ckpts.mkdir()
    (ckpts / "checkpoint-1.pt").write_bytes(b"garbage")
    torch.save({"not": "a checkpoint"}, ckpts / "checkpoint-2.pt")
    assert newest_valid_checkpoint(ckpts) is None
    result = run_trainer(
        1, "synthetic:200", tmp_path / "out", "--epochs", "1", "--checkpoint-dir", str(ckpts)
    )
    assert result.returncode == 0, result.output
    assert result.metrics["resumed_from_epoch"] is None


def test_atomic_save_leaves_old_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint-1.pt"
    atomic_save({"epoch": 1}, target)

    class Unpicklable:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_save({"epoch": 2, "bad": Unpicklable()}, target)
    assert torch.load(target, weights_only=True) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1.pt"]  # no temp file left


@pytest.mark.processes
def test_keeps_newest_checkpoints_only(tmp_path: Path) -> None:
    result = run_trainer(
        1, "synthetic:200", tmp_path / "out", "--epochs", "4", "--keep-checkpoints", "2"
    )
    assert result.returncode == 0, result.output
    assert [e for e, _ in list_checkpoints(tmp_path / "out" / "checkpoints")] == [4, 3]
