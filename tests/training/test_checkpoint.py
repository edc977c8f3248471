"""Checkpoints are atomic, written without holding the step, a damaged newest one falls back to
the previous epoch, and the folders no run will resume are removed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, child_env, run_trainer, trainer_command
from tests.training.legacy_resnet import build_legacy_model
from training.checkpoint import (
    DAY_SECONDS,
    FINISHED,
    MARKER,
    CheckpointWriteError,
    CheckpointWriter,
    atomic_save,
    list_checkpoints,
    load_checkpoint,
    newest_valid_checkpoint,
    prune_checkpoint_folders,
)


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


@pytest.mark.processes
def test_a_checkpoint_of_the_old_resnet_names_resumes(tmp_path: Path) -> None:
    """A checkpoint written before the ResNets took torchvision's parameter names (weights and
    momentum of the old module definitions, tests/training/legacy_resnet.py) is resumed, not
    skipped as another model's: a retry after the upgrade does not start over."""
    torch.manual_seed(0)
    old = build_legacy_model("resnet18", 10)  # synthetic:N has 10 classes
    optimizer = torch.optim.SGD(old.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    old(torch.rand(2, 3, 32, 32) * 255).sum().backward()
    optimizer.step()
    record = {"epoch": 1, "epochs": 2, "train_loss": 2.0, "train_accuracy": 0.1}
    record |= {"images": 64, "seconds": 1.0, "lr": 0.05, "images_per_sec": 64.0}
    ckpts = tmp_path / "ckpt"
    ckpts.mkdir()
    atomic_save(
        {
            "format_version": 1,
            "epoch": 1,
            "model": old.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": None,
            "args": {},
            "history": [record],
        },
        ckpts / "checkpoint-1.pt",
    )
    result = run_trainer(
        1,
        "synthetic:80",
        tmp_path / "out",
        *("--model", "resnet18", "--image-size", "32", "--epochs", "2", "--batch-size", "16"),
        *("--checkpoint-dir", str(ckpts)),
    )
    assert result.returncode == 0, result.output
    assert "skipping" not in result.output
    assert result.metrics["resumed_from_epoch"] == 1
    assert [e["epoch"] for e in result.metrics["epochs"]] == [1, 2]


@pytest.mark.processes
def test_a_run_started_from_weights_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """A retry resumes the checkpoint, not the starting weights (the file may be gone by then),
    and still records what the training started from."""
    args = ("--epochs", "1", "--batch-size", "16")
    first = run_trainer(1, "synthetic:80", tmp_path / "first", *args)
    assert first.returncode == 0, first.output
    start = tmp_path / "start.pt"
    shutil.copy(tmp_path / "first" / "model.pt", start)
    out = tmp_path / "out"
    begun = run_trainer(1, "synthetic:80", out, *args, "--init-from", str(start))
    assert begun.returncode == 0, begun.output
    start.unlink()
    again = run_trainer(
        1, "synthetic:80", out, "--epochs", "2", "--batch-size", "16", "--init-from", str(start)
    )
    assert again.returncode == 0, again.output
    assert again.metrics["resumed_from_epoch"] == 1
    assert again.metrics["init_from"] == begun.metrics["init_from"]
    assert again.metrics["init_from"]["source"] == str(start)


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


def _folder(
    root: Path, name: str, files: dict[str, bytes], days_ago: float = 0.0, ours: bool = True
) -> Path:
    """A checkpoint folder as the trainer leaves it (with its marker), or, not ``ours``, a
    folder someone else made with these files."""
    folder = root / name
    folder.mkdir(parents=True)
    if ours:
        (folder / MARKER).write_text('{"created_by": "training.train"}')
    for file, data in files.items():
        (folder / file).write_bytes(data)
    when = time.time() - days_ago * DAY_SECONDS
    for path in [*folder.iterdir(), folder]:
        os.utime(path, (when, when))
    return folder


def test_checkpoint_folders_no_run_will_resume_are_removed(tmp_path: Path) -> None:
    """The policy (training/checkpoint.py): the folder being trained stays; others go when
    their training finished, or when unfinished and idle longer than the days given; a folder
    with files the trainer did not write is left alone."""
    root = tmp_path / "nfs" / "checkpoints"
    ckpt = {"checkpoint-1.pt": b"x", "checkpoint-2.pt": b"y"}
    own = _folder(root, "a1b2c3d4e5f60718", {**ckpt, FINISHED: b"{}"}, days_ago=30)
    finished = _folder(root, "0000000000000001", {**ckpt, FINISHED: b"{}"})
    forced = _folder(root, "0000000000000002-20261125-1200-abcd", {**ckpt, FINISHED: b"{}"})
    failed_today = _folder(root, "0000000000000003", {**ckpt, ".checkpoint-3.pt.k2j.tmp": b""})
    failed_long_ago = _folder(root, "0000000000000004", ckpt, days_ago=8)
    empty_long_ago = _folder(root, "0000000000000005", {}, days_ago=8)
    foreign = _folder(root, "notes", {"checkpoint-1.pt": b"x", "README": b"mine"}, days_ago=99)

    removed = dict(prune_checkpoint_folders(own, unfinished_days=7))

    assert set(removed) == {finished, forced, failed_long_ago, empty_long_ago}
    assert removed[finished] == "its training finished (the model was exported from it)"
    assert removed[failed_long_ago].startswith("unfinished, last written 8.0 days ago (kept 7)")
    assert all(not folder.exists() for folder in removed)
    assert own.is_dir() and failed_today.is_dir() and (foreign / "README").is_file()
    assert (own / MARKER).is_file()
    # 0 days: nothing unfinished is kept either (but what is being trained, and others' files).
    assert dict(prune_checkpoint_folders(own, unfinished_days=0)) == {
        failed_today: "unfinished, last written 0.0 days ago (kept 0)"
    }


@pytest.mark.processes
def test_the_trainer_marks_its_folder_finished_and_prunes_when_asked(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    stale = _folder(root, "0000000000000009", {"checkpoint-4.pt": b"x"}, days_ago=2)
    done = run_trainer(
        1,
        "synthetic:200",
        tmp_path / "out",
        "--epochs",
        "1",
        "--checkpoint-dir",
        str(root / "0000000000000010"),
        "--prune-checkpoint-folders",
        "1",
    )
    assert done.returncode == 0, done.output
    assert f"removed checkpoint folder {stale}: unfinished, last written 2.0 days" in done.output
    assert not stale.exists() and (root / "0000000000000010" / FINISHED).is_file()
    assert (root / "0000000000000010" / MARKER).is_file()  # created here: the trainer's


def test_the_writer_snapshots_the_state_it_was_given(tmp_path: Path) -> None:
    """The step goes on changing the weights while the file is written: the file holds them as
    they were when save returned."""
    weights = torch.zeros(1000)
    writer = CheckpointWriter(tmp_path, keep=2)
    for epoch in (1, 2, 3):
        writer.save({"epoch": epoch, "model": {"w": weights}, "history": [epoch]}, epoch)
        weights += 1  # the next steps, in place, as an optimizer does
    writer.wait()
    assert [e for e, _ in list_checkpoints(tmp_path)] == [3, 2]
    for epoch in (3, 2):
        saved = torch.load(tmp_path / f"checkpoint-{epoch}.pt", weights_only=True)
        assert saved["history"] == [epoch]
        assert torch.equal(saved["model"]["w"], torch.full((1000,), float(epoch - 1)))
    assert len(writer.stalls) == 3


def test_a_failed_background_write_is_raised_and_leaves_the_old_file(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep=3)
    writer.save({"epoch": 1}, 1)

    class Unpicklable:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("disk full")

    writer.save({"epoch": 2, "bad": Unpicklable()}, 2)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint-2\.pt could not be written"):
        writer.wait()
    assert [e for e, _ in list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1.pt"]


FSYNC_DELAY_S = 10  # each fsync held this long: a write is still in flight while epochs run


def _strace() -> str:
    found = shutil.which("strace")
    if found is None:
        if os.environ.get("RETRAIN_REQUIRE_EMULATED_NODES"):
            pytest.fail("strace is missing (make setup installs it as root)")
        pytest.skip("strace is missing (make setup installs it as root): it holds the write open")
    return found


@pytest.mark.processes
def test_killed_during_a_background_write_resumes_from_the_newest_intact(tmp_path: Path) -> None:
    """strace holds every fsync of the trainer for 10 s, so checkpoint 2 is still being written
    (its temp file there, not yet renamed) while epoch 3 trains: the step was not held. The
    trainer is killed right then; run again, it resumes from checkpoint 1, the newest intact."""
    out = tmp_path / "out"
    args = ("--epochs", "4", "--batch-size", "16", "--log-every", "1", "--seed", "4")
    cmd = [
        _strace(),
        *("-f", "-qq", "-o", os.devnull, "-e", "trace=fsync"),
        *("-e", f"inject=fsync:delay_enter={FSYNC_DELAY_S * 1_000_000}"),
        *trainer_command(1, "synthetic:300", out, *args),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    ckpts = out / "checkpoints"
    try:
        deadline = time.monotonic() + 180
        while not any("epoch 3 batch 1:" in line for line in list(lines)):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.01)
        in_flight = sorted(p.name for p in ckpts.glob(".checkpoint-2.pt.*.tmp"))
        written = [e for e, _ in list_checkpoints(ckpts)]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # strace and the trainer
        proc.wait()
        reader.join()
    assert len(in_flight) == 1 and written == [1], (in_flight, written)
    assert (ckpts / in_flight[0]).exists()  # killed mid-write: the temp file is left

    again = run_trainer(1, "synthetic:300", out, *args)
    assert again.returncode == 0, again.output
    assert "resuming from checkpoint-1.pt: starting at epoch 2" in again.output
    assert [e["epoch"] for e in again.metrics["epochs"]] == [1, 2, 3, 4]
    assert [e for e, _ in list_checkpoints(ckpts)] == [4, 3, 2]


def _state(epoch: int, batch: int = 0, partial: bool = True) -> dict[str, object]:
    sums = {"loss_sum": 1.0, "correct": 1.0, "seen": 4, "seconds": 0.5}
    return {
        "format_version": 1,
        "epoch": epoch,
        "batch": batch,
        "model": {},
        "optimizer": {},
        "args": {},
        "history": [],
        "partial": [sums, sums] if batch and partial else None,
    }


def test_checkpoints_inside_an_epoch_order_and_a_torn_one_falls_back(tmp_path: Path) -> None:
    """A preemption while an emergency checkpoint is written: the file is written under a
    temporary name and renamed, so the newest name is whole or absent; a torn newest file (a
    copy gone wrong) falls back to the one before, inside the same epoch."""
    atomic_save(_state(1), tmp_path / "checkpoint-1.pt")
    atomic_save(_state(2, 5), tmp_path / "checkpoint-2-5.pt")
    atomic_save(_state(2, 9), tmp_path / "checkpoint-2-9.pt")
    torn = tmp_path / "checkpoint-2-9.pt"
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    (tmp_path / ".checkpoint-2-12.pt.x1y2.tmp").write_bytes(b"half a checkpoint")
    assert [p.name for _, p in list_checkpoints(tmp_path)] == [
        "checkpoint-2-9.pt",
        "checkpoint-2-5.pt",
        "checkpoint-1.pt",
    ]
    assert [e for e, _ in list_checkpoints(tmp_path)] == [1, 1, 1]  # whole epochs done
    found = newest_valid_checkpoint(tmp_path)
    assert found is not None and (found["epoch"], found["batch"]) == (2, 5)
    atomic_save(_state(2, 11, partial=False), tmp_path / "checkpoint-2-11.pt")
    with pytest.raises(ValueError, match="lacks the epoch's partial sums"):
        load_checkpoint(tmp_path / "checkpoint-2-11.pt")
