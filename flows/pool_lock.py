"""One run per pool at a time: a lock on this machine, and a Prefect global concurrency limit.

Two runs that share a pool must not overlap: the first one's release stops the second one's
tasks. A run holds the pool from its data gate to its last-run record (``tasks/up_to_date.py``),
past the pool's release, so deciding "up to date" and claiming the pool are one step: a run of
the same inputs that waited finds that record and trains nothing, where it once trained the
same version again. Two mechanisms, because each covers what the other cannot:

- a file lock (filelock) beside the local pool's state, ``work_dir/pools/<id>.lock``. It needs
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

The NFS folder is held the same way, for the same run. Pipelines with pools of their own may
share it: on Azure several pools mount one export (``nfs.source``), and locally every config
that keeps the default ``nfs.local_dir`` shares ``.work/nfs``. Staging makes the folder's
``data/`` exactly one pipeline's data version, deleting every other file: run together, one
pipeline's staging deleted the other's images between its training and its scoring, or the
other trained on data that was not its own. So a run also holds its NFS folder: on this
machine a file lock in the folder itself (``<nfs.local_dir>/.retrain.lock``: every config
that names the folder, however spelled, meets the same lock), for a Batch pool a lock under
``work_dir/locks/`` and the global concurrency limit of the export (``retrain-nfs-<digest>``),
taken together with the pool's limit in one request. Pipelines that share an NFS folder
therefore take turns, and each run's log says whom it waits for; give each pipeline an NFS
folder of its own to run them side by side. Locks are always taken in one order (pool, then
NFS folder; file locks before server slots, both server slots at once), so two runs never
wait for each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from core.config import PipelineConfig
from core.pool_slot import ensure_limit, nfs_slot, pool_slot

# Renewed every 90 s while the run holds the slot (Prefect renews at 3/4 of the lease); Prefect's
# default is 300 s, its minimum 60 s. Shorter: a re-run after a crash waits less; longer: a busy
# orchestrator has more time to renew.
LEASE_SECONDS = 120


NFS_LOCK = ".retrain.lock"  # in a local NFS folder: held by the run that uses the folder


@contextlib.contextmanager
def _file_lock(
    path: Path, holder: dict[str, object], wait: bool, say: Callable[[str], None], what: str
) -> Iterator[bool]:
    """A file lock on ``path`` for the block (yields False when taken and ``wait`` is off); the
    file then names ``holder`` for whoever waits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, preserve_lock_file=True)  # the file names its holder
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if not wait:
            yield False
            return
        try:
            named = path.read_text(errors="replace").strip()
        except OSError:
            named = ""
        say(f"{what} is in use by {named or 'another run'}; waiting for it")
        lock.acquire()
    try:
        path.write_text(json.dumps({**holder, "pid": os.getpid(), "since": round(time.time())}))
        yield True
    finally:
        lock.release()


def nfs_folder(config: PipelineConfig, shared: bool) -> tuple[str, Path]:
    """The NFS folder a run of ``config`` uses, as (its name for people, its lock file here).

    Not ``shared`` (the local target): ``nfs.local_dir``, a folder on this machine, locked in
    itself. Shared (a Batch pool): the export ``nfs.source``, whose lock on this machine is
    under ``work_dir/locks/`` (the server's limit covers the other machines)."""
    if not shared:
        folder = config.nfs.local_dir.resolve()
        return f"NFS folder {folder}", folder / NFS_LOCK
    source = str(config.nfs.source)
    return f"NFS export {source}", config.work_dir / "locks" / f"{nfs_slot(source)}.lock"


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
    with _file_lock(path, {"run": holder}, wait, say, f"pool {pool_id}") as held:
        yield held


@contextlib.contextmanager
def hold_pool(
    config: PipelineConfig,
    holder: str,
    shared: bool,
    say: Callable[[str], None] = lambda _: None,
) -> Iterator[None]:
    """Hold the config's pool and its NFS folder for the block, waiting for the runs that
    hold them now: the file locks, then (a pool other machines can use too, ``shared``, with a
    server configured) one slot of the pool's global concurrency limit and one of the NFS
    export's, in one request."""
    from prefect.concurrency.sync import concurrency

    name, nfs_lock = nfs_folder(config, shared)
    with (
        local_pool_lock(config, holder, say=say),
        _file_lock(nfs_lock, {"run": holder, "pool": config.pool.id}, True, say, name),
    ):
        if not shared or not _server_configured():
            yield
            return
        slots = [pool_slot(config.pool.id), nfs_slot(str(config.nfs.source))]
        for slot in slots:
            ensure_limit(slot)
        with concurrency(
            slots,
            occupy=1,
            lease_duration=LEASE_SECONDS,
            strict=True,
            raise_on_lease_renewal_failure=False,  # a server blip must not stop training
        ):
            yield
