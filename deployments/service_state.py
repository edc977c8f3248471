"""The state folder of ``make service`` and what it owns: the options a service runs with,
the folder's id and lock (one service per state folder), the unprivileged account and the access
it is given (deployments/account.py), the settings its clients read (the checkout's ``.env``,
``client.env``), and ``--clean``, which removes it all.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.service_env import ENV_FILE, env_text, written_by_service
from deployments.account import Account, grant, revoke, service_account
from deployments.credentials import CLIENT_FILE, MLFLOW_USER, Credentials, private_file
from deployments.supervisor import shown

if TYPE_CHECKING:
    from core.config import PipelineConfig

ROOT = Path(__file__).resolve().parents[1]
ID_FILE = "service-id"  # in the state folder: its own id, which owns its PostgreSQL data
LOCK_FILE = "service.lock"  # in the state folder: held by the service running on it
DEFAULT_STATE = ROOT / ".service"


@dataclass(frozen=True)
class Options:
    config: str
    state: Path
    azurite_port: int
    prefect_port: int
    relay_host: str
    relay_port: int
    gateway_port: int | None = None  # None: output.links_url's when loopback, else 4280
    user: str | None = None  # as root: the account of the worker, relay and gateway


def service_id(state: Path) -> str:
    """The state folder's own id, made on its first start (what its PostgreSQL data folder's
    owner record names)."""
    path = state / ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        state.mkdir(parents=True, exist_ok=True)
        made = secrets.token_hex(8)
        path.write_text(made + "\n")
        return made


def client_settings(options: Options, config: PipelineConfig, creds: Credentials) -> dict[str, str]:
    """What a client of the service needs: its addresses and the credentials of the APIs a
    run calls (Prefect's, MLflow's, the storage account's). Not the gateway's: people open it,
    runs do not."""
    from backends.local.azurite import connection_string
    from deployments.tracking_server import local_address

    settings = {
        "PREFECT_API_URL": f"http://127.0.0.1:{options.prefect_port}/api",
        "PREFECT_API_AUTH_STRING": creds.prefect,
    }
    storage = connection_string(options.azurite_port, creds.storage_key)
    for variable in {config.data.connection_string_env, config.output.connection_string_env}:
        if variable:
            settings[variable] = storage
    if local_address(config.tracking.mlflow_uri) is not None:
        settings["MLFLOW_TRACKING_USERNAME"] = MLFLOW_USER
        settings["MLFLOW_TRACKING_PASSWORD"] = creds.mlflow_password
    return settings


def prepare(options: Options, say: Any) -> Account | None:
    """As root: the account the worker, relay and gateway run as, made when missing, and the
    folders it needs opened to it alone (deployments/account.py); None otherwise."""
    from core.config import load_config

    account, note = service_account(options.state, options.user)
    if account is None:
        return None
    config = load_config(options.config)

    def here(path: Path) -> Path:  # the worker runs from the checkout: relative to it
        return path if path.is_absolute() else ROOT / path

    writes = [options.state / "account-home"]
    if config.target == "local":
        writes += [here(config.work_dir), here(config.share.local_dir), here(config.nfs.local_dir)]
    python = Path(sys.base_prefix)  # the interpreter the venv links to (it may be below /root)
    began = time.monotonic()
    grant(account, options.state, [ROOT, here(Path(options.config)), python], writes)
    made = f", {note}" if note else ""
    say(
        f"{'account':<11} {'ready':<5} {time.monotonic() - began:6.1f}s  {account.name} (uid "
        f"{account.uid}{made}): the worker, its flow runs, the relay and the gateway run as it, "
        "not root; it may write " + ", ".join(shown(w) for w in writes)
    )
    return account


def client_files(options: Options, account: Account | None, say: Any) -> list[Path]:
    """The settings a client of the service needs, where clients find them: ``client.env`` in
    the state folder (to source from elsewhere) and, for the checkout's own state folder, the
    checkout's ``.env`` (its commands read it: core/service_env.py), the account allowed to read
    it (Prefect reads it in the worker's folder). A ``.env`` of the person's own is left as it
    is, and said so. Returns the files to remove when the service stops."""
    from core.config import load_config

    state = options.state
    settings = client_settings(options, load_config(options.config), Credentials.of(state))
    text = env_text(settings, shown(state))
    private_file(state / CLIENT_FILE, text)
    if state != DEFAULT_STATE:
        return []
    target = ROOT / ENV_FILE
    if target.exists() and not written_by_service(target):
        say(
            f"{ENV_FILE} in the checkout is not the service's: left as it is (source "
            f"{shown(state / CLIENT_FILE)} to reach the service from a shell)"
        )
        return []
    private_file(target, text)
    if account is not None:
        from deployments.account import allow_read

        allow_read(account, target)
    return [target]


def hold(state: Path) -> Any:
    """The state folder's lock, held while the service runs on it (one service per state
    folder: its PostgreSQL data); ServiceError naming the running one otherwise."""
    from filelock import FileLock, Timeout

    from deployments.supervisor import ServiceError

    state.mkdir(parents=True, exist_ok=True)
    lock = FileLock(state / LOCK_FILE, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        try:
            pid = (state / "service.pid").read_text().strip()
        except OSError:
            pid = "?"
        raise ServiceError(
            f"the service of {state} is running (pid {pid}): stop it first (Ctrl-C in its terminal)"
        ) from None
    (state / "service.pid").write_text(f"{os.getpid()}\n")
    return lock


def clean(state: Path, say: Any) -> int:
    """Remove the service of ``state``: its PostgreSQL data wherever it lies (below the
    ``postgres`` user's home included, with its owner record), the access its account was
    given (and the account, when the service made it), the checkout's ``.env`` when it is the
    service's, and the state folder itself. Refused while the service runs."""
    from deployments.postgres import Cluster, PostgresError
    from deployments.supervisor import ServiceError

    try:
        lock = hold(state)
    except ServiceError as exc:
        say(f"error: {exc}")
        return 1
    done: list[str] = []
    try:
        try:
            removed = Cluster.at(state / "postgres").remove()
        except PostgresError as exc:  # no PostgreSQL here: a data folder can only be inside
            say(f"PostgreSQL: {exc}")
            removed = None
        done += [removed] if removed else []
        done += revoke(state)
        env_file = ROOT / ENV_FILE
        if state == DEFAULT_STATE and written_by_service(env_file):
            env_file.unlink()
            done.append(f"{shown(env_file)} removed")
    finally:
        lock.release()
    shutil.rmtree(state, ignore_errors=True)
    done.append(f"state folder {shown(state)} removed")
    for line in done:
        say(line)
    return 0
