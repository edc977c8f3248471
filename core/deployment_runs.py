"""What a run started through a deployment may change of its deployment's config.

Whoever can start a run (the UI form, ``prefect deployment run``, a schedule, an event that a
trigger turns into a run) is not whoever wrote the deployment's config. Such a run executes on
the worker, with the worker's credentials: were it free to set ``data.account_url`` with no
connection string, the worker would present its managed identity's token to any host; with
``image.registry``, the nodes would run another image; with ``work_dir`` or ``nfs.local_dir``,
write anywhere the worker may. So a deployment's run may change only what it trains and how it
learns (:data:`RUN_FIELDS`); everything else (endpoints, identities, credentials, the image, the
pool, the worker's paths, retries, the gate's and the promotion's rules) comes from the
deployment's config file, the one place it changes. Its config file is the deployment's own
``config_path``, or another file of the project's ``configs/`` folder (files the worker's
operator put there), never any path a person types.

A run from the command line (``python -m flows.retrain --config X --set ...``) is not restricted:
whoever runs it has the config file and the credentials on their own machine already.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.config import ConfigError, PipelineConfig, load_config

# The training settings (every field of the trainer's section, its extra arguments checked by
# the config itself) and which data: the new-data trigger names the data root and the version.
RUN_FIELDS = ("training", "data.container", "data.prefix", "data.version")
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"


def deployment_config_path(deployment_id: Any) -> str | None:
    """The ``config_path`` a deployment gives every run it starts (None outside deployments).
    Prefect merges it into each run's parameters, so only this tells it from a chosen one."""
    if not deployment_id:
        return None
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        value = client.read_deployment(deployment_id).parameters.get("config_path")
    return str(value) if value is not None else None


def check_config_path(chosen: str, default: str | None) -> None:
    """A deployment's run reads the deployment's config file or one in ``configs/``; any other
    path (a file someone else could write, a test's fixture) is refused."""
    if chosen == default:
        return
    if not Path(chosen).resolve().is_relative_to(CONFIGS_DIR.resolve()):
        raise ConfigError(
            f"config_path {chosen}: a run started through a deployment reads the deployment's "
            f"config file ({default}) or one in the project's configs/ folder on the worker"
        )


def _flat(tree: dict[str, Any], parent: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{parent}{key}"
        if isinstance(value, dict):
            flat.update(_flat(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _run_may_change(field: str) -> bool:
    return any(field == f or field.startswith(f"{f}.") for f in RUN_FIELDS)


def changed_beyond_run_fields(base: PipelineConfig, config: PipelineConfig) -> list[str]:
    """The fields of ``config`` outside :data:`RUN_FIELDS` whose values differ from ``base``."""
    before, after = _flat(base.model_dump(mode="json")), _flat(config.model_dump(mode="json"))
    return sorted(
        name
        for name in before.keys() | after.keys()
        if not _run_may_change(name) and before.get(name) != after.get(name)
    )


def check_run_config(config: PipelineConfig, config_file: str) -> None:
    """Refuse a deployment's run whose config differs from its deployment's config file
    (``config_file``) beyond :data:`RUN_FIELDS`, naming the fields (never their values: a
    value given there may be a token)."""
    changed = changed_beyond_run_fields(load_config(config_file), config)
    if changed:
        allowed = ", ".join(f"{f}.*" if "." not in f else f for f in RUN_FIELDS)
        raise ConfigError(
            f"a run started through a deployment may change only {allowed}; it changed "
            f"{', '.join(changed)}. Endpoints, identities, credentials, the image, the pool "
            f"and the worker's paths come from the deployment's config file {config_file}: "
            "change them there"
        )
