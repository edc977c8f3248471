"""The service's runs, through Prefect's own client: those left in progress by an unclean stop
marked crashed before its worker starts (their slots freed), those in progress cancelled before
it stops (their pools released), and the workers it started, recorded in its state folder.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.atomic import atomic_write_json
from deployments.setup import WORK_POOL

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

WORKERS_FILE = "workers.json"  # in the state folder: the workers the last starts ran
KEPT_WORKERS = 10


@contextlib.contextmanager
def prefect_client(api: str | None, auth: str | None = None) -> Iterator[SyncPrefectClient]:
    """Prefect's own client for the server at ``api`` (the settings' when None), presenting
    ``auth`` (the settings' when None)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    updates: dict[Any, Any] = {}
    if api is not None:
        updates[PREFECT_API_URL] = api
    if auth is not None:
        updates[PREFECT_API_AUTH_STRING] = auth
    with temporary_settings(updates=updates), get_client(sync_client=True) as client:
        yield client


def _active_runs(client: SyncPrefectClient, pool: str) -> list[Any]:
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType

    active = [StateType.RUNNING, StateType.PENDING, StateType.CANCELLING]
    return list(
        client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=active))
            ),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
        )
    )


def cancel_runs(
    api: str | None, pool: str = WORK_POOL, seconds: float = 90.0, auth: str | None = None
) -> str | None:
    """Cancel the flow runs in progress on ``pool`` and wait for them to end: a run cancelled
    through the API stops its tasks and releases its pool (its cancellation hook), where a
    signal would leave the pool held and the run marked running for good (and its deployment,
    one run at a time, blocked). What it did, for the status line; None when nothing ran."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    with prefect_client(api, auth) as client:
        runs = _active_runs(client, pool)
        if not runs:
            return None
        for flow_run in runs:
            if flow_run.state is None or flow_run.state.type != StateType.CANCELLING:
                client.set_flow_run_state(
                    flow_run.id, Cancelling(message="the service is stopping")
                )
        deadline = time.monotonic() + seconds
        left = runs
        while left and time.monotonic() < deadline:
            time.sleep(1)
            left = _active_runs(client, pool)
    still = f", {len(left)} still running after {seconds:.0f} s" if left else ""
    return f"cancelled {len(runs)} run{'s' if len(runs) > 1 else ''} in progress{still}"


def crash_orphans(
    api: str | None, pool: str = WORK_POOL, ours: Collection[str] = (), auth: str | None = None
) -> str | None:
    """Before the service's worker starts: runs still marked in progress on ``pool`` were left
    by a service that did not stop cleanly (killed, power lost); their processes are gone, and
    each holds its deployment's only slot. They are marked crashed (which frees the slot),
    unless a worker other than the service's earlier ones (``ours``, by name) is online on the
    pool: then they may be its. An earlier worker of this service is dead whatever its last
    heartbeat says (the server calls a worker online for 90 s after it)."""
    from prefect.states import Crashed

    with prefect_client(api, auth) as client:
        workers = client.read_workers_for_work_pool(pool)
        if any(w.status.value == "ONLINE" and w.name not in ours for w in workers):
            return None
        runs = _active_runs(client, pool)
        for flow_run in runs:
            client.set_flow_run_state(
                flow_run.id,
                Crashed(message="left in progress by a service that did not stop cleanly"),
                force=True,
            )
    return (
        f"{len(runs)} run{'s' if len(runs) > 1 else ''} left by an earlier stop marked crashed"
        if runs
        else None
    )


def earlier_workers(state: Path) -> list[str]:
    """The names of the workers earlier starts of this service (this state folder) ran."""
    try:
        names = json.loads((state / WORKERS_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [str(n) for n in names] if isinstance(names, list) else []


def start_worker(
    api: str | None, state: Path, name: str, pool: str = WORK_POOL, auth: str | None = None
) -> str | None:
    """Before the worker starts: the runs the earlier workers left are crashed, and this one is
    recorded as the service's. Only one service runs on a state folder (its PostgreSQL data),
    so every worker recorded there is dead when the next one starts; the last few are kept
    (a start that crashed nothing, another worker being online, tries again next time)."""
    earlier = earlier_workers(state)
    note = crash_orphans(api, pool, ours=earlier, auth=auth)
    state.mkdir(parents=True, exist_ok=True)
    # Replaced whole: never a half-written list.
    atomic_write_json([*earlier, name][-KEPT_WORKERS:], state / WORKERS_FILE)
    return note


def worker_online(api: str, auth: str | None, name: str) -> bool:
    """Whether the worker named ``name`` has sent its heartbeat to the server."""
    from prefect.exceptions import ObjectNotFound

    try:
        with prefect_client(api, auth) as client:
            workers = client.read_workers_for_work_pool(WORK_POOL)
    except (OSError, ObjectNotFound):
        return False
    return any(w.name == name and w.status.value == "ONLINE" for w in workers)
