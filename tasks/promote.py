"""Step 8, champion/challenger: promote the new model only when it is better by a margin.

Both numbers come from the same held-out data. The champion's recorded score was measured on
the test split of the data it was trained on; when this run's data version differs, the
champion's model is scored again, as a task on the cluster, on this run's test split, and the
decision is made on those two numbers (both are kept in ``promotion.json``). A champion whose
model cannot be scored on this data (it is gone, damaged, or knows other classes) is no
baseline for it: the challenger replaces it, and the decision says why.

The champion record (``backends.champion``) is replaced with an ETag condition, so two runs
finishing together cannot both believe they won; a damaged record is a named decision.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from backends.blob import container_client
from backends.champion import (
    CHAMPION,
    Champion,
    ChampionMovedError,
    ChampionRead,
    read_champion,
    replace_champion,
)
from backends.taskspec import Cluster
from flows.config import PipelineConfig
from tasks.steps import step_record
from tasks.training import SCORER_REFUSED, run_scorer

RESCORE_NAME = "champion-score"  # its report in the run's outputs: champion-score.json


def decide(challenger: float, champion: float | None, margin: float) -> tuple[bool, str]:
    """Promote when the challenger beats the champion by more than ``margin``; the reason as a
    person would say it (no "by more than 0.0000" when no margin is asked for)."""
    if champion is None:
        return True, f"no champion yet: accuracy {challenger:.4f} becomes the first"
    ahead = challenger - champion
    versus = f"accuracy {challenger:.4f} against the champion's {champion:.4f}"
    if ahead > margin:
        needed = f", more than the {margin:g} required" if margin else ""
        return True, f"{versus}: better by {ahead:.4f}{needed}"
    if ahead > 0:
        return False, f"{versus}: better by only {ahead:.4f}, not more than the {margin:g} required"
    return False, f"{versus}: {'the same' if ahead == 0 else 'worse'}, so it does not beat it"


def rescore_champion(
    cluster: Cluster, champion: Champion, run_id: str, output_prefix: str, logger: Any
) -> dict[str, Any]:
    """The champion's model scored on this run's test split: the scorer's report, or
    ``{"error": why}`` when the model cannot be scored on this data."""
    if not cluster.outputs.get_blob_client(champion.model).exists():
        return {"error": f"the champion's model {champion.model} no longer exists"}
    code, report = run_scorer(
        cluster,
        f"score-champion-{run_id}",
        champion.model,
        output_prefix,
        RESCORE_NAME,
        logger.info,
    )
    if code == SCORER_REFUSED and report and "error" in report:
        return {"error": str(report["error"])}
    if code != 0 or report is None or "error" in report:
        raise RuntimeError(f"scoring the champion's model {champion.model} exited with {code}")
    return report


def _baseline(
    read: ChampionRead,
    metric: str,
    data_version: str,
    cluster: Cluster,
    run_id: str,
    output_prefix: str,
    logger: Any,
) -> tuple[float | None, dict[str, Any] | None, str]:
    """The number the challenger must beat (None: nothing to beat), what was measured for
    it, and a note for the reason when there is nothing comparable."""
    champion = read.champion
    if read.damaged:
        return None, None, f"the champion record {CHAMPION} is damaged ({read.damaged})"
    if champion is None:
        return None, None, ""
    if champion.data_version == data_version:
        return champion.value, None, ""
    rescored = rescore_champion(cluster, champion, run_id, output_prefix, logger)
    if "error" in rescored:
        return None, rescored, f"the champion cannot be scored on this data ({rescored['error']})"
    return float(rescored[metric]), rescored, ""


@task(name="promote", cache_policy=NONE)
def promote(
    config: PipelineConfig,
    cluster: Cluster,
    run_id: str,
    output_prefix: str,
    score: dict[str, Any],
    data_version: str,
) -> dict[str, Any]:
    started = time.perf_counter()
    logger = get_run_logger()
    metric = config.promotion.metric
    container = container_client(config.output, config.retries.storage_retries)
    read = read_champion(container, metric)
    accuracy = float(score[metric])
    baseline, rescored, note = _baseline(
        read, metric, data_version, cluster, run_id, output_prefix, logger
    )
    if note:
        logger.warning("promotion: %s", note)
        promoted, reason = True, f"{note}: accuracy {accuracy:.4f} becomes the champion"
    else:
        promoted, reason = decide(accuracy, baseline, config.promotion.min_improvement)
        if rescored is not None:
            reason += " (both scored on this run's test split)"
    kept = None
    if promoted:
        new = Champion(
            run_id,
            metric,
            accuracy,
            f"{output_prefix}/model.pt",
            data_version,
            datetime.now(UTC).isoformat(),
        )
        try:
            kept = replace_champion(container, new, read)
        except ChampionMovedError:
            promoted, reason = False, "another run replaced the champion meanwhile: not promoted"
    champion = read.champion
    decision = {
        "run_id": run_id,
        "promoted": promoted,
        "reason": reason,
        "metric": metric,
        "accuracy": accuracy,
        "challenger": {
            metric: accuracy,
            "data_version": data_version,
            "test_images": score.get("num_images"),
        },
        "champion_record": read.state,
        "champion_before": champion.as_record() if champion else None,
        # The champion's model on the challenger's test split, when the data versions differ.
        "champion_on_this_test_split": (
            {
                metric: rescored.get(metric),
                "test_images": rescored.get("num_images"),
                "error": rescored.get("error"),
            }
            if rescored is not None
            else None
        ),
    }
    if read.damaged:
        decision["damaged_record"] = {"why": read.damaged, "kept_as": kept}
    container.upload_blob(
        f"{output_prefix}/promotion.json", json.dumps(decision, indent=2), overwrite=True
    )
    logger.info("promotion: %s (%s)", "promoted" if promoted else "kept champion", reason)
    return {**step_record("promote", started, True, promoted=promoted), "decision": decision}
