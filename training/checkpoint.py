"""Atomic checkpoints and the search for the newest one that can really be loaded.

A node can die mid-write (a low-priority VM pre-empted, a retry killing the task), so files are
written under a temporary name and renamed: a reader sees a whole checkpoint or none. Files
that are truncated or corrupt anyway (a full disk, a copy gone wrong) are skipped with a
warning, and training falls back to the previous epoch rather than crashing.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from training.atomic import atomic_write

log = logging.getLogger("training")

FORMAT_VERSION = 1
_NAME = re.compile(r"^checkpoint-(\d+)\.pt$")
REQUIRED_KEYS = {"format_version", "epoch", "model", "optimizer", "args", "history"}


def atomic_save(obj: object, path: Path) -> None:
    atomic_write(path, lambda fh: torch.save(obj, fh))


def checkpoint_path(directory: Path, epoch: int) -> Path:
    return directory / f"checkpoint-{epoch}.pt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(epoch, path) for every checkpoint file, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load and sanity-check one checkpoint; raise ValueError if it is not usable."""
    try:
        # weights_only: a checkpoint on shared storage must not be able to run code.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a damaged zip/pickle
        raise ValueError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or not state.keys() >= REQUIRED_KEYS:
        raise ValueError(f"{path} is not a training checkpoint (missing keys)")
    if state["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format version {state['format_version']}, want {FORMAT_VERSION}"
        )
    return state


def newest_valid_checkpoint(directory: Path) -> dict[str, Any] | None:
    """The newest checkpoint that loads, skipping damaged ones with a warning."""
    for _epoch, path in list_checkpoints(directory):
        try:
            return load_checkpoint(path)
        except ValueError as exc:
            log.warning("skipping damaged checkpoint: %s", exc)
    return None


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints: enough to fall back past a damaged one."""
    for _epoch, path in list_checkpoints(directory)[keep:]:
        path.unlink(missing_ok=True)
