"""Atomic checkpoints and the search for the newest one that can really be loaded.

A node can die mid-write (a low-priority VM pre-empted, a retry killing the task), so files are
written under a temporary name and renamed: a reader sees a whole checkpoint or none. Files
that are truncated or corrupt anyway (a full disk, a copy gone wrong) are skipped with a
warning, and training falls back to the previous epoch rather than crashing. So are files that
load but do not fit the model being trained (other shapes, another optimizer): applying one
would fail on every retry of the job, so the search goes on to an older one, and with none
left training starts from the beginning.

Checkpoint folders are kept for resuming, and only for that. In the pipeline each training key
(data, code and settings; a forced run's key also names the run) has a folder under the NFS
folder's ``checkpoints/``, one to a few GB for a ResNet, and nothing else ever removed them.
The policy (:func:`prune_checkpoint_folders`, run by the trainer at start when asked with
``--prune-checkpoint-folders DAYS``, as the pipeline's training task does):

- the folder being trained is kept (a retry, Prefect's or Batch's, resumes from it), and in it
  the newest ``--keep-checkpoints`` (3) checkpoints;
- a folder whose training finished (:data:`FINISHED`: the model was exported from it) is
  removed by the next training of another key: the run it served either succeeded, and a run
  of the same inputs is then up to date (or forced, with a key of its own), or failed after
  training, and a re-run of the same inputs right after it still finds the folder (its own);
- a folder whose training did not finish is kept for ``DAYS`` after its last write, so that a
  re-run of a failed or killed run resumes, then removed;
- a folder holding anything but checkpoints is left alone (with a warning): only what the
  trainer wrote is removed;
- only a folder the trainer created is ever removed: it writes :data:`MARKER` into a folder
  when it creates it for its first checkpoint. A folder it did not create (a user's, another
  tool's, one made by hand for ``--checkpoint-dir``, or one from before the marker) holds no
  marker and is never touched, whatever it holds or however old it is;
- the folders looked at are those beside ``--checkpoint-dir`` as given: when it is a symbolic
  link, beside the link, never beside its target.

Writing does not hold the training step (:class:`CheckpointWriter`): the state is copied to host
memory, which is all the step waits for, and a background thread serialises it, writes it under
the temporary name, syncs it to disk and renames it. One write is in flight at a time, and a
newer checkpoint replaces an older one only by that rename, so a process killed at any moment
leaves the newest complete checkpoint in place.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.atomic import atomic_write, atomic_write_json

log = logging.getLogger("training")

FORMAT_VERSION = 1
# checkpoint-<E>.pt: after epoch E; checkpoint-<E>-<B>.pt: inside epoch E, B of its batches done.
_NAME = re.compile(r"^checkpoint-(\d+)(?:-(\d+))?\.pt$")
REQUIRED_KEYS = {"format_version", "epoch", "model", "optimizer", "args", "history"}
# What each rank has summed of an epoch a checkpoint is inside of (``batch`` > 0).
PARTIAL_KEYS = ("loss_sum", "correct", "seen", "seconds")
# Written beside the checkpoints once the model was exported from them: the folder's training
# is over, no later attempt of that run needs it.
FINISHED = "finished.json"
# Written into a checkpoint folder by the trainer that created it: only such a folder is ever
# pruned.
MARKER = "checkpoint-folder.json"
# What a checkpoint folder holds: checkpoints, the two markers, and atomic_write's temp files
# (".<name>.<random>.tmp") left by a writer that died.
_OWN_FILE = re.compile(
    r"^(checkpoint-\d+(-\d+)?\.pt|finished\.json|checkpoint-folder\.json"
    r"|\.(checkpoint-\d+(-\d+)?\.pt|finished\.json|checkpoint-folder\.json)\..+\.tmp)$"
)
DAY_SECONDS = 86_400


def atomic_save(obj: object, path: Path) -> None:
    atomic_write(path, lambda fh: torch.save(obj, fh))


def checkpoint_path(directory: Path, epoch: int, batch: int = 0) -> Path:
    """After ``epoch`` (``batch`` 0), or inside it with ``batch`` of its batches trained."""
    return directory / (f"checkpoint-{epoch}-{batch}.pt" if batch else f"checkpoint-{epoch}.pt")


def checkpoint_position(path: Path) -> tuple[int, int] | None:
    """(whole epochs done, batches done in the next) of a checkpoint's file name."""
    m = _NAME.match(path.name)
    if m is None:
        return None
    epoch, batch = int(m.group(1)), int(m.group(2) or 0)
    return (epoch - 1, batch) if batch else (epoch, 0)


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(whole epochs done, path) for every checkpoint file, newest first (inside an epoch, the
    one with more of its batches trained first)."""
    if not directory.is_dir():
        return []
    found = [(pos, p) for p in directory.iterdir() if (pos := checkpoint_position(p)) is not None]
    return [(pos[0], p) for pos, p in sorted(found, reverse=True)]


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
    if type(state["epoch"]) is not int or state["epoch"] < 1:
        raise ValueError(f"{path} has epoch {state['epoch']!r}, not a positive integer")
    if not isinstance(state["history"], list):
        raise ValueError(f"{path} has a history that is not a list")
    batch = state.get("batch", 0)
    if type(batch) is not int or batch < 0:
        raise ValueError(f"{path} has batch {batch!r}, not a count of batches")
    partial = state.get("partial")
    if batch and not (
        isinstance(partial, list)
        and all(isinstance(p, dict) and set(p) >= set(PARTIAL_KEYS) for p in partial)
    ):
        raise ValueError(f"{path} is inside an epoch but lacks the epoch's partial sums")
    return state


def mismatch(
    state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> str | None:
    """Why ``state`` cannot be applied to ``model`` and ``optimizer``, or None when it can.

    Checked before anything is applied, because ``load_state_dict`` copies the tensors that
    fit before it raises about the rest: a failed attempt would leave the model half-loaded.
    """
    want = model.state_dict()
    why = _weights_mismatch(state["model"], want)
    if why is not None:
        return why
    best = state.get("best")
    if best is not None:
        if not isinstance(best, dict) or type(best.get("epoch")) is not int:
            return "its best epoch's record is not the trainer's"
        if "model" in best and (why := _weights_mismatch(best["model"], want)):
            return f"its best epoch's weights do not fit: {why}"
    saved = state["optimizer"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or [len(g.get("params", [])) for g in groups] != [
        len(g["params"]) for g in optimizer.param_groups
    ]:
        return "its optimizer state is for other parameter groups"
    for index, entry in (saved.get("state") or {}).items():
        if type(index) is not int or not 0 <= index < len(params) or not isinstance(entry, dict):
            return f"its optimizer state names parameter {index!r}, which the model lacks"
        shape = params[index].shape
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != shape:
                return f"optimizer {name} of parameter {index} has another shape than the model's"
    rngs = state.get("rng")
    if rngs is not None and not (
        isinstance(rngs, list)
        and all(isinstance(r, dict) and {"python", "numpy", "torch"} <= r.keys() for r in rngs)
    ):
        return "its random-number states are not the trainer's"
    return None


def _weights_mismatch(weights: Any, want: dict[str, torch.Tensor]) -> str | None:
    if not isinstance(weights, dict):
        return "its model weights are not a state dict"
    if weights.keys() != want.keys():
        odd = sorted(set(weights) ^ set(want))[:3]
        return f"its weights name other layers than the model's (e.g. {odd})"
    for key, tensor in want.items():
        have = weights[key]
        if not isinstance(have, torch.Tensor) or have.shape != tensor.shape:
            shape = tuple(have.shape) if isinstance(have, torch.Tensor) else type(have).__name__
            return f"{key} is {shape} in the checkpoint, {tuple(tensor.shape)} in the model"
    return None


def newest_valid_checkpoint(
    directory: Path, fits: Callable[[dict[str, Any]], str | None] | None = None
) -> dict[str, Any] | None:
    """The newest checkpoint that loads (and for which ``fits`` finds no mismatch), skipping
    damaged and unfitting ones with a warning that says why."""
    for _epoch, path in list_checkpoints(directory):
        try:
            state = load_checkpoint(path)
        except ValueError as exc:
            log.warning("skipping damaged checkpoint: %s", exc)
            continue
        why = fits(state) if fits is not None else None
        if why is None:
            return state
        log.warning("skipping checkpoint %s: it does not fit this model: %s", path, why)
    return None


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints: enough to fall back past a damaged one."""
    for _epoch, path in list_checkpoints(directory)[keep:]:
        path.unlink(missing_ok=True)


def claim_folder(directory: Path) -> bool:
    """Create ``directory`` and write :data:`MARKER` into it, when it does not exist yet: the
    folder is then the trainer's to prune. A folder that exists already is left unmarked (it
    is someone else's, or an earlier attempt's, which marked it when it created it)."""
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        return False
    atomic_write_json(
        {"created_by": "training.train", "created_at": round(time.time())}, directory / MARKER
    )
    return True


def mark_finished(directory: Path, epochs: int) -> None:
    """Say in ``directory`` that its training is over (the model was exported from it)."""
    atomic_write_json({"epochs": epochs, "finished_at": round(time.time())}, directory / FINISHED)


def _last_write(folder: Path, files: list[Path]) -> float:
    return max([folder.stat().st_mtime, *(f.stat().st_mtime for f in files)])


def _remove_own(folder: Path, entries: list[Path]) -> bool:
    """Delete the trainer's files in ``folder``, then the folder: a file that appeared since
    it was looked at keeps it (with everything not the trainer's)."""
    for entry in entries:
        entry.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError as exc:
        log.warning("checkpoint folder %s not removed: %s", folder, exc.strerror or exc)
        return False
    return True


def prune_checkpoint_folders(
    keep: Path, unfinished_days: float, now: float | None = None
) -> list[tuple[Path, str]]:
    """Remove the checkpoint folders beside ``keep`` that no run will resume (the policy in
    the module docstring); the folders removed, each with why."""
    now = time.time() if now is None else now
    given = Path(os.path.abspath(keep))  # beside the path as given: a link is not followed
    own = keep.resolve()
    removed: list[tuple[Path, str]] = []
    if not given.parent.is_dir():
        return removed
    for folder in sorted(given.parent.iterdir()):
        if folder == given or folder.is_symlink() or not folder.is_dir():
            continue
        if folder.resolve() == own:
            continue
        marker = folder / MARKER
        if marker.is_symlink() or not marker.is_file():
            continue  # not created by the trainer: never its to remove
        entries = list(folder.iterdir())
        strangers = [
            e.name
            for e in entries
            if e.is_symlink() or not (e.is_file() and _OWN_FILE.match(e.name))
        ]
        if strangers:
            log.warning(
                "checkpoint folder %s also holds %s: not the trainer's alone, left as it is",
                folder,
                ", ".join(sorted(strangers)[:3]),
            )
            continue
        if (folder / FINISHED).is_file():
            why = "its training finished (the model was exported from it)"
        else:
            idle_days = (now - _last_write(folder, entries)) / DAY_SECONDS
            if idle_days < unfinished_days:
                continue  # a re-run of the run that left it may still resume from it
            why = f"unfinished, last written {idle_days:.1f} days ago (kept {unfinished_days:g})"
        if _remove_own(folder, entries):
            removed.append((folder, why))
    return removed


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed (a full disk, a lost share)."""


def host_copy(value: Any) -> Any:
    """``value`` with every tensor in it copied to host memory, and every container copied: the
    snapshot a background write serialises while training goes on changing the originals."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(host_copy(v) for v in value)
    return value


class CheckpointWriter:
    """Writes checkpoints in a background thread, one at a time, each atomically.

    :meth:`save` returns once the state is copied to host memory; the next :meth:`save`, and
    :meth:`wait` (called before the job's outputs are written), first wait for the write in
    flight and raise its error, if it failed, naming the file. The thread is not a daemon: a
    process that stops on an error still finishes the write it started.
    """

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory, self.keep = directory, keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: Path | None = None
        self.stalls: list[float] = []  # seconds each save held its caller
        self._claimed = False

    def save(self, state: dict[str, Any], epoch: int, batch: int = 0) -> float:
        """Snapshot ``state`` and start writing it as ``checkpoint-<epoch>.pt`` (or
        ``checkpoint-<epoch>-<batch>.pt`` inside the epoch); returns the seconds the caller was
        held (the previous write's remainder, if any, and the copy)."""
        started = time.perf_counter()
        self.wait()
        if not self._claimed:
            claim_folder(self.directory)  # marked as the trainer's when this creates it
            self._claimed = True
        snapshot = host_copy(state)
        path = checkpoint_path(self.directory, epoch, batch)
        self._path = path
        self._thread = threading.Thread(
            target=self._write, args=(snapshot, path), name=f"write-{path.name}"
        )
        self._thread.start()
        stall = time.perf_counter() - started
        self.stalls.append(stall)
        return stall

    def _write(self, snapshot: dict[str, Any], path: Path) -> None:
        started = time.perf_counter()
        try:
            atomic_save(snapshot, path)
            prune_checkpoints(self.directory, self.keep)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc
            return
        log.info(
            "%s written in %.2f s, in the background", path.name, time.perf_counter() - started
        )

    def wait(self) -> None:
        """Return once no write is in flight; raise the last one's error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointWriteError(f"{self._path} could not be written: {error}") from error
