"""A real MLflow tracking server for the tracking tests, started as `make service` starts its
own (deployments/tracking_server.py), on a SQLite backend store in the test's folder."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from backends.ports import free_port


@contextlib.contextmanager
def mlflow_server(state: Path) -> Iterator[str]:
    """``mlflow server`` on a free loopback port until the block ends; yields its URI."""
    from deployments.supervisor import Supervisor
    from deployments.tracking_server import mlflow_component

    port = free_port()
    artifacts = state / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(state / "logs", say=lambda line: None)
    component = mlflow_component(
        "127.0.0.1", port, f"sqlite:///{state / 'mlflow.db'}", artifacts, dict(os.environ)
    )
    try:
        supervisor.start(component)
        yield f"http://127.0.0.1:{port}"
    finally:
        supervisor.stop()
