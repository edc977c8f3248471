"""Scoring a model as a task on the cluster, on the held-out split its data holds now.

The run's own model is scored after training; the champion's model is scored again when it
was measured on other data, so both numbers of a promotion come from the same test split.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from backends.cluster import Cluster
from backends.taskspec import scoring_task

# The scorer's exit code when it refuses its input (a model or data it cannot score).
SCORER_REFUSED = 2


def run_scorer(
    cluster: Cluster,
    task_id: str,
    model_blob: str,
    output_prefix: str,
    name: str,
    on_line: Callable[[str], None],
    known_classes_only: bool = False,
) -> tuple[int, dict[str, Any] | None]:
    """Score ``model_blob`` on the held-out split the cluster's data holds now, as a task on
    the cluster. Returns the exit code and the report: the score, or on refusal (exit
    ``SCORER_REFUSED``) ``{"error": why}``; None when neither was uploaded.
    ``known_classes_only``: on the images of the classes the model knows, when the data's
    classes differ from the model's."""
    from azure.core.exceptions import ResourceNotFoundError

    spec = scoring_task(task_id, model_blob, output_prefix, name, known_classes_only)
    result = cluster.run_task(spec, on_line)
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
