"""``--config`` and ``--set``: how every command that reads a pipeline config is given one
(``python -m flows.retrain``, ``cli.models``, ``cli.data``, ``scripts/demo.py``), with one
spelling, one meaning and one way to load the result, so a person learns them once. Each of them
also reaches the service ``make service`` runs from this checkout, when one does: its addresses
and credentials are read from the checkout's ``.env`` (core/service_env.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from core.config import PipelineConfig, load_config
from core.service_env import load_service_settings

SET_HELP = (
    "override one config value (repeatable); a text field takes the value as typed, numbers, "
    "booleans and lists are read as YAML, null clears an optional field"
)


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config_help: str = "a YAML file, e.g. configs/local.yaml",
    default: Path | None = None,
) -> None:
    """``--config FILE`` (required unless ``default`` names one) and ``--set SECTION.FIELD=VALUE``
    (repeatable, applied in order after the file); the settings of this checkout's service, when
    it runs, under those of the environment."""
    load_service_settings()
    parser.add_argument(
        "--config", required=default is None, default=default, type=Path, help=config_help
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help=SET_HELP
    )


def config_from(args: argparse.Namespace) -> PipelineConfig:
    """The config the options name: the file, then each ``--set``; ConfigError names the field
    and where its value came from."""
    return load_config(args.config, args.set)
