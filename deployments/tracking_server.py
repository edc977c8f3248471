"""The MLflow tracking server of ``make service``: one more component of the service.

It listens where the config's ``tracking.mlflow_uri`` says when that is this machine's loopback
(``http://127.0.0.1:5000`` in configs/local.yaml), so the runs the service's worker executes log
to it; a config that tracks elsewhere (another server, an Azure ML workspace) or not at all gets
no server. Its runs and registered models are kept in the service's PostgreSQL (a database of
their own, ``mlflow``), its artifacts under the state folder; the server proxies artifact
uploads and downloads (``--serve-artifacts``), so clients need no access to that folder.

The service's server asks for a credential: MLflow's basic-auth app (``--app-name basic-auth``),
its users kept in the same PostgreSQL (database ``mlflow_auth``), one user, ``admin``, whose
password is generated into the service's credentials (deployments/credentials.py); the app's
configuration file, which holds it, reaches the server by ``MLFLOW_AUTH_CONFIG_PATH`` and its
clients present ``MLFLOW_TRACKING_USERNAME`` and ``MLFLOW_TRACKING_PASSWORD``. A request without
them is answered 401, whatever it asks (only ``/health`` and the UI's static files are open).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

from core.mlflow_env import TELEMETRY_OFF
from deployments.supervisor import Component, http_ok

BIN = Path(sys.executable).parent
DATABASE = "mlflow"
AUTH_DATABASE = "mlflow_auth"  # the basic-auth app's users
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def local_address(mlflow_uri: str | None) -> tuple[str, int] | None:
    """Where a server for ``mlflow_uri`` listens on this machine; None when the URI is not a
    loopback http address (no tracking, or a server that is not the service's)."""
    if not mlflow_uri:
        return None
    parts = urlsplit(mlflow_uri)
    if parts.scheme != "http" or parts.hostname not in LOOPBACK or parts.path.strip("/"):
        return None
    return parts.hostname or "127.0.0.1", parts.port or 80


def server_command(
    host: str, port: int, backend_uri: str, artifacts: Path, auth: bool = False
) -> list[str]:
    """``mlflow server`` with one worker process (the service's few runs need no more, and
    each worker costs seconds of start-up and its own memory); with ``auth``, its basic-auth
    app (its configuration from ``MLFLOW_AUTH_CONFIG_PATH``)."""
    return [
        str(BIN / "mlflow"),
        "server",
        *(["--app-name", "basic-auth"] if auth else []),
        "--backend-store-uri",
        backend_uri,
        "--artifacts-destination",
        str(artifacts),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]


def mlflow_component(
    host: str,
    port: int,
    backend_uri: str,
    artifacts: Path,
    env: dict[str, str],
    before: Callable[[], str | None] | None = None,
    auth_config: Path | None = None,
    flask_key: str | None = None,
) -> Component:
    """The server as a supervised component, ready once its health check answers; ``before``
    is its set-up (the databases' creation); with ``auth_config``, it asks for the credential
    that file configures. MLflow's job runner (its GenAI jobs: a process pool of its own) is
    not started: nothing here submits jobs; nor is its telemetry (``core.mlflow_env``)."""
    netloc = f"[{host}]" if ":" in host else host
    where = f"http://{netloc}:{port}, runs in {describe(backend_uri)}, artifacts in {artifacts}"
    extra = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    if auth_config is not None:
        extra["MLFLOW_AUTH_CONFIG_PATH"] = str(auth_config)
        extra["MLFLOW_FLASK_SERVER_SECRET_KEY"] = flask_key or ""
        where += f"; user admin, its password in {auth_config.with_name('mlflow')}"
    return Component(
        "mlflow",
        server_command(host, port, backend_uri, artifacts, auth=auth_config is not None),
        ready=lambda: http_ok(f"http://{netloc}:{port}/health"),
        where=where,
        env={**env, **extra, **TELEMETRY_OFF},
        before=before,
        port=(host, port),
        timeout=300,
    )


def describe(backend_uri: str) -> str:
    """The backend store as the status line names it (no query: a socket path is long)."""
    scheme = backend_uri.split(":", 1)[0]
    return "PostgreSQL" if scheme.startswith("postgresql") else scheme


@contextlib.contextmanager
def running_mlflow(state: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """An MLflow server of its own on a free loopback port, its SQLite store and artifacts in
    ``state``, until the block ends; yields its URI (the tests' and the benchmark's)."""
    from backends.local.ports import free_port
    from deployments.supervisor import Supervisor

    port = free_port()
    artifacts = state / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(state / "logs", say=lambda line: None)
    backend = f"sqlite:///{state / 'mlflow.db'}"
    try:
        supervisor.start(
            mlflow_component("127.0.0.1", port, backend, artifacts, env or dict(os.environ))
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        supervisor.stop()
