"""The Prefect global concurrency limits that let one run at a time use a Batch pool, and one
run at a time use an NFS export (pools of several pipelines may mount one).

Their names and their creation are shared by the flow (which occupies the slots while it holds
the pool, see ``flows/pool_lock.py``, and creates a missing limit) and ``deployments/setup.py``
(which creates the pool's limit before the first run): both must spell the names the same way.
"""

from __future__ import annotations

import hashlib


def pool_slot(pool_id: str) -> str:
    """The name of the pool's global concurrency limit."""
    return f"retrain-pool-{pool_id}"


def nfs_slot(source: str) -> str:
    """The name of the global concurrency limit of the NFS export ``source`` (host:/path). A
    digest, as a limit's name may not hold '/': one export, spelled with or without a trailing
    slash, is one limit."""
    export = source.strip().rstrip("/") or "/"
    return f"retrain-nfs-{hashlib.sha256(export.encode()).hexdigest()[:16]}"


def ensure_limit(name: str) -> bool:
    """Create the global concurrency limit ``name`` with one slot unless it exists; True when
    this call created it. An existing limit is left as its owner set it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return False
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:  # created concurrently: the same result
            return False
        return True
