"""Step 1, the data gate (``gate/``): a failed gate raises, and nothing after it runs.

Every blob under the prefix is validated but the completion marker; the listing the gate
validated (names and ETags) is pinned in the run's output prefix, and staging stages exactly
that listing: what is trained is what was validated.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE

from backends.blob import blob_link, container_client, upload_directory
from backends.listing import listing_blob, listing_json
from core.config import PipelineConfig
from gate.manifest import build_manifest, list_dataset
from gate.report import failure, gate_markdown
from gate.suites import run_expectations
from tasks.steps import step_record


def gate_cache_dir(config: PipelineConfig) -> Path:
    """Where the gate keeps what each read found, by blob name and ETag."""
    return config.work_dir / "gate-cache"


@task(name="validate-data", cache_policy=NONE)
def validate_data(config: PipelineConfig, run_dir: Path, output_prefix: str) -> dict[str, Any]:
    logger = get_run_logger()
    started = time.perf_counter()
    retries = config.retries.storage_retries
    blobs = list_dataset(config.data, retries)
    rows, cached = build_manifest(config.data, gate_cache_dir(config), retries, blobs)
    docs = run_dir / "data_docs"
    success, records = run_expectations(rows, config.validation, docs)
    outputs = container_client(config.output, retries, create=True)
    upload_directory(outputs, docs, f"{output_prefix}/data_docs", workers=8)
    docs_url = blob_link(outputs, f"{output_prefix}/data_docs/index.html")
    where = f"{config.data.container}/{config.data.prefix}"
    create_markdown_artifact(
        gate_markdown(success, rows, records, where, docs_url),
        key="data-gate",
        description="Great Expectations gate",
    )
    if not success:
        raise failure(rows, records)
    # Staging stages exactly this listing (names and ETags), nothing listed later.
    pinned = listing_blob(output_prefix)
    outputs.upload_blob(pinned, listing_json(config.data.prefix, blobs), overwrite=True)
    logger.info(
        "data gate passed: %d images (%d unchanged since the last gate, not read again), "
        "%d expectations",
        len(rows),
        cached,
        len(records),
    )
    return step_record(
        "validate-data",
        started,
        True,
        images=len(rows),
        read_from_cache=cached,
        listing=pinned,
        classes=len({r["label"] for r in rows}),
        data_docs=docs_url,
    )
