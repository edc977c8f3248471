"""A run's config, built in one place from what the run was asked, then frozen.

Every way of starting a run (the command line, the UI form, a schedule, the new-data trigger, the
crash hook that releases the pool) describes it as a :class:`RunRequest`, and
:func:`build_run_config` turns that into the one config every step reads, with the order of
precedence written once: the file or the form's whole config, then ``--set`` overrides, then the
run's own fields. The result says where its values came from, for the run's log and summary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.config import ConfigError, PipelineConfig, hide_credentials, load_config
from core.deployment_runs import check_config_path, check_run_config


@dataclass(frozen=True)
class RunRequest:
    """What a run is asked to train with: the retrain flow's parameters, typed.

    ``config`` is the form's advanced section (the whole config) or a model made in code;
    ``config_path`` a YAML file; the fields below them are the form's first fields and what a
    new-data trigger fills in from its event.
    """

    config: PipelineConfig | Mapping[str, Any] | None = None
    config_path: str | None = None
    overrides: tuple[str, ...] = ()
    epochs: int | None = None
    model: str | None = None
    data_container: str | None = None
    data_prefix: str | None = None
    data_version: str | None = None

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> RunRequest:
        """The request a flow run's stored parameters describe (the crash hook reads them)."""
        return cls(
            config=params.get("config"),
            config_path=params.get("config_path"),
            overrides=tuple(params.get("overrides") or ()),
            epochs=params.get("epochs"),
            model=params.get("model"),
            data_container=params.get("data_container"),
            data_prefix=params.get("data_prefix"),
            data_version=params.get("data_version"),
        )

    def run_fields(self) -> dict[str, Any]:
        """The run's own fields, as the config fields they set. Left empty, a field keeps the
        config's value; an empty data version is what a trigger's template gives for a root
        without versions, and an empty container is no container."""
        fields: dict[str, Any] = {}
        if self.epochs is not None:
            fields["training.epochs"] = self.epochs
        if self.model not in (None, ""):
            fields["training.model"] = self.model
        if self.data_version not in (None, ""):
            fields["data.version"] = self.data_version
        if self.data_container:
            fields["data.container"] = self.data_container
        if self.data_prefix is not None:
            fields["data.prefix"] = self.data_prefix
        return fields


@dataclass(frozen=True)
class RunConfig:
    """The config a run trains with, and where its values came from (the run's summary shows
    both, so nobody has to guess which of the form, the file or an override won)."""

    config: PipelineConfig
    source: str
    notes: tuple[str, ...] = field(default=())
    base: str = "the config"  # where the values no override sets came from (the file, the form)


def build_run_config(
    request: RunRequest, *, deployment_path: str | None = None, deployed: bool = False
) -> RunConfig:
    """The one config a run reads, from ``request``:

    - a ``config`` (the run form, or a model from code) is used whole, and the deployment's
      default ``config_path`` (``deployment_path``, which every run of a deployment inherits
      whether or not the person starting it saw it) does not replace it;
    - a ``config`` together with a ``config_path`` chosen for this run is an error: which of
      the two the person meant is not knowable, and silently picking one trains the other;
    - otherwise the YAML file at ``config_path``;
    then the ``overrides`` (``section.field=value``), then the run's own fields
    (:meth:`RunRequest.run_fields`), set on their fields as given.

    ``deployed``: the run was started through a deployment (the form, a schedule, a trigger):
    it may change only the training settings and which data it trains
    (``core.deployment_runs``), and reads its deployment's config file or one in ``configs/``.
    """
    config, config_path = request.config, request.config_path
    if config is not None and config_path is not None and config_path != deployment_path:
        raise ConfigError(
            f"the run has both a config and config_path {config_path}: give one of them "
            "(the config form, or a file)"
        )
    overrides, fields = list(request.overrides), request.run_fields()
    # As shown in the run's log and summary: a token pasted into a value is not repeated.
    notes = tuple(
        [hide_credentials(f"--set {o}") for o in overrides]
        + [hide_credentials(f"{k}={v}") for k, v in fields.items()]
    )
    if config is not None:
        source = "the run's config parameter (the form)"
        if config_path is not None:
            source += f"; the deployment's default config_path {config_path} is not used"
        if isinstance(config, PipelineConfig) and not notes:
            built = config
        else:
            base = config.model_dump(mode="json") if isinstance(config, PipelineConfig) else config
            built = load_config(None, overrides, base=dict(base), fields=fields)
        compared = deployment_path
    elif config_path is not None:
        if deployed:
            check_config_path(config_path, deployment_path)
        source = f"the config file {config_path}"
        built = load_config(config_path, overrides, fields=fields)
        compared = config_path
    else:
        raise ConfigError("retrain needs a config or a config_path")
    if deployed:
        if compared is None:
            raise ConfigError(
                "this deployment names no config_path: a run's config parameter can only be "
                "checked against the deployment's config file"
            )
        check_run_config(built, compared)
    return RunConfig(built, "; ".join([source, *notes]), notes, source.split("; ", 1)[0])
