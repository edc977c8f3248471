"""The config the deployments are registered with: a build step of prefect.yaml.

``prefect deploy`` runs this step before it registers each deployment, and prefect.yaml gives
its result to every deployment as ``config_path``. So ``RETRAIN_FORM_CONFIG=configs/azure.yaml
prefect deploy --all`` (what ``make service --config`` and ``make azure-up`` do) registers
deployments whose runs, scheduled ones included, train that file; without it they train
``configs/local.yaml``. The file is loaded here first, so a missing or invalid config stops the
registration with the config's own message instead of failing every run later.
"""

from __future__ import annotations

import os
from pathlib import Path

from core.config import load_config

ROOT = Path(__file__).resolve().parents[1]
ENV = "RETRAIN_FORM_CONFIG"  # also the run form's defaults (flows/form.py)
DEFAULT = "configs/local.yaml"


def registered_config_path(environ: dict[str, str] | None = None) -> str:
    """The config path the deployments carry: the file named by ``RETRAIN_FORM_CONFIG`` (a
    project file as a path relative to the project, which the worker's checkout resolves), or
    ``configs/local.yaml``."""
    given = (environ if environ is not None else dict(os.environ)).get(ENV) or DEFAULT
    path = Path(given) if Path(given).is_absolute() else ROOT / given
    load_config(path)  # ConfigError names the file and the field
    resolved = path.resolve()
    if resolved.is_relative_to(ROOT):
        return resolved.relative_to(ROOT).as_posix()
    return str(resolved)


def registered_config() -> dict[str, str]:
    """The build step: its output ``config_path`` is templated into every deployment."""
    return {"config_path": registered_config_path()}
