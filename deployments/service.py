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
import os
import secrets
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from core.service_env import ENV_FILE, written_by_service
from deployments.account import Account
from deployments.credentials import CLIENT_FILE, GATEWAY_USER, Credentials, mlflow_auth_config
from deployments.service_runs import WORKERS_FILE, cancel_runs, start_worker, worker_online
from deployments.service_state import (
    DEFAULT_STATE,
    ID_FILE,
    Options,
    clean,
    client_files,
    client_settings,
    hold,
    prepare,
    service_id,
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
    from core.config import PipelineConfig
    from deployments.postgres import Cluster

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


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
            ready=lambda: worker_online(api, creds.prefect, worker_name),
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
        lock = hold(state)
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
