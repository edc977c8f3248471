"""Step 6: the Horovod job, and step 7: collect its outputs and score the model.

The job is the multi-instance task spec the Batch backend would submit. Its checkpoints live in
NFS under a key derived from data, code and training settings, so a retry (Prefect's, after a
killed or failed attempt) and a re-run with the same inputs resume instead of starting over.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import deque
from typing import Any, cast
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NONE

from backends.taskspec import Cluster, scoring_task, training_task
from flows.config import PipelineConfig
from tasks.steps import step_record

RESUMED = re.compile(r"resuming from checkpoint-(\d+)\.pt")
REQUIRED_OUTPUTS = ("model.pt", "metrics.json", "logs/stdout.txt")


class TrainingFailedError(RuntimeError):
    """The training task exited non-zero; the message carries the end of its log."""


def training_key(config: PipelineConfig, data_version: str, code_version: str) -> str:
    """Names the checkpoint folder: same data, code and settings, same folder (resume)."""
    settings = json.dumps(
        {
            "training": config.training.model_dump(mode="json"),
            "processes": config.pool.nodes * config.pool.processes_per_node,
            "data": data_version,
            "code": code_version,
        },
        sort_keys=True,
    )
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


@task(name="run-training", cache_policy=NONE)
def run_training(
    config: PipelineConfig, cluster: Cluster, run_id: str, key: str, output_prefix: str
) -> dict[str, Any]:
    logger = get_run_logger()
    started = time.perf_counter()
    spec = training_task(config, f"train-{run_id}", key, output_prefix)
    progress_id = cast(
        UUID,
        create_progress_artifact(
            0.0, key="training-progress", description=f"training {run_id}: starting"
        ),
    )
    epochs: list[dict[str, Any]] = []
    resumed: list[int] = []
    tail: deque[str] = deque(maxlen=30)

    def on_line(line: str) -> None:
        tail.append(line)
        logger.info(line)
        if "PROGRESS " in line:
            record = json.loads(line.split("PROGRESS ", 1)[1])
            epochs.append(record)
            update_progress_artifact(
                progress_id,
                100.0 * record["epoch"] / record["epochs"],
                description=progress_text(record, epochs),
            )
        elif match := RESUMED.search(line):
            resumed.append(int(match.group(1)))

    result = cluster.run_task(spec, on_line)
    if result.exit_code != 0:
        raise TrainingFailedError(
            f"training task {spec.id} exited with {result.exit_code}; "
            "last lines:\n" + "\n".join(tail)
        )
    update_progress_artifact(progress_id, 100.0, description="training finished")
    missing = [
        name for name in REQUIRED_OUTPUTS if f"{output_prefix}/{name}" not in result.uploaded
    ]
    if missing:
        raise TrainingFailedError(
            f"training task {spec.id} succeeded but did not produce {missing}"
        )
    return step_record(
        "run-training",
        started,
        True,
        task=spec.id,
        checkpoint_key=key,
        resumed_from_epoch=resumed[-1] if resumed else None,
        epochs_run=[e["epoch"] for e in epochs],
        outputs=len(result.uploaded),
        attempts=result.attempts,
    )


# The scorer's exit code when it refuses its input (a model or data it cannot score).
SCORER_REFUSED = 2


def run_scorer(
    cluster: Cluster, task_id: str, model_blob: str, output_prefix: str, name: str, on_line: Any
) -> tuple[int, dict[str, Any] | None]:
    """Score ``model_blob`` on the held-out split the cluster's data holds now, as a task on
    the cluster. Returns the exit code and the report: the score, or on refusal (exit
    ``SCORER_REFUSED``) ``{"error": why}``; None when neither was uploaded."""
    from azure.core.exceptions import ResourceNotFoundError

    result = cluster.run_task(scoring_task(task_id, model_blob, output_prefix, name), on_line)
    blob = (
        f"{output_prefix}/{name}.json"
        if result.exit_code == 0
        else f"{output_prefix}/{name}.error.json"
    )
    try:
        report = json.loads(cluster.outputs.download_blob(blob).readall())
    except (ResourceNotFoundError, ValueError):  # none, or not JSON: the exit code says why
        return result.exit_code, None
    return result.exit_code, report if isinstance(report, dict) else None


@task(name="collect-and-score", cache_policy=NONE, retries=2, retry_delay_seconds=5)
def collect_and_score(
    config: PipelineConfig, cluster: Cluster, run_id: str, output_prefix: str
) -> dict[str, Any]:
    logger = get_run_logger()
    started = time.perf_counter()
    task_id = f"score-{run_id}"
    code, score = run_scorer(
        cluster, task_id, f"{output_prefix}/model.pt", output_prefix, "score", logger.info
    )
    if code != 0 or score is None or "error" in score:
        why = f": {score['error']}" if score and "error" in score else ""
        raise TrainingFailedError(f"scoring task {task_id} exited with {code}{why}")
    outputs = cluster.outputs
    metrics = json.loads(outputs.download_blob(f"{output_prefix}/metrics.json").readall())
    listed = sorted(b.name for b in outputs.list_blobs(name_starts_with=f"{output_prefix}/"))
    logger.info("score: accuracy %.4f on %d test images", score["accuracy"], score["num_images"])
    record = step_record(
        "collect-and-score", started, True, accuracy=score["accuracy"], files=len(listed)
    )
    return {**record, "metrics": metrics, "score": score, "outputs": listed}
