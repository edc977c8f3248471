"""Polling sensor for users without Event Grid: the ``watch-new-data`` flow.

Deployed on an interval (``watch-new-data/poll`` in prefect.yaml), it looks below the config's
data root (``core.data_versions``) and reports each data version not yet in the ledger (the
per-version Prefect Variables of deployments/events.py, shared with the relay) as
``retrain.data.ready``, which the ``retrain/on-new-data`` trigger turns into a run of that
version. The versions are the relay's, so relay and sensor together still start one run per
version:
- marker (default): each complete version (``<root>/<version>/_SUCCESS``), in the order the
  markers were written, as of its marker's ETag; a root without versions whose own marker
  (``<root>/_SUCCESS``) was written, as of that marker's;
- quiet period (``marker=None``, a root without versions or markers): the whole listing under
  the root, as of a hash of names and ETags (``events.quiet_version``, as the relay does), once
  its newest blob is older than ``quiet_seconds``.
A root that mixes loose files with versions reports nothing: the poll fails naming both, as
every run over it would.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.runtime import deployment

from backends.blob import container_client
from backends.data_root import survey
from core.config import load_config
from core.data_versions import MARKER, DataRoot, in_completion_order, refuse_mixed
from core.deployment_runs import check_config_path, deployment_config_path
from deployments.events import (
    BUSY,
    STARTED,
    DataReady,
    already_sent,
    emit,
    quiet_version,
)


def find_versions(
    container: Any, prefix: str, marker: str | None, quiet_seconds: float
) -> list[DataReady]:
    name = container.container_name
    root = DataRoot(name, prefix.strip("/"))
    if marker:
        if marker != MARKER:
            raise ValueError(
                f"marker {marker!r}: a data version is complete once its {MARKER} marker is "
                "written (core/data_versions.py); None polls a root without markers"
            )
        found = survey(container, root.prefix)
        refuse_mixed(found)
        ready = [
            DataReady(name, root.prefix, c.name, "sensor", root.marker(c.name), c.etag)
            for c in in_completion_order(found.complete)
        ]
        if not ready and found.root_marker_etag:
            own = root.marker(None)
            return [DataReady(name, root.prefix, "", "sensor", own, found.root_marker_etag)]
        return ready
    listed = quiet_version(container, root.prefix)
    if listed is None:
        return []
    revision, newest = listed
    if (datetime.now(UTC) - newest).total_seconds() < quiet_seconds:
        return []  # still arriving
    return [DataReady(name, root.prefix, "", "sensor", revision=revision)]


@flow(name="watch-new-data")
def watch_new_data(
    config_path: str = "configs/local.yaml",
    marker: str | None = "_SUCCESS",
    quiet_seconds: float = 300.0,
) -> list[str]:
    """Report each new data version once; returns the keys reported by this poll."""
    logger = get_run_logger()
    if deployment.id:  # the worker's credentials list only the deployment's roots
        check_config_path(config_path, deployment_config_path(deployment.id))
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
