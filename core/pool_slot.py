"""The Prefect global concurrency limit that lets one run at a time use a Batch pool.

Its name and its creation are shared by the flow (which occupies the slot while it holds the
pool, see ``flows/pool_lock.py``) and ``deployments/setup.py`` (which creates the limits before
the first run): both must spell the name the same way.
"""

from __future__ import annotations


def pool_slot(pool_id: str) -> str:
    """The name of the pool's global concurrency limit."""
    return f"retrain-pool-{pool_id}"


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
