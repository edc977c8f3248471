"""``python -m deployments.setup``: what ``prefect deploy --all`` needs on a Prefect server.

Creates (idempotently) the process work pool the deployments use and, for each config given,
a global concurrency limit of 1 named for its Batch pool, which the retrain flow occupies, so
two runs (manual, nightly, new data) never fight over one pool: the second waits. A data
version ledger kept by an older release (one Variable listing every version) becomes one record
per version, so an upgrade reports no old version again. The automations that send the
configs' alerts through their notification block (deployments/alerts.py) are created or
updated; a block that does not exist is an error naming it (exit status 2).
"""

from __future__ import annotations

import argparse
import sys

WORK_POOL = "retrain-workers"


def ensure(configs: list[str]) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    from core.config import load_config
    from core.pool_slot import ensure_limit, pool_slot
    from deployments.alerts import ensure_alerts
    from deployments.events import LEGACY_LEDGER, migrate_legacy_ledger

    done = []
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(WORK_POOL)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=WORK_POOL, type="process"))
            done.append(f"work pool {WORK_POOL} (process) created")
    loaded = [load_config(path) for path in configs]
    for config in loaded:
        name = pool_slot(config.pool.id)
        if ensure_limit(name):
            done.append(f"concurrency limit {name} = 1 created")
    done += ensure_alerts(loaded)
    migrated = migrate_legacy_ledger()
    if migrated:
        done.append(f"{migrated} data versions moved from {LEGACY_LEDGER} to one record each")
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.setup", description=__doc__)
    p.add_argument("--config", action="append", default=[], help="a pipeline config (repeatable)")
    args = p.parse_args(argv)
    from deployments.alerts import AlertsError

    try:
        lines = ensure(args.config or ["configs/local.yaml"])
    except AlertsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in lines or ["nothing to do"]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
