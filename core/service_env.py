"""Where the checkout's own commands find the service ``make service`` runs from it: the
checkout's ``.env``, which the service writes while it runs (mode 0600) and removes when it
stops.

Prefect's settings read a ``.env`` in the working folder (its ``PREFECT_*`` lines), so
``prefect deployment run`` typed in the checkout reaches the service with its credential; the
checkout's commands (``python -m flows.retrain``, ``cli.models``, ``cli.data``, the demo) load
the rest of it (MLflow's credentials, the storage connection string) through
``load_service_settings``, under what the environment already sets. Only a file the service
wrote is read (its first line says so): a ``.env`` of the person's own is left alone, and a
checkout without one (another checkout, on the same machine) finds nothing, so its runs cannot
land in this service by accident.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_FILE = ".env"
MARK = "# Written by make service (python -m deployments.service)"


def env_text(settings: Mapping[str, str], where: str) -> str:
    """A ``.env`` holding ``settings``: one ``NAME='value'`` a line, after the mark."""
    lines = [f"{MARK} for the service of {where}; removed when it stops."]
    for name, value in settings.items():
        if "'" in value or "\n" in value:
            raise ValueError(f"{name}: a value with a quote or a line break")
        lines.append(f"{name}='{value}'")
    return "\n".join(lines) + "\n"


def written_by_service(path: Path) -> bool:
    """Whether ``path`` is a ``.env`` the service wrote (a person's own is never touched)."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return f.readline().startswith(MARK)
    except OSError:
        return False


def load_service_settings(root: Path = ROOT) -> dict[str, str]:
    """The settings of the service running from ``root`` into this process's environment,
    where the environment does not set them already; those added (for tests: never their
    values in a message). Nothing when no service of this checkout runs."""
    path = root / ENV_FILE
    if not written_by_service(path):
        return {}
    from dotenv import dotenv_values

    added = {}
    for name, value in dotenv_values(path).items():
        if value is not None and name not in os.environ:
            os.environ[name] = value
            added[name] = value
    return added
