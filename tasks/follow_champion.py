"""Between the data gate and ``resolve-init-from``: a retrain of the champion takes its recipe.

With ``training.follow_champion`` (the nightly and on-new-data deployments set it), a run whose
data root has a champion trains from the champion's weights with the settings the champion was
trained with, except those the run sets itself (``core/recipe.py`` decides, field by field).
Without it, a champion trained by hand with a better recipe is never beaten by the config's
defaults, and nothing would say why. The recipe is read from a blob anyone with write access to
the output container may edit: every value it gives is checked as a run's own would be, and one
out of bounds stops the run here, before a pool is provisioned or data staged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prefect import get_run_logger
from pydantic import ValidationError

from backends.blob import container_client
from core.config import PipelineConfig
from core.recipe import Origin, Recipe, RecipeError, describe, training_settings
from core.run import Run
from registry.champion import champion_for
from tasks.init_from import InitFromConfigError, champion_metrics
from tasks.steps import Done, step


@dataclass(frozen=True)
class Followed:
    """The run's config with the recipe applied, and where each training setting came from."""

    config: PipelineConfig
    origins: list[Origin]
    champion_run: str | None
    champion_epochs: int | None = None  # the epochs the champion's own training ran


def follow(
    config: PipelineConfig, explicit: Mapping[str, str], config_source: str = "the config"
) -> Followed:
    """The recipe of the champion of the run's data root applied to ``config`` (unchanged
    settings and a from-scratch start while the root has no champion); ``explicit``: the
    training fields the run sets itself, each with where it set it
    (``core.recipe.explicit_training_fields``)."""
    outputs = container_client(config.output, config.retries.storage_retries)
    read = champion_for(outputs, config.output.prefix, config.data.root)
    if read.damaged:
        raise InitFromConfigError(
            f"follow_champion: the champion record of data root {config.data.root.where} "
            f"({read.blob}) is damaged ({read.damaged})"
        )
    recipe = None
    if read.champion is not None:
        recipe = Recipe.from_metrics(read.champion.run_id, champion_metrics(outputs, read.champion))
    try:
        training, origins = training_settings(config.training, explicit, recipe, config_source)
    except RecipeError as exc:
        raise InitFromConfigError(f"follow_champion: {exc}") from None
    run_id = read.champion.run_id if read.champion else None
    followed = config.model_copy(update={"training": training})
    # The config a run of these settings would have been given, checked as any run's is.
    try:
        checked = PipelineConfig.model_validate(followed.model_dump())
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_input=False)
        )
        raise InitFromConfigError(
            f"follow_champion: the champion's recipe (run {run_id}) makes a config no run may "
            f"have: {problems}"
        ) from None
    trained = recipe.trained_epochs if recipe is not None else None
    return Followed(checked, origins, run_id, trained)


@step("follow-champion")
def follow_champion(
    config: PipelineConfig, explicit: Mapping[str, str], run: Run, config_source: str
) -> Done[Followed]:
    """The training settings of a retrain of the champion, each with where it came from (the
    step's details, in the run's summary)."""
    followed = follow(config, explicit, config_source)
    lines = describe(followed.origins)
    logger = get_run_logger()
    for line in lines:
        logger.info("run %s: %s", run.id, line)
    details = {"champion run": followed.champion_run, "settings": lines}
    return Done(followed.champion_run is not None, followed, details)
