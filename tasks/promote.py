"""Step 8, champion/challenger: promote the new model only when it is better by a margin.

The champion record sits beside the models in the output container and is replaced with an
ETag condition, so two runs finishing together cannot both believe they won.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from backends.blob import container_client
from flows.config import PipelineConfig
from tasks.steps import step_record

CHAMPION = "models/champion.json"


def read_champion(container: Any) -> tuple[dict[str, Any] | None, str | None]:
    from azure.core.exceptions import ResourceNotFoundError

    try:
        download = container.download_blob(CHAMPION)
    except ResourceNotFoundError:
        return None, None
    return json.loads(download.readall()), download.properties.etag


def decide(challenger: float, champion: float | None, margin: float) -> tuple[bool, str]:
    if champion is None:
        return True, f"no champion yet: accuracy {challenger:.4f} becomes the first"
    if challenger > champion + margin:
        return True, (
            f"accuracy {challenger:.4f} beats the champion's {champion:.4f} "
            f"by more than {margin:.4f}"
        )
    return False, (
        f"accuracy {challenger:.4f} does not beat the champion's {champion:.4f} "
        f"by more than {margin:.4f}"
    )


@task(name="promote", cache_policy=NONE)
def promote(
    config: PipelineConfig, run_id: str, output_prefix: str, score: dict[str, Any]
) -> dict[str, Any]:
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError

    started = time.perf_counter()
    container = container_client(config.output, config.retries.storage_retries)
    champion, etag = read_champion(container)
    accuracy = float(score[config.promotion.metric])
    promoted, reason = decide(
        accuracy,
        champion[config.promotion.metric] if champion else None,
        config.promotion.min_improvement,
    )
    if promoted:
        record = {
            "run_id": run_id,
            config.promotion.metric: accuracy,
            "model": f"{output_prefix}/model.pt",
            "promoted_at": datetime.now(UTC).isoformat(),
            "previous": champion,
        }
        condition = (
            {"etag": etag, "match_condition": MatchConditions.IfNotModified}
            if etag
            else {"match_condition": MatchConditions.IfMissing}
        )
        try:
            container.upload_blob(
                CHAMPION, json.dumps(record, indent=2), overwrite=True, **condition
            )
        except (ResourceModifiedError, ResourceExistsError):
            promoted, reason = False, "another run replaced the champion meanwhile: not promoted"
    decision = {
        "run_id": run_id,
        "promoted": promoted,
        "reason": reason,
        "accuracy": accuracy,
        "champion_before": champion,
    }
    container.upload_blob(
        f"{output_prefix}/promotion.json", json.dumps(decision, indent=2), overwrite=True
    )
    get_run_logger().info("promotion: %s (%s)", "promoted" if promoted else "kept champion", reason)
    return {**step_record("promote", started, True, promoted=promoted), "decision": decision}
