"""Step 8, champion/challenger (``registry.promotion``): the model becomes the champion of its
data root only when better by ``promotion.min_improvement`` on ``promotion.metric``, with no
class's recall dropping by more than ``promotion.max_class_drop``, both scored on this run's
test split."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger

from backends.blob import container_client
from backends.cluster import Cluster
from core.config import PipelineConfig
from core.data_versions import DataVersion
from core.run import Run
from registry.layout import decision_blob
from registry.migrate import migrate_legacy_records
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
    the champion record name). The champion challenged is that of ``config``'s data root."""
    logger = get_run_logger()
    outputs = container_client(config.output, config.retries.storage_retries)
    root = config.data.root
    migrate_legacy_records(outputs, config.output.prefix, root, logger.info)
    challenger = Challenger(
        run.id,
        f"{run.output_prefix}/model.pt",
        staged_version,
        score,
        root,
        f"{data.container}/{data.prefix}".rstrip("/") if data else None,
    )
    decision = challenge(
        outputs,
        config.output.prefix,
        challenger,
        config.promotion,
        rescore_on_cluster(cluster, run.id, run.output_prefix, logger.info),
        decision_blob(run.output_prefix),
    )
    if decision.note:
        logger.warning("promotion: %s", decision.note)
    logger.info(
        "promotion (champion of %s): %s (%s)",
        root.where,
        "promoted" if decision.promoted else "kept champion",
        decision.reason,
    )
    return Done(
        True,
        decision,
        {"promoted": decision.promoted, "data_root": root.where, "metric": config.promotion.metric},
    )
