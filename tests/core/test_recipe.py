"""The champion's recipe and the settings a retrain of it uses (core/recipe.py): the case of a
champion trained by hand at 64 px with --augment, retrained by a nightly that states nothing."""

from __future__ import annotations

import pytest

from core.config import TrainingConfig, load_config
from core.recipe import (
    Recipe,
    RecipeError,
    describe,
    explicit_training_fields,
    training_settings,
)
from tests.conftest import ROOT
from training.args import parse_trainer_args

LOCAL = ROOT / "configs" / "local.yaml"
# What the champion's run wrote in its metrics.json: the trainer's arguments, as it parsed them.
CHAMPION_ARGS = parse_trainer_args(
    [
        *("--data-dir", "d", "--output-dir", "o"),
        *("--epochs", "15", "--image-size", "64", "--augment", "--lr", "0.1"),
        *("--warmup-epochs", "2"),
    ]
).as_record()
RECIPE = Recipe.from_metrics("run-a", {"args": CHAMPION_ARGS, "test_accuracy": 1.0})


def _origins(origins: list) -> dict[str, tuple[object, str]]:  # type: ignore[type-arg]
    return {o.field: (o.value, o.source) for o in origins}


def test_a_nightly_that_states_nothing_retrains_the_champions_recipe() -> None:
    config = load_config(LOCAL).training
    assert RECIPE is not None
    settings, origins = training_settings(config, set(), RECIPE)
    assert isinstance(settings, TrainingConfig)
    assert (settings.epochs, settings.image_size, settings.lr) == (15, 64, 0.1)
    assert settings.init_from == "champion"
    assert "--augment" in settings.extra_args
    # the options the champion changed from the trainer's defaults, and only those
    assert settings.extra_args[-2:] == ["--warmup-epochs", "2.0"]
    assert "--momentum" not in settings.extra_args
    by_field = _origins(origins)
    assert by_field["epochs"] == (15, "champion")
    assert by_field["init_from"] == ("champion", "champion")
    assert by_field["engine"][1] == "config"  # not part of a recipe
    lines = describe(origins)
    assert "training.epochs = 15: the champion's recipe (run run-a)" in lines


def test_what_the_deployment_sets_wins_over_the_recipe() -> None:
    explicit = explicit_training_fields(["training.epochs=3", "data.version=v2"], ["training.lr"])
    assert set(explicit) == {"epochs", "lr"}
    config = load_config(LOCAL, ["training.epochs=3", "training.lr=0.02"]).training
    assert RECIPE is not None
    settings, origins = training_settings(config, explicit, RECIPE)
    assert (settings.epochs, settings.lr, settings.image_size) == (3, 0.02, 64)
    assert _origins(origins)["epochs"] == (3, "run")


def test_a_network_the_deployment_sets_otherwise_trains_from_scratch_and_says_why() -> None:
    config = load_config(LOCAL, ["training.image_size=32"]).training
    assert RECIPE is not None
    settings, origins = training_settings(config, {"image_size"}, RECIPE)
    assert settings.init_from is None and settings.image_size == 32
    why = next(o.why for o in origins if o.field == "init_from")
    assert "from scratch: the run sets training.image_size 32" in why and "64" in why


def test_without_a_champion_the_config_is_used_as_it_is() -> None:
    config = load_config(LOCAL).training
    settings, origins = training_settings(config, set(), None)
    assert settings == config
    assert {o.source for o in origins} == {"config"}
    assert Recipe.from_metrics("run-b", {"test_accuracy": 0.5}) is None


def test_an_explicit_init_from_and_extra_args_are_the_deployments() -> None:
    config = load_config(
        LOCAL, ["training.init_from=null", "training.extra_args=[--fp16-allreduce]"]
    ).training
    assert RECIPE is not None
    settings, _ = training_settings(config, {"init_from", "extra_args"}, RECIPE)
    assert settings.init_from is None and settings.extra_args == ["--fp16-allreduce"]


def test_a_warm_start_from_the_champion_leaves_its_cap_to_be_fitted() -> None:
    """The champion's training stopped early after 13 epochs (its history): the retrain from
    its weights does not take the champion's from-scratch cap of 15 but leaves it to the
    fitting step (tests/tasks/test_fit_to_data.py), unless the deployment states one."""
    history = [{"epoch": e} for e in range(1, 14)]
    recipe = Recipe.from_metrics("run-a", {"args": CHAMPION_ARGS, "epochs": history})
    assert recipe is not None and recipe.trained_epochs == 13
    config = load_config(LOCAL).training
    settings, origins = training_settings(config, set(), recipe)
    assert settings.epochs is None and settings.init_from == "champion"
    assert "whose training ran 13 epochs" in _origins_why(origins)["epochs"]
    stated, _ = training_settings(config, {"epochs"}, recipe)
    assert stated.epochs == config.epochs
    scratch, _ = training_settings(config, {"init_from"}, recipe)  # no champion weights
    assert scratch.epochs == 15


def _origins_why(origins: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {o.field: o.why for o in origins}


def test_a_tampered_recipe_is_refused_naming_every_value() -> None:
    """A champion's metrics.json edited by hand: before, its values were applied as they were
    (no bound is checked on a dataclass replaced in place) and the run provisioned its pool and
    staged its data before the trainer on the node refused them."""
    tampered = {
        **CHAMPION_ARGS,
        "batch_size": 100000,
        "lr": -5,
        "epochs": 1e6,  # a float: no trainer writes one for a count
        "momentum": float("nan"),
    }
    recipe = Recipe.from_metrics("run-t", {"args": tampered})
    assert recipe is not None
    config = load_config(LOCAL).training
    with pytest.raises(RecipeError) as refused:
        training_settings(config, set(), recipe)
    message = str(refused.value)
    assert message.startswith("the champion's recipe (run run-t) holds values no run may train")
    for part in (
        "epochs 1000000.0: Input should be a valid integer",
        "batch_size 100000: Input should be less than or equal to 8192",
        "lr -5: Input should be greater than 0",
        "momentum nan: Input should be greater than or equal to 0",
    ):
        assert part in message, message
    # What the deployment sets itself is not the recipe's: a value it replaces is not judged.
    explicit = {"batch_size", "lr", "epochs", "extra_args"}
    settings, _ = training_settings(config, explicit, recipe)
    assert (settings.batch_size, settings.epochs) == (config.batch_size, config.epochs)
