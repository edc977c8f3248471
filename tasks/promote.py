"""Step 8, champion/challenger (``registry.promotion``): the model becomes the champion only
when better by ``promotion.min_improvement``, both scored on this run's test split."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger

from backends.blob import container_client
from backends.cluster import Cluster
from core.config import PipelineConfig
from core.data_versions import DataVersion
from core.run import Run
from registry.layout import decision_blob
from registry.promotion import Challenger, Decision, challenge, rescore_on_cluster
from tasks.steps import Done, step


@step("promote")
def promote(
    config: PipelineConfig,
    cluster: Cluster,
    run: Run,
    score: dict[str, Any],
    staged_version: str,
    data: DataVersion | None = None,
) -> Done[Decision]:
    """``score``: the scorer's report on this run's model; ``staged_version``: of the data it
    was trained and scored on; ``data``: the data version that was (which the decision and
    the champion record name)."""
    logger = get_run_logger()
    metric = config.promotion.metric
    challenger = Challenger(
        run.id,
        metric,
        float(score[metric]),
        f"{run.output_prefix}/model.pt",
        staged_version,
        score.get("num_images"),
        len(score.get("skipped_images") or []),
        f"{data.container}/{data.prefix}".rstrip("/") if data else None,
    )
    decision = challenge(
        container_client(config.output, config.retries.storage_retries),
        config.output.prefix,
        challenger,
        config.promotion.min_improvement,
        rescore_on_cluster(cluster, run.id, run.output_prefix, logger.info),
        decision_blob(run.output_prefix),
        min_scored_fraction=config.promotion.min_scored_fraction,
    )
    if decision.note:
        logger.warning("promotion: %s", decision.note)
    logger.info(
        "promotion: %s (%s)",
        "promoted" if decision.promoted else "kept champion",
        decision.reason,
    )
    return Done(True, decision, {"promoted": decision.promoted})
