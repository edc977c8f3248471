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
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from common.atomic import atomic_write_json
from deployments.setup import WORK_POOL
from deployments.supervisor import Component, http_ok, port_in_use, shown, supervise

if TYPE_CHECKING:
    from deployments.postgres import Cluster

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORKERS_FILE = "workers.json"  # in the state folder: the workers the last starts ran
KEPT_WORKERS = 10


@dataclass(frozen=True)
class Options:
    config: str
    state: Path
    azurite_port: int
    prefect_port: int
    relay_host: str
    relay_port: int
    gateway_port: int | None = None  # None: output.links_url's when loopback, else 4280


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


def components(options: Options) -> list[Component]:
    """The service, in start order."""
    from backends.local.azurite import connection_string
    from core.config import load_config
    from core.links import listen_address
    from deployments.postgres import Cluster

    config = load_config(options.config)
    state = options.state
    api = f"http://127.0.0.1:{options.prefect_port}/api"
    storage = (
        "UseDevelopmentStorage=true"
        if options.azurite_port == 10000
        else connection_string(options.azurite_port)
    )
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "PWD": str(ROOT),  # prefect.yaml's pull step: flows run from this checkout
        "PREFECT_HOME": str(state / "prefect"),  # not ~/.prefect: the command line's own
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    for variable in {config.data.connection_string_env, config.output.connection_string_env}:
        if variable:
            env[variable] = storage
    postgres = Cluster.at(state / "postgres")
    worker_name = f"service-{socket.gethostname()}-{os.getpid()}"
    gateway_host, gateway_port = listen_address(config.output.links_url, None, options.gateway_port)
    gateway_netloc = f"[{gateway_host}]" if ":" in gateway_host else gateway_host
    relay_env = {
        **env,
        "RETRAIN_RELAY_WATCH": os.environ.get("RETRAIN_RELAY_WATCH")
        or f"{config.data.container}/{config.data.prefix}".rstrip("/"),
        "RETRAIN_RELAY_SECRET": relay_secret(state),
    }
    deploy = [str(BIN / "prefect"), "--no-prompt", "deploy", "--all"]
    deploy += ["--prefect-file", str(deployments_file(options.config, state))]
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
            where=f"Blob on 127.0.0.1:{options.azurite_port}, {_seeded(config)}",
            env=env,
            port=("127.0.0.1", options.azurite_port),
            timeout=300,
        ),
        postgres_component(postgres),
        prefect_component(options.prefect_port, postgres, env),
        *tracking_components(config.tracking.mlflow_uri, postgres, state, env),
        Component(
            "pool",
            [sys.executable, "-m", "deployments.setup", "--config", options.config],
            where=f"work pool {WORK_POOL}, the pool's concurrency limit",
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
        Component(
            "worker",
            [str(BIN / "prefect"), "worker", "start", "--pool", WORK_POOL, "--name", worker_name],
            ready=lambda: _worker_online(api, worker_name),
            before=lambda: start_worker(api, state, worker_name),
            before_stop=lambda: cancel_runs(api),
            where=f"{worker_name} on {WORK_POOL}",
            env=env,
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
            # Any answer but a server error: an empty output container is a 404, and healthy.
            ready=lambda: http_ok(
                f"http://{gateway_netloc}:{gateway_port}/",
                f"{gateway_netloc}:{gateway_port}",
                below=500,
            ),
            where=_gateway_where(config.output.links_url, gateway_netloc, gateway_port),
            env=env,
            port=(gateway_host, gateway_port),
        ),
    ]


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
    mlflow_uri: str | None, cluster: Cluster, state: Path, env: dict[str, str]
) -> list[Component]:
    """The MLflow server, where the config's ``tracking.mlflow_uri`` is this machine's (its
    runs in the service's PostgreSQL, its artifacts in the state folder); none otherwise."""
    from deployments.tracking_server import DATABASE, local_address, mlflow_component

    address = local_address(mlflow_uri)
    if address is None:
        return []

    def create() -> str | None:
        return f"database {DATABASE} created" if cluster.create_database(DATABASE) else None

    host, port = address
    artifacts = state / "mlflow-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    return [mlflow_component(host, port, cluster.sync_url(DATABASE), artifacts, env, create)]


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


def postgres_component(cluster: Cluster) -> Component:
    """The PostgreSQL server of ``cluster``, its folder and database made on first use."""
    return Component(
        "postgres",
        cluster.server_command(),
        ready=cluster.accepting,
        where=_postgres_where(cluster),
        env=cluster.environment(),
        popen=cluster.popen_options(),
        before=lambda: "new database folder" if cluster.initialise() else None,
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


def prefect_component(port: int, cluster: Cluster, env: dict[str, str]) -> Component:
    """A Prefect server (API and UI) on loopback:``port`` whose database is ``cluster``'s; it
    creates or migrates its tables as it starts."""
    api = f"http://127.0.0.1:{port}/api"
    return Component(
        "prefect",
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        ready=lambda: http_ok(f"{api}/health"),
        where=f"UI http://127.0.0.1:{port}, API {api}, on PostgreSQL",
        env={
            **env,
            "PREFECT_API_URL": api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_API_DATABASE_CONNECTION_URL": cluster.url,
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


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        data = response.read()
    return json.loads(data) if data else None


_ACTIVE = {"any_": ["RUNNING", "PENDING", "CANCELLING"]}


def _active_runs(api: str, pool: str) -> list[dict[str, Any]]:
    query = {"flow_runs": {"state": {"type": _ACTIVE}}, "work_pools": {"name": {"any_": [pool]}}}
    return list(_post(f"{api}/flow_runs/filter", query) or [])


def cancel_runs(api: str, pool: str = WORK_POOL, seconds: float = 90.0) -> str | None:
    """Cancel the flow runs in progress on ``pool`` and wait for them to end: a run cancelled
    through the API stops its tasks and releases its pool (its cancellation hook), where a
    signal would leave the pool held and the run marked running for good (and its deployment,
    one run at a time, blocked). What it did, for the status line; None when nothing ran."""
    runs = _active_runs(api, pool)
    if not runs:
        return None
    for flow_run in runs:
        if flow_run["state"]["type"] != "CANCELLING":
            _post(
                f"{api}/flow_runs/{flow_run['id']}/set_state",
                {"state": {"type": "CANCELLING", "message": "the service is stopping"}},
            )
    deadline = time.monotonic() + seconds
    left = runs
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = _active_runs(api, pool)
    still = f", {len(left)} still running after {seconds:.0f} s" if left else ""
    return f"cancelled {len(runs)} run{'s' if len(runs) > 1 else ''} in progress{still}"


def crash_orphans(api: str, pool: str = WORK_POOL, ours: Collection[str] = ()) -> str | None:
    """Before the service's worker starts: runs still marked in progress on ``pool`` were left
    by a service that did not stop cleanly (killed, power lost); their processes are gone, and
    each holds its deployment's only slot. They are marked crashed (which frees the slot),
    unless a worker other than the service's earlier ones (``ours``, by name) is online on the
    pool: then they may be its. An earlier worker of this service is dead whatever its last
    heartbeat says (the server calls a worker online for 90 s after it)."""
    workers = _post(f"{api}/work_pools/{pool}/workers/filter", {}) or []
    if any(w.get("status") == "ONLINE" and w.get("name") not in ours for w in workers):
        return None
    runs = _active_runs(api, pool)
    for flow_run in runs:
        _post(
            f"{api}/flow_runs/{flow_run['id']}/set_state",
            {
                "state": {
                    "type": "CRASHED",
                    "message": "left in progress by a service that did not stop cleanly",
                },
                "force": True,
            },
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


def start_worker(api: str, state: Path, name: str, pool: str = WORK_POOL) -> str | None:
    """Before the worker starts: the runs the earlier workers left are crashed, and this one is
    recorded as the service's. Only one service runs on a state folder (its PostgreSQL data),
    so every worker recorded there is dead when the next one starts; the last few are kept
    (a start that crashed nothing, another worker being online, tries again next time)."""
    earlier = earlier_workers(state)
    note = crash_orphans(api, pool, ours=earlier)
    state.mkdir(parents=True, exist_ok=True)
    # Replaced whole: never a half-written list.
    atomic_write_json([*earlier, name][-KEPT_WORKERS:], state / WORKERS_FILE)
    return note


def _worker_online(api: str, name: str) -> bool:
    """Whether the worker named ``name`` has sent its heartbeat to the server."""

    try:
        workers = _post(f"{api}/work_pools/{WORK_POOL}/workers/filter", {})
    except (OSError, ValueError):
        return False
    return any(w.get("name") == name and w.get("status") == "ONLINE" for w in workers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m deployments.service",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default="configs/local.yaml", help="the pipeline config")
    p.add_argument("--state", type=Path, default=ROOT / ".service", help="data and logs")
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
        "--cancel-runs",
        action="store_true",
        help="start nothing: cancel the runs in progress on the retrain-workers pool of the "
        "server PREFECT_API_URL names, and wait for them to end (their pools released); for a "
        "worker's service unit to run before it is stopped (README)",
    )
    args = p.parse_args(argv)
    if args.cancel_runs:
        from prefect.settings import PREFECT_API_URL

        api = PREFECT_API_URL.value()
        if not api:
            p.error("--cancel-runs needs PREFECT_API_URL: the server the worker serves")
        print(cancel_runs(str(api).rstrip("/")) or "no run in progress", flush=True)
        return 0
    options = Options(
        args.config,
        args.state.resolve(),
        args.azurite_port,
        args.prefect_port,
        args.relay_host,
        args.relay_port,
        args.gateway_port,
    )
    logs = options.state / "logs"

    def say(line: str) -> None:
        print(line, flush=True)

    say(f"starting the service; data in {shown(options.state)}, logs in {shown(logs)}")
    running = (
        f"the service is running: UI http://127.0.0.1:{options.prefect_port}; in another "
        f"terminal, export PREFECT_API_URL=http://127.0.0.1:{options.prefect_port}/api to use "
        "it from the command line. Ctrl-C stops everything."
    )
    return supervise(lambda: components(options), logs, running, say)


if __name__ == "__main__":
    sys.exit(main())
