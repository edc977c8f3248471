"""Polling sensor for users without Event Grid: the ``watch-new-data`` flow.

Deployed on an interval (``watch-new-data/poll`` in prefect.yaml), it lists the data
container under the config's prefix and reports each data version not yet in the ledger (the
per-version Prefect Variables of deployments/events.py, shared with the relay) as
``retrain.data.ready``, which the ``retrain/on-new-data`` trigger turns into a run. The
versions are the relay's, so relay and sensor together still start one run per version:
- marker (default): each ``<prefix>/<version>/_SUCCESS`` blob, versioned by its ETag;
- quiet period (``marker=None``): the whole listing under the prefix, versioned by a hash of
  names and ETags (``events.quiet_version``, as the relay does), once its newest blob is older
  than ``quiet_seconds``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client

from backends.blob import container_client, folder
from core.config import load_config
from deployments.events import (
    BUSY,
    STARTED,
    DataReady,
    already_sent,
    emit,
    normalize_etag,
    quiet_version,
)


def find_versions(
    container: Any, prefix: str, marker: str | None, quiet_seconds: float
) -> list[DataReady]:
    name = container.container_name
    if marker:
        blobs = container.list_blobs(name_starts_with=folder(prefix))
        done = sorted(
            (b for b in blobs if b.name.rpartition("/")[2] == marker), key=lambda b: b.last_modified
        )
        return [
            DataReady(name, b.name.rpartition("/")[0], normalize_etag(b.etag), "sensor", b.name)
            for b in done
        ]
    found = quiet_version(container, prefix)
    if found is None:
        return []
    version, newest = found
    if (datetime.now(UTC) - newest).total_seconds() < quiet_seconds:
        return []  # still arriving
    return [DataReady(name, prefix.strip("/"), version, "sensor")]


@flow(name="watch-new-data")
def watch_new_data(
    config_path: str = "configs/local.yaml",
    marker: str | None = "_SUCCESS",
    quiet_seconds: float = 300.0,
) -> list[str]:
    """Report each new data version once; returns the keys reported by this poll."""
    logger = get_run_logger()
    config = load_config(config_path)
    container = container_client(config.data, config.retries.storage_retries)
    reported: list[str] = []
    failed: list[str] = []
    found = find_versions(container, config.data.prefix, marker, quiet_seconds)
    with get_client(sync_client=True) as client:
        sent = already_sent((r.key for r in found), client)  # every version seen before
        for ready in found:
            if ready.key in sent:
                continue
            try:
                outcome = emit(ready, client=client)
            except Exception as exc:  # the others still get their turn; the next poll retries
                logger.error("could not report data version %s: %s", ready.key, exc)
                failed.append(ready.key)
                continue
            if outcome == STARTED:
                logger.info("new data version %s", ready.key)
                reported.append(ready.key)
            elif outcome == BUSY:
                logger.info("data version %s is being reported by the relay", ready.key)
    if failed:
        raise RuntimeError(f"{len(failed)} data versions not reported; the next poll retries")
    if not reported:
        logger.info("no new data under %s/%s", config.data.container, config.data.prefix)
    return reported
