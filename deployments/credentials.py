"""The service's credentials: generated on its first start into ``<state>/credentials/`` (the
folder mode 0700, each file 0600, root's or the starting user's alone), the same at every start.

- ``prefect``: the Prefect API's auth string (``PREFECT_SERVER_API_AUTH_STRING`` on the server,
  ``PREFECT_API_AUTH_STRING`` on its clients; the UI asks for it as its password);
- ``mlflow``: the password of MLflow's ``admin`` user (its basic-auth app), and
  ``mlflow-auth.ini``, that app's configuration (where its users are kept, the admin's password);
  ``mlflow-flask-key``, the key its Flask app signs its CSRF tokens with;
- ``gateway``: ``user:password`` of the outputs gateway (HTTP basic auth, as a browser asks);
- ``storage-key``: the key of the account of the service's Azurite (``AZURITE_ACCOUNTS``), so
  the emulator's published key opens nothing there.

They reach the components through their environment or these files, never a command line, and
no status line or log prints them: the status lines say where they are. The settings a client
of this checkout needs (addresses, and the credentials of the API it calls) are written to
``<state>/client.env`` and, for a service on the checkout's own state folder, to the checkout's
``.env`` (core/service_env.py), which Prefect's settings and the checkout's commands read.
"""

from __future__ import annotations

import base64
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

FOLDER = "credentials"
CLIENT_FILE = "client.env"  # in the state folder
GATEWAY_USER = "retrain"
MLFLOW_USER = "admin"  # the basic-auth app's admin, the one user it has


def secret_file(state: Path, name: str, make: str) -> str:
    """The content of ``<state>/credentials/<name>``, written as ``make`` when missing (created
    exclusively with mode 0600: never readable by anyone else, even for an instant)."""
    folder = state / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    path = folder / name
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as out:
        out.write(make + "\n")
    return make


def private_file(path: Path, text: str, mode: int = 0o600) -> None:
    """``path`` holding ``text``, with ``mode`` from its first byte on (replaced whole)."""
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(partial, path)


@dataclass(frozen=True)
class Credentials:
    """What the service's components ask for and its clients present."""

    prefect: str
    mlflow_password: str
    mlflow_flask_key: str  # MLFLOW_FLASK_SERVER_SECRET_KEY: the auth app's CSRF tokens
    gateway: str  # user:password
    storage_key: str  # base64, as Azure account keys are written

    @classmethod
    def of(cls, state: Path) -> Credentials:
        return cls(
            prefect=secret_file(state, "prefect", f"retrain:{secrets.token_urlsafe(32)}"),
            mlflow_password=secret_file(state, "mlflow", secrets.token_urlsafe(32)),
            mlflow_flask_key=secret_file(state, "mlflow-flask-key", secrets.token_urlsafe(32)),
            gateway=secret_file(state, "gateway", f"{GATEWAY_USER}:{secrets.token_urlsafe(24)}"),
            storage_key=secret_file(
                state, "storage-key", base64.b64encode(secrets.token_bytes(64)).decode()
            ),
        )


def folder(state: Path) -> Path:
    return state / FOLDER


def mlflow_auth_config(state: Path, database_uri: str, password: str) -> Path:
    """MLflow's basic-auth configuration (``MLFLOW_AUTH_CONFIG_PATH``): its users in
    ``database_uri``, its admin's password, nobody else's default access beyond what an
    authenticated user reads. Rewritten at every start (the password is read only when the
    admin user is first made)."""
    path = folder(state) / "mlflow-auth.ini"
    private_file(
        path,
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = {database_uri}\n"
        f"admin_username = {MLFLOW_USER}\n"
        f"admin_password = {password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
    )
    return path
