"""``make service`` (``python -m deployments.service``): the whole local service in one command.

In order, each started only once the one before answers its health check: Azurite with the
local target's dataset uploaded, PostgreSQL (its data in the state folder, ``.service/``), a
Prefect server on it (which creates or migrates its tables as it starts), the MLflow tracking
server where ``tracking.mlflow_uri`` points at this machine (deployments/tracking_server.py),
the work pool and the deployments of prefect.yaml, a worker, the Event Grid relay and the
outputs gateway
(deployments/supervisor.py starts and stops them). Each component prints one status line; every
log goes to ``<state>/logs/``. Ctrl-C or SIGTERM stops them all in the reverse order, each with
its whole process tree; runs in progress are cancelled through the API first, so their pools
are released, and runs an unclean stop left marked in progress are marked crashed at the next
start.

Each component that listens on a port has an option for it, but two: MLflow listens where
``tracking.mlflow_uri`` says (the address the runs log to: change that field to move it), and
PostgreSQL on a socket in its data folder only.

Everything listens on loopback; the relay too unless ``--relay-host`` says otherwise (put it
behind TLS: README, "Running it as a service"). The relay's shared secret is generated once into
``<state>/relay-secret`` (mode 0600) unless ``RETRAIN_RELAY_SECRET`` is set; it is never printed.

Loopback is every local user's: the Prefect API (and its UI), MLflow and the outputs gateway ask
for a credential, and the service's Azurite has a key of its own, all generated on the first
start into ``<state>/credentials/`` (deployments/credentials.py; readable by the starting user
alone), given to the components through their environment, never a command line; a request
without it is answered 401. Started as root, the service runs its worker (and so every flow run:
a deployment's pull step may run a shell command), the relay and the gateway as an unprivileged
account (``--user``, else one of its own: deployments/account.py), as PostgreSQL runs as
``postgres``. The checkout's commands find the service through the checkout's ``.env``
(core/service_env.py) while it runs on the checkout's own state folder. A port already taken is
refused, naming what holds it, never reused. ``--clean`` removes the state folder with what lies
outside it (a PostgreSQL data folder below the ``postgres`` user's home, the account's access).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from core.service_env import ENV_FILE, env_text, written_by_service
from deployments.account import Account, grant, revoke, service_account
from deployments.credentials import (
    CLIENT_FILE,
    GATEWAY_USER,
    MLFLOW_USER,
    Credentials,
    mlflow_auth_config,
    private_file,
)
from deployments.setup import WORK_POOL
from deployments.supervisor import (
    STATE_VARIABLE,
    Component,
    http_ok,
    port_in_use,
    shown,
    supervise,
)

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

    from core.config import PipelineConfig
    from deployments.postgres import Cluster

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORKERS_FILE = "workers.json"  # in the state folder: the workers the last starts ran
KEPT_WORKERS = 10
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


def relay_secret(state: Path) -> str:
    """RETRAIN_RELAY_SECRET, else the state folder's own, generated once (owner-only file)."""
    given = os.environ.get("RETRAIN_RELAY_SECRET")
    if given:
        return given
    path = state / "relay-secret"
    if not path.exists():
        state.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(24))
    return path.read_text().strip()


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


def components(options: Options, account: Account | None = None) -> list[Component]:
    """The service, in start order; the worker, relay and gateway as ``account`` when given."""
    from backends.local.azurite import ACCOUNT, ACCOUNTS_ENV
    from core.config import load_config
    from core.links import listen_address
    from deployments.postgres import Cluster

    config = load_config(options.config)
    state = options.state
    creds = Credentials.of(state)
    api = f"http://127.0.0.1:{options.prefect_port}/api"
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "PWD": str(ROOT),  # prefect.yaml's pull step: flows run from this checkout
        "PREFECT_HOME": str(state / "prefect"),  # not ~/.prefect: the command line's own
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        STATE_VARIABLE: str(state),  # names the service to a second one on the same port
        **client_settings(options, config, creds),
    }
    # The account's processes: its own home, caches and Prefect home, nothing of root's.
    own = {**env, **account.environment()} if account else env
    run_as = account.popen() if account else {}
    postgres = Cluster.at(state / "postgres")
    worker_name = f"service-{socket.gethostname()}-{os.getpid()}"
    gateway_host, gateway_port = listen_address(config.output.links_url, None, options.gateway_port)
    gateway_netloc = f"[{gateway_host}]" if ":" in gateway_host else gateway_host
    relay_env = {
        **own,
        "RETRAIN_RELAY_WATCH": os.environ.get("RETRAIN_RELAY_WATCH")
        or f"{config.data.container}/{config.data.prefix}".rstrip("/"),
        "RETRAIN_RELAY_SECRET": relay_secret(state),
    }
    deploy = [str(BIN / "prefect"), "--no-prompt", "deploy", "--all"]
    deploy += ["--prefect-file", str(deployments_file(options.config, state))]
    creds_dir = shown(state / "credentials")
    private = [state / "azurite", state / "prefect", state / "mlflow-artifacts"]
    return [
        Component(
            "azurite",
            [
                sys.executable,
                str(ROOT / "scripts" / "demo.py"),
                "--serve-storage",
                "--port",
                str(options.azurite_port),
                "--dir",
                str(state),
            ],
            # Ready once it has answered and uploaded the dataset (its closing line says so).
            ready=lambda: (
                port_in_use("127.0.0.1", options.azurite_port)
                and _said(state, "azurite", "Azurite is serving")
            ),
            where=f"Blob on 127.0.0.1:{options.azurite_port}, {_seeded(config)}; its account's "
            f"key is the service's own ({creds_dir}/storage-key), not the published one",
            env={**env, ACCOUNTS_ENV: f"{ACCOUNT}:{creds.storage_key}"},
            before=lambda: _private_folders(private),
            port=("127.0.0.1", options.azurite_port),
            timeout=300,
        ),
        postgres_component(postgres, state),
        prefect_component(options.prefect_port, postgres, env, creds, creds_dir),
        *tracking_components(config.tracking.mlflow_uri, postgres, state, env, creds),
        Component(
            "pool",
            [sys.executable, "-m", "deployments.setup", "--config", options.config],
            where=f"work pool {WORK_POOL}, the pool's concurrency limit; "
            + _alerts_status(config, options.config),
            env=env,
            once=True,
        ),
        Component(
            "deploy",
            deploy,
            where="the deployments of prefect.yaml",
            env={**env, "RETRAIN_FORM_CONFIG": options.config},
            once=True,
            timeout=300,
        ),
        *image_components(config, options.config, account, env),
        Component(
            "worker",
            [str(BIN / "prefect"), "worker", "start", "--pool", WORK_POOL, "--name", worker_name],
            ready=lambda: _worker_online(api, creds.prefect, worker_name),
            before=lambda: start_worker(api, state, worker_name, auth=creds.prefect),
            before_stop=lambda: cancel_runs(api, auth=creds.prefect),
            where=f"{worker_name} on {WORK_POOL}, {_runs_as(account)}",
            env=own,
            popen=run_as,
        ),
        Component(
            "relay",
            [
                sys.executable,
                "-m",
                "servers.relay",
                "--host",
                options.relay_host,
                "--port",
                str(options.relay_port),
            ],
            ready=lambda: http_ok(
                f"http://{_loopback(options.relay_host)}:{options.relay_port}/health"
            ),
            where=f"http://{options.relay_host}:{options.relay_port}/events, watching "
            f"{relay_env['RETRAIN_RELAY_WATCH']} (its key: RETRAIN_RELAY_SECRET or "
            f"{shown(state / 'relay-secret')})",
            env=relay_env,
            popen=run_as,
            port=(_loopback(options.relay_host), options.relay_port),
        ),
        Component(
            "gateway",
            [
                sys.executable,
                "-m",
                "cli.models",
                "--config",
                options.config,
                "serve",
                "--host",
                gateway_host,
                "--port",
                str(gateway_port),
            ],
            # Any answer but a server error: an empty output container is a 404, and a
            # request without the credential a 401; both healthy.
            ready=lambda: http_ok(
                f"http://{gateway_netloc}:{gateway_port}/",
                f"{gateway_netloc}:{gateway_port}",
                below=500,
            ),
            where=_gateway_where(config.output.links_url, gateway_netloc, gateway_port)
            + f"; user {GATEWAY_USER}, its password after the colon in {creds_dir}/gateway",
            env={**own, "RETRAIN_GATEWAY_AUTH_STRING": creds.gateway},
            popen=run_as,
            port=(gateway_host, gateway_port),
        ),
    ]


def _private_folders(folders: list[Path]) -> None:
    """The state's data folders, the starting user's alone (mode 0700): blobs, artifacts."""
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)


def _alerts_status(config: PipelineConfig, config_path: str) -> str:
    from deployments.alerts import alerts_status

    return alerts_status(config, config_path)


def _runs_as(account: Account | None) -> str:
    if account is None:
        return "its flow runs as this user (not root)"
    return f"its flow runs as {account.name} (uid {account.uid}), not root"


def image_components(
    config: PipelineConfig, config_path: str, account: Account | None, env: dict[str, str]
) -> list[Component]:
    """On the local target with image.builder buildah, when flow runs do not run as root: the
    training image built as root before the worker starts (buildah's chroot isolation needs
    root) and its registry kept up while the service runs, so a run's build step finds the
    checkout's image there and builds nothing (a change of the code needs a restart)."""
    if account is None or config.target != "local" or config.image.builder != "buildah":
        return []
    log = Path(env[STATE_VARIABLE]) / "logs" / "image.log"
    began = [0]  # the log's length when this start began: earlier starts' lines do not count

    def mark() -> str | None:
        began[0] = log.stat().st_size if log.exists() else 0
        return None

    return [
        Component(
            "image",
            [sys.executable, str(ROOT / "scripts" / "image.py"), "--config", config_path, "--hold"],
            ready=lambda: _logged_since(log, began[0], HOLDING),
            before=mark,
            where=f"the training image in the registry at {config.image.registry}, built as "
            "root for the runs (their account cannot run buildah)",
            env=env,
            timeout=3600,  # a first build of the base and the image: minutes
        )
    ]


HOLDING = "holding the registry"  # what scripts/image.py --hold says once the image is there


def _logged_since(log: Path, offset: int, text: str) -> bool:
    try:
        with log.open("rb") as f:
            f.seek(offset)
            return text.encode() in f.read()
    except OSError:
        return False


def deployments_file(config: str, state: Path) -> Path:
    """prefect.yaml, or for another config than the shipped one a copy in ``state`` whose
    deployments give every run that config (``prefect deploy --all`` ignores ``--param``)."""
    import yaml

    shipped = ROOT / "prefect.yaml"
    if Path(config).resolve() == (ROOT / "configs" / "local.yaml").resolve():
        return shipped
    spec = yaml.safe_load(shipped.read_text())
    for deployment in spec["deployments"]:
        deployment["parameters"] = {**deployment.get("parameters", {}), "config_path": config}
    copy = state / "prefect.yaml"
    state.mkdir(parents=True, exist_ok=True)
    copy.write_text(
        "# Written by python -m deployments.service from prefect.yaml, for "
        f"--config {config}\n" + yaml.safe_dump(spec, sort_keys=False)
    )
    return copy


def tracking_components(
    mlflow_uri: str | None,
    cluster: Cluster,
    state: Path,
    env: dict[str, str],
    creds: Credentials | None = None,
) -> list[Component]:
    """The MLflow server, where the config's ``tracking.mlflow_uri`` is this machine's (its
    runs in the service's PostgreSQL, its artifacts in the state folder), asking for the
    service's credential when ``creds`` are given; none otherwise."""
    from deployments.tracking_server import (
        AUTH_DATABASE,
        DATABASE,
        local_address,
        mlflow_component,
    )

    address = local_address(mlflow_uri)
    if address is None:
        return []
    databases = [DATABASE, *([AUTH_DATABASE] if creds else [])]

    def create() -> str | None:
        made = [name for name in databases if cluster.create_database(name)]
        return f"database{'s' if len(made) > 1 else ''} {', '.join(made)} created" if made else None

    host, port = address
    artifacts = state / "mlflow-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    auth = (
        mlflow_auth_config(state, cluster.sync_url(AUTH_DATABASE), creds.mlflow_password)
        if creds
        else None
    )
    key = creds.mlflow_flask_key if creds else None
    backend = cluster.sync_url(DATABASE)
    return [mlflow_component(host, port, backend, artifacts, env, create, auth, key)]


DEMO_VERSION = "v1"  # the data version scripts/demo.py seeds the digits as (its SEED_VERSION)


def _seeded(config: Any) -> str:
    """What the Azurite component uploads, in words: the demo's digits as data version
    DEMO_VERSION of the shipped local config's data root (scripts/demo.py --serve-storage is
    given no config), and nothing else; the config's own root, when it is another, is named
    as left alone, so nobody takes the digits for their dataset."""
    from core.config import load_config

    demo = load_config(ROOT / "configs" / "local.yaml").data.root
    said = (
        f"the demo's digits uploaded to {demo.container}/{demo.folder(DEMO_VERSION)} "
        f"(data version {DEMO_VERSION} of {demo.where})"
    )
    on_azurite = bool(config.data.connection_string_env)  # the service points it here
    if on_azurite and config.data.root == demo:
        return said
    where = config.data.root.where + ("" if on_azurite else " in its own storage account")
    return (
        f"{said}; the config's data root {where} is left as it is (python -m cli.data upload "
        "puts a folder there: docs/data.md)"
    )


def postgres_component(cluster: Cluster, state: Path | None = None) -> Component:
    """The PostgreSQL server of ``cluster``, its folder and database made on first use; with
    ``state``, a data folder outside it is checked to be that state folder's own first (its
    owner recorded: deployments/postgres.py)."""

    def before() -> str | None:
        notes = []
        if state is not None:
            adopt = (state / WORKERS_FILE).exists() and not (state / ID_FILE).exists()
            notes.append(cluster.claim(state, service_id(state), adopt))
        if cluster.initialise():
            notes.append("new database folder")
        return "; ".join(n for n in notes if n) or None

    return Component(
        "postgres",
        cluster.server_command(),
        ready=cluster.accepting,
        where=_postgres_where(cluster),
        env=cluster.environment(),
        popen=cluster.popen_options(),
        before=before,
        after=lambda: "database prefect created" if cluster.create_database() else None,
        stop_signal=signal.SIGINT,  # a fast shutdown: sessions closed, data flushed
        signal_tree=False,
    )


def _gateway_where(links_url: str | None, netloc: str, port: int) -> str:
    """Where the gateway listens and where the runs' links point: the links come from
    ``output.links_url`` alone, so a --gateway-port that differs from it is said, not hidden."""
    url = f"http://{netloc}:{port}"
    if links_url is None:
        return f"{url}/; output.links_url is unset, so the runs' links point at Blob storage"
    parts = urlsplit(links_url)
    if (parts.scheme, parts.hostname, parts.port or 80) == ("http", netloc.strip("[]"), port):
        return f"the runs' links: {url}/"
    return f"{url}/; the runs' links point at output.links_url, {links_url}"


def _postgres_where(cluster: Cluster) -> str:
    """Where the server keeps its data (its socket is there too), and why when it is not in
    the state folder: the person who removes the state folder must know to remove it too."""
    where = f"data and socket in {shown(cluster.data_dir)}, no port"
    if cluster.in_home:
        where += (
            f" (the {cluster.user} user's own, mode 0700: that user cannot reach the state folder)"
        )
    return where


def prefect_component(
    port: int,
    cluster: Cluster,
    env: dict[str, str],
    creds: Credentials | None = None,
    creds_dir: str = "",
) -> Component:
    """A Prefect server (API and UI) on loopback:``port`` whose database is ``cluster``'s; it
    creates or migrates its tables as it starts; with ``creds``, it asks every request but its
    health check for their auth string (the UI asks for it as its password)."""
    api = f"http://127.0.0.1:{port}/api"
    auth = {"PREFECT_SERVER_API_AUTH_STRING": creds.prefect} if creds else {}
    return Component(
        "prefect",
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        ready=lambda: http_ok(f"{api}/health"),
        where=f"UI http://127.0.0.1:{port}, API {api}, on PostgreSQL"
        + (
            f"; the UI's password and the API's auth string in {creds_dir}/prefect" if creds else ""
        ),
        env={
            **env,
            "PREFECT_API_URL": api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_API_DATABASE_CONNECTION_URL": cluster.url,
            **auth,
        },
        port=("127.0.0.1", port),
        timeout=300,
    )


def _loopback(host: str) -> str:
    """The address to reach a server bound to ``host`` from this machine."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host


def _said(state: Path, name: str, text: str) -> bool:
    try:
        return text in (state / "logs" / f"{name}.log").read_text(errors="replace")
    except OSError:
        return False


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
    partial = state / f"{WORKERS_FILE}.partial"  # replaced whole: never a half-written list
    partial.write_text(json.dumps([*earlier, name][-KEPT_WORKERS:]))
    os.replace(partial, state / WORKERS_FILE)
    return note


def _worker_online(api: str, auth: str | None, name: str) -> bool:
    """Whether the worker named ``name`` has sent its heartbeat to the server."""
    from prefect.exceptions import ObjectNotFound

    try:
        with prefect_client(api, auth) as client:
            workers = client.read_workers_for_work_pool(WORK_POOL)
    except (OSError, ObjectNotFound):
        return False
    return any(w.name == name and w.status.value == "ONLINE" for w in workers)


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


def _hold(state: Path) -> Any:
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
        lock = _hold(state)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m deployments.service",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default="configs/local.yaml", help="the pipeline config")
    p.add_argument("--state", type=Path, default=DEFAULT_STATE, help="data and logs")
    p.add_argument("--azurite-port", type=int, default=10000)
    p.add_argument("--prefect-port", type=int, default=4200)
    p.add_argument(
        "--relay-host",
        default="127.0.0.1",
        help="the relay's address (default loopback: put it behind a TLS proxy)",
    )
    p.add_argument("--relay-port", type=int, default=8080)
    p.add_argument(
        "--gateway-port",
        type=int,
        help="the outputs gateway's (default: output.links_url's when it is this machine's, "
        "else 4280); the runs' links follow output.links_url, so set it to the same port",
    )
    p.add_argument(
        "--user",
        help="started as root: the existing unprivileged account the worker (and so every flow "
        "run), the relay and the gateway run as (default: retrain-<digest of the state "
        "folder>, made as a system account)",
    )
    p.add_argument(
        "--clean",
        action="store_true",
        help="start nothing: remove the service of --state (its database, below the postgres "
        "user's home too, the access its account was given, the state folder)",
    )
    p.add_argument(
        "--cancel-runs",
        action="store_true",
        help="start nothing: cancel the runs in progress on the retrain-workers pool of the "
        "server PREFECT_API_URL names, and wait for them to end (their pools released); for a "
        "worker's service unit to run before it is stopped (README)",
    )
    args = p.parse_args(argv)

    def say(line: str) -> None:
        print(line, flush=True)

    if args.cancel_runs:
        from prefect.settings import PREFECT_API_URL

        if not PREFECT_API_URL.value():
            p.error("--cancel-runs needs PREFECT_API_URL: the server the worker serves")
        print(cancel_runs(None) or "no run in progress", flush=True)
        return 0
    state = args.state.resolve()
    if args.clean:
        return clean(state, say)
    options = Options(
        args.config,
        state,
        args.azurite_port,
        args.prefect_port,
        args.relay_host,
        args.relay_port,
        args.gateway_port,
        args.user,
    )
    logs = state / "logs"
    from deployments.supervisor import ServiceError

    say(f"starting the service; data in {shown(state)}, logs in {shown(logs)}")
    try:
        lock = _hold(state)
    except ServiceError as exc:
        say(f"error: {exc}")
        return 1
    logs.mkdir(parents=True, exist_ok=True)
    logs.chmod(0o700)
    written: list[Path] = []

    def make() -> list[Component]:
        account = prepare(options, say)
        built = components(options, account)
        written.extend(client_files(options, account, say))
        return built

    where = (
        f"this checkout's commands reach it through {ENV_FILE}"
        if state == DEFAULT_STATE
        else f"to reach it from a shell: set -a; . {shown(state / CLIENT_FILE)}; set +a"
    )
    running = (
        f"the service is running: UI http://127.0.0.1:{options.prefect_port} (its password in "
        f"{shown(state / 'credentials' / 'prefect')}; every credential in "
        f"{shown(state / 'credentials')}, readable by this user alone); {where}. Ctrl-C stops "
        "everything."
    )
    try:
        return supervise(make, logs, running, say)
    finally:
        for path in written:
            if written_by_service(path):
                path.unlink(missing_ok=True)
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
