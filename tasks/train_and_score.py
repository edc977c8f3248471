"""Step 6: the Horovod job, and step 7: collect its outputs and score the model.

The job is the multi-instance task spec the Batch backend would submit. Its checkpoints live in
NFS under a key derived from data, code and training settings, so a retry (Prefect's, after a
killed or failed attempt) and a re-run with the same inputs resume instead of starting over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from backends.cluster import Cluster
from backends.progress_deadline import ProgressDeadline, trainer_record
from backends.taskspec import training_task, training_task_digest
from core.config import PipelineConfig
from core.run import Run
from registry.scoring import run_scorer
from tasks.steps import Done, step

REQUIRED_OUTPUTS = ("model.pt", "metrics.json", "logs/stdout.txt")


class TrainingFailedError(RuntimeError):
    """The training task exited non-zero; the message carries the end of its log."""


@dataclass(frozen=True)
class Trained:
    """What the training task did: its epochs' records, and where it stopped when asked to
    (``training/train.py --stop-file``: the budget's stop), resumable from that checkpoint."""

    epochs: list[dict[str, Any]]
    stopped_after: int | None = None  # the epoch whose checkpoint it stopped at


def training_key(config: PipelineConfig, staged_version: str, code_version: str) -> str:
    """Names the checkpoint folder: same data, code and settings, same folder (resume). The
    data version's folder is part of it: two versions of equal content are still two
    trainings, each resuming only its own checkpoints (a root without versions keeps the key
    it had before versions existed)."""
    inputs: dict[str, Any] = {
        "training": dataclasses.asdict(config.training),
        "processes": config.pool.nodes * config.pool.processes_per_node,
        "data": staged_version,
        "code": code_version,
        "task": training_task_digest(config),  # the trainer's arguments come from it too
    }
    if config.data.version:
        inputs["data_version"] = config.data.dataset.prefix
    settings = json.dumps(inputs, sort_keys=True)
    return hashlib.sha256(settings.encode()).hexdigest()[:16]


def progress_text(record: dict[str, Any], seen: list[dict[str, Any]]) -> str:
    """One epoch's line for the progress artifact: where training is, how fast, how long to go
    (the epochs left at the mean duration of those this attempt has trained)."""
    seconds = [float(r["seconds"]) for r in seen if "seconds" in r]
    left = (record["epochs"] - record["epoch"]) * (sum(seconds) / len(seconds)) if seconds else 0
    minutes, secs = divmod(round(left), 60)
    remaining = f"{minutes} min {secs} s" if minutes else f"{secs} s"
    return (
        f"epoch {record['epoch']} of {record['epochs']}: loss {record['train_loss']:.4f}, "
        f"accuracy {record['train_accuracy']:.4f}, {record['images_per_sec']:.0f} images/s, "
        f"about {remaining} left"
    )


def progress_record(line: str) -> dict[str, Any] | None:
    """The record of a trainer's ``PROGRESS {json}`` line, or None where it cannot be read
    (text either side of the object ignored: an older trainer wrote its newline apart)."""
    return trainer_record(line, "PROGRESS")


@step("run-training")
def run_training(
    config: PipelineConfig,
    cluster: Cluster,
    run: Run,
    key: str,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
) -> Done[Trained]:
    """``on_epoch``: given each epoch's ``PROGRESS`` record as it arrives (run tracking)."""
    logger = get_run_logger()
    spec = training_task(config, f"train-{run.id}", key, run.output_prefix)
    progress_id = cast(
        UUID,
        create_progress_artifact(
            0.0, key="training-progress", description=f"training {run.id}: starting"
        ),
    )
    epochs: list[dict[str, Any]] = []
    resumed: list[int] = []
    stopped: list[dict[str, Any]] = []
    tail: deque[str] = deque(maxlen=30)
    # No progress for too long ends the attempt (a rank stuck in a collective); the retry
    # (Prefect's here on the local cluster, the next task on Batch) resumes from the checkpoint.
    deadline = ProgressDeadline.of(config.retries)

    def on_line(line: str) -> None:
        tail.append(line)
        logger.info(line)
        deadline.observe(line)  # heartbeats and epochs are progress
        if "PROGRESS " not in line:
            return
        record = progress_record(line)
        if record is None:
            logger.warning("training: a PROGRESS line that is not a JSON object: %r", line)
            return
        if record.get("resumed_from") is not None:
            resumed.append(record["resumed_from"])
        if record.get("stopped"):
            stopped.append(record)
            return
        if "epoch" not in record:
            return  # an attempt that resumed after the last epoch: nothing trained
        epochs.append(record)
        if on_epoch is not None:
            on_epoch(record)
        update_progress_artifact(
            progress_id,
            100.0 * record["epoch"] / record["epochs"],
            description=progress_text(record, epochs),
        )

    result = cluster.run_task(spec, on_line, deadline)
    if result.exit_code != 0:
        hung = f" (ended: {result.stalls[-1]})" if result.stalls else ""
        raise TrainingFailedError(
            f"training task {spec.id} exited with {result.exit_code}{hung}; "
            "last lines:\n" + "\n".join(tail)
        )
    if stopped:  # a requested stop: no model, the checkpoint kept to resume from
        done = int(stopped[-1].get("epochs_done", 0))
        update_progress_artifact(
            progress_id,
            100.0 * done / max(int(stopped[-1].get("epochs", 1)), 1),
            description=f"training stopped on request after epoch {done}",
        )
        details = {"task": spec.id, "checkpoint_key": key, "stopped_after_epoch": done}
        return Done(
            True,
            Trained(epochs, done),
            {**details, "epochs_run": [e["epoch"] for e in epochs], "attempts": result.attempts},
        )
    update_progress_artifact(progress_id, 100.0, description="training finished")
    missing = [
        name for name in REQUIRED_OUTPUTS if f"{run.output_prefix}/{name}" not in result.uploaded
    ]
    if missing:
        raise TrainingFailedError(
            f"training task {spec.id} succeeded but did not produce {missing}"
        )
    return Done(
        True,
        Trained(epochs),
        {
            "task": spec.id,
            "checkpoint_key": key,
            "resumed_from_epoch": resumed[-1] if resumed else None,
            "epochs_run": [e["epoch"] for e in epochs],
            "outputs": len(result.uploaded),
            "attempts": result.attempts,
            "stalls": result.stalls,
            # Spot nodes preempted, and the move to dedicated ones (pool.spot_fallback).
            **(
                {"preemptions": result.preemptions, "spot_fallback": result.spot_fallback}
                if result.preemptions or result.spot_fallback
                else {}
            ),
        },
    )


@dataclass(frozen=True)
class Scored:
    """The trained model's figures: the trainer's metrics and the scorer's report."""

    metrics: dict[str, Any]  # metrics.json
    score: dict[str, Any]  # score.json: accuracy, per class, confusion matrix, num_images
    outputs: list[str]  # every blob of the run's outputs


@step("collect-and-score", retries=2, retry_delay_seconds=5)
def collect_and_score(cluster: Cluster, run: Run) -> Done[Scored]:
    logger = get_run_logger()
    task_id = f"score-{run.id}"
    prefix = run.output_prefix
    code, score = run_scorer(cluster, task_id, f"{prefix}/model.pt", prefix, "score", logger.info)
    if code != 0 or score is None or "error" in score:
        why = f": {score['error']}" if score and "error" in score else ""
        raise TrainingFailedError(f"scoring task {task_id} exited with {code}{why}")
    outputs = cluster.outputs
    metrics = json.loads(outputs.download_blob(f"{prefix}/metrics.json").readall())
    listed = sorted(b.name for b in outputs.list_blobs(name_starts_with=f"{prefix}/"))
    logger.info("score: accuracy %.4f on %d test images", score["accuracy"], score["num_images"])
    return Done(
        True,
        Scored(metrics, score, listed),
        {"accuracy": score["accuracy"], "files": len(listed)},
    )
