"""Between the data gate and ``resolve-init-from``: a retrain of the champion takes its recipe.

With ``training.follow_champion`` (the nightly and on-new-data deployments set it), a run whose
data root has a champion trains from the champion's weights with the settings the champion was
trained with, except those the run sets itself (``core/recipe.py`` decides, field by field).
Without it, a champion trained by hand with a better recipe is never beaten by the config's
defaults, and nothing would say why.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import get_run_logger

from backends.blob import container_client
from core.config import PipelineConfig
from core.recipe import Origin, Recipe, describe, training_settings
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


def follow(config: PipelineConfig, explicit: set[str]) -> Followed:
    """The recipe of the champion of the run's data root applied to ``config`` (unchanged
    settings and a from-scratch start while the root has no champion)."""
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
    training, origins = training_settings(config.training, explicit, recipe)
    run_id = read.champion.run_id if read.champion else None
    trained = recipe.trained_epochs if recipe is not None else None
    return Followed(config.model_copy(update={"training": training}), origins, run_id, trained)


@step("follow-champion")
def follow_champion(config: PipelineConfig, explicit: set[str], run: Run) -> Done[Followed]:
    """The training settings of a retrain of the champion, each with where it came from (the
    step's details, in the run's summary)."""
    followed = follow(config, explicit)
    lines = describe(followed.origins)
    logger = get_run_logger()
    for line in lines:
        logger.info("run %s: %s", run.id, line)
    details = {"champion run": followed.champion_run, "settings": lines}
    return Done(followed.champion_run is not None, followed, details)
