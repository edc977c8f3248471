"""Polling sensor for users without Event Grid: the ``watch-new-data`` flow.

Deployed on an interval (``watch-new-data/poll`` in prefect.yaml), it lists the data
container under the config's prefix and reports each data version not yet in the ledger (the
Prefect Variable ``retrain-data-versions-seen``, shared with the relay) as
``retrain.data.ready``, which the ``retrain/on-new-data`` trigger turns into a run. The
versions are the relay's, so relay and sensor together still start one run per version:
- marker (default): each ``<prefix>/<version>/_SUCCESS`` blob, versioned by its ETag;
- quiet period (``marker=None``): the whole listing under the prefix, versioned by a hash of
  names and ETags, once its newest blob is older than ``quiet_seconds``.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from prefect import flow, get_run_logger

from backends.blob import container_client, folder
from deployments.events import DataReady, emit
from flows.config import load_config


def find_versions(
    container: Any, prefix: str, marker: str | None, quiet_seconds: float
) -> list[DataReady]:
    blobs = list(container.list_blobs(name_starts_with=folder(prefix)))
    name = container.container_name
    if marker:
        done = sorted(
            (b for b in blobs if b.name.rpartition("/")[2] == marker), key=lambda b: b.last_modified
        )
        return [
            DataReady(name, b.name.rpartition("/")[0], str(b.etag).strip('"'), "sensor", b.name)
            for b in done
        ]
    if not blobs:
        return []
    newest = max(b.last_modified for b in blobs)
    if (datetime.now(UTC) - newest).total_seconds() < quiet_seconds:
        return []  # still arriving
    listing = sorted((b.name, str(b.etag).strip('"')) for b in blobs)
    version = hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]
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
    reported = []
    for ready in find_versions(container, config.data.prefix, marker, quiet_seconds):
        if emit(ready):
            logger.info("new data version %s", ready.key)
            reported.append(ready.key)
    if not reported:
        logger.info("no new data under %s/%s", config.data.container, config.data.prefix)
    return reported
