"""Step 1, the data gate (``gate/``): a failed gate raises, and nothing after it runs.

It first chooses the data version the run trains (``core.data_versions``: the one the run
names, else the newest complete one, else the whole root when it holds no versions); every blob
of that version is validated but its completion marker; the listing the gate validated (names
and ETags) is pinned in the run's output prefix, and staging stages exactly that listing: what
is trained is what was validated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from backends.blob import container_client, upload_directory
from backends.data_root import resolve
from core.config import PipelineConfig
from core.data_versions import DataVersion, DataVersionError
from core.links import output_link
from core.run import Run
from gate.deadline import GateTimeoutError
from gate.docs_assets import DocsAssetError, localize
from gate.manifest import BlobChangedError, build_manifest, list_dataset
from gate.report import DataValidationError, failure, gate_markdown
from gate.verdicts import judge
from staging.listing import listing_blob, listing_json, listing_version
from tasks.fit_to_data import DataFacts
from tasks.steps import Done, step

# The gate's refusals: the data cannot be trained (or the version asked for does not exist),
# and the message names the files, the versions and what to do. A run the gate refuses ends
# failed with that message (flows/retrain.py); a traceback would only say where in the gate
# the refusal was raised, so none is logged with it.
REFUSALS: tuple[type[Exception], ...] = (
    BlobChangedError,
    DataValidationError,
    DataVersionError,
    GateTimeoutError,
)


class _RefusalsWithoutTraceback(logging.Filter):
    """Prefect logs a failed task's exception with its traceback: for the gate's refusals, the
    message alone (the record is kept, its traceback dropped)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], REFUSALS):
            record.exc_info = None
            record.exc_text = None
        return True


logging.getLogger("prefect.task_runs").addFilter(_RefusalsWithoutTraceback())


def gate_cache_dir(config: PipelineConfig) -> Path:
    """Where the gate keeps what each read found, by content (see :mod:`gate.manifest`)."""
    return config.work_dir / "gate-cache"


@dataclass(frozen=True)
class Validated:
    """What the gate passed: the data version, its listing's digest (what the up-to-date
    check compares, known before anything is staged) and what its images are."""

    version: DataVersion
    listing_version: str
    facts: DataFacts | None = None  # image counts and sizes, for fitting the training to them


@step("validate-data")
def validate_data(config: PipelineConfig, run: Run) -> Done[Validated]:
    """The gate over the data version the run trains."""
    logger = get_run_logger()
    output_prefix = run.output_prefix
    retries = config.retries.storage_retries
    version = resolve(config.data, retries)
    logger.info("data: %s (%s)", version.describe(), version.chosen)
    dataset = config.data.pinned(version.version).dataset
    blobs = list_dataset(dataset, retries)
    rows, cached = build_manifest(
        dataset, gate_cache_dir(config), retries, blobs, config.validation.timeout_minutes
    )
    docs = run.work_dir / "data_docs"
    verdict = judge(rows, config.validation, docs, gate_cache_dir(config) / "verdicts")
    success, records = verdict.success, verdict.records
    if verdict.reused:
        logger.info("the same manifest and rules were judged before: that verdict stands")
    try:  # readable offline: the pages' styles and scripts go with them (gate/docs_assets.py)
        localize(docs)
    except DocsAssetError as exc:
        logger.warning("the Data Docs load their styles and scripts from CDNs: %s", exc)
    outputs = container_client(config.output, retries, create=True)
    upload_directory(outputs, docs, f"{output_prefix}/data_docs", workers=8)
    docs_url = output_link(config.output, outputs, f"{output_prefix}/data_docs/index.html")
    where = f"{dataset.container}/{dataset.prefix}".rstrip("/")
    create_markdown_artifact(
        gate_markdown(success, rows, records, where, docs_url, verdict.reused),
        key="data-gate",
        description="Great Expectations gate",
    )
    if not success:
        raise failure(rows, records)
    # Staging stages exactly this listing (names and ETags), nothing listed later.
    pinned = listing_blob(output_prefix)
    outputs.upload_blob(pinned, listing_json(dataset.prefix, blobs), overwrite=True)
    logger.info(
        "data gate passed: %d images (%d unchanged since the last gate, not read again), "
        "%d expectations",
        len(rows),
        cached,
        len(records),
    )
    return Done(
        True,
        Validated(version, listing_version(blobs), DataFacts.from_rows(rows)),
        {
            "data_version": version.label,
            "data_prefix": dataset.prefix,
            "images": len(rows),
            "read_from_cache": cached,
            "verdict_reused": verdict.reused,
            "listing": pinned,
            "classes": len({r["label"] for r in rows}),
            "data_docs": docs_url,
        },
    )
