"""One run per pool at a time: a lock on this machine, and a Prefect global concurrency limit.

Two runs that share a pool must not overlap: the first one's release stops the second one's
tasks. Two mechanisms, because each covers what the other cannot:

- a file lock (``flock``) beside the local pool's state, ``work_dir/pools/<id>.lock``. It needs
  no server (two ``python -m flows.retrain`` in two shells, without ``PREFECT_API_URL``, each
  start an ephemeral API of their own), and the kernel drops it the moment its holder dies,
  however it dies, so a killed run never leaves a lock behind to wait out or to remove by hand;
- for a Batch pool (target azure), the global concurrency limit ``retrain-pool-<id>`` on the
  Prefect server, created with one slot when it is missing (``concurrency()`` on a missing
  limit does nothing, silently). It serializes runs on different machines that share one Batch
  pool through one server. A holder that dies keeps its slot until its lease runs out
  (``LEASE_SECONDS``), so a re-run after a killed orchestrator waits that long.

The local target's pool is a folder on this machine: only processes here can use it, and the
file lock alone serializes them (no lease to wait out after a crash). Without a configured
server (``PREFECT_API_URL`` unset: each process starts an ephemeral API of its own) no other
machine could share a slot either. The file lock is always taken first, so runs on one machine
never contend for the slot.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import IO

from core.config import PipelineConfig
from core.pool_slot import ensure_limit, pool_slot

# Renewed every 90 s while the run holds the slot (Prefect renews at 3/4 of the lease); Prefect's
# default is 300 s, its minimum 60 s. Shorter: a re-run after a crash waits less; longer: a busy
# orchestrator has more time to renew.
LEASE_SECONDS = 120


def _lock(fh: IO[str], wait: bool, say: Callable[[str], None], pool_id: str) -> bool:
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        if not wait:
            return False
    fh.seek(0)
    say(f"pool {pool_id} is in use by {fh.read().strip() or 'another run'}; waiting for it")
    fcntl.flock(fh, fcntl.LOCK_EX)
    return True


def _server_configured() -> bool:
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value())


@contextlib.contextmanager
def local_pool_lock(
    config: PipelineConfig,
    holder: str,
    wait: bool = True,
    say: Callable[[str], None] = lambda _: None,
) -> Iterator[bool]:
    """The file lock alone: yields True while held. With ``wait=False`` it does not queue and
    yields False when another run on this machine holds the pool.

    The crash and cancellation hook takes only this one before releasing: a run that died keeps
    its server slot until the lease runs out, and that stale slot of its own must not stop its
    own release. A run elsewhere cannot take the pool before that lease has run out.
    """
    pool_id = config.pool.id
    path = config.work_dir / "pools" / f"{pool_id}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        if not _lock(fh, wait, say, pool_id):
            yield False
            return
        fh.truncate(0)
        fh.write(json.dumps({"run": holder, "pid": os.getpid(), "since": round(time.time())}))
        fh.flush()
        yield True


@contextlib.contextmanager
def hold_pool(
    config: PipelineConfig,
    holder: str,
    shared: bool,
    say: Callable[[str], None] = lambda _: None,
) -> Iterator[None]:
    """Hold the config's pool for the block, waiting for the run that holds it now: the file
    lock, then (a pool other machines can use too, ``shared``, with a server configured) one
    slot of the pool's global concurrency limit."""
    from prefect.concurrency.sync import concurrency

    with local_pool_lock(config, holder, say=say):
        if not shared or not _server_configured():
            yield
            return
        name = pool_slot(config.pool.id)
        ensure_limit(name)
        with concurrency(
            name,
            occupy=1,
            lease_duration=LEASE_SECONDS,
            strict=True,
            raise_on_lease_renewal_failure=False,  # a server blip must not stop training
        ):
            yield
