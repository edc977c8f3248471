"""Checkpoint pruning against folders that are not the trainer's (docs/reliability.md,
"Adversarial inputs"): the pipeline's NFS checkpoints/ folder is shared, and users and other
tools leave folders there. Through the trainer's command line, as the training task runs it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.conftest import run_trainer
from tests.reliability import report
from training.checkpoint import DAY_SECONDS, FINISHED, MARKER


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


@pytest.mark.processes
def test_pruning_removes_only_folders_the_trainer_created(tmp_path: Path) -> None:
    """Through the trainer's command line, as the pipeline's training task runs it. Before:
    an empty 30-day-old folder, another tool's folder holding only finished.json and a user's
    kept checkpoint-12.pt were deleted; with --checkpoint-dir a symbolic link, the folders
    beside the link's target were pruned instead of those beside the link."""
    root = tmp_path / "nfs" / "checkpoints"
    elsewhere = tmp_path / "scratch"
    theirs = {
        "empty": _folder(root, "empty", {}, days_ago=30, ours=False),
        "another tool's finished.json": _folder(
            root, "tool-run", {FINISHED: b'{"status": "done"}'}, ours=False
        ),
        "a user's checkpoint-12.pt": _folder(
            root, "kept", {"checkpoint-12.pt": b"weights"}, days_ago=30, ours=False
        ),
        # Beside the link's target: the trainer's own kind of folder, but not beside the link.
        "beside the link's target": _folder(
            elsewhere, "0000000000000001", {FINISHED: b"{}", "checkpoint-1.pt": b"x"}
        ),
    }
    finished = _folder(root, "0000000000000002", {FINISHED: b"{}", "checkpoint-3.pt": b"x"})
    link = root / "0000000000000003"  # to a folder the user made on a larger disk
    (elsewhere / "0000000000000003").mkdir()
    link.symlink_to(elsewhere / "0000000000000003", target_is_directory=True)

    done = run_trainer(
        1,
        "synthetic:200",
        tmp_path / "out",
        "--epochs",
        "1",
        "--checkpoint-dir",
        str(link),
        "--prune-checkpoint-folders",
        "1",
    )

    assert done.returncode == 0, done.output
    assert not finished.exists(), done.output  # the trainer's, beside the link: pruned
    kept = {what: folder.is_dir() for what, folder in theirs.items()}
    assert kept == dict.fromkeys(theirs, True), done.output
    assert (theirs["a user's checkpoint-12.pt"] / "checkpoint-12.pt").read_bytes() == b"weights"
    # The user's folder: trained in, but not marked as the trainer's (it did not create it).
    target = elsewhere / "0000000000000003"
    assert (target / FINISHED).is_file() and not (target / MARKER).exists()
    report.record(
        "adversarial",
        "--prune-checkpoint-folders beside an empty 30-day-old folder, another tool's folder "
        "holding only finished.json, a user's checkpoint-12.pt; --checkpoint-dir a symlink",
        "only folders the trainer created (its marker) removed, beside the link, not its target",
    )
