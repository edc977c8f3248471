"""The champion's recipe, and which training settings a retrain of it uses.

A model is only as good as the settings it was trained with: a champion trained with
``epochs=15``, ``image_size=64`` and ``--augment`` is not beaten by a nightly that trains the
config's 32 px defaults. So a scheduled or triggered retrain of a data root that has a champion
starts from the champion's weights **and its recipe**: the settings of the champion's own run
(``metrics.json`` records the trainer's arguments). A setting the run states itself (``--set``,
a deployment's ``overrides`` parameter, the form's fields) wins over the recipe; anything
neither states keeps the config's value. :func:`training_settings` decides this, field by field,
and says where each value really came from, for the run's summary; a recipe value no run could
train with is refused by name (:class:`RecipeError`).

No I/O here: the caller reads the champion's ``metrics.json`` and the deployment's config file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from core.config import hide_credentials
from training.args import TrainerArgs, TrainingSettings, flag

# The trainer's own settings that shape the model (TrainingSettings), without those that only
# record or place a run: the timeline, the profiler and the engine.
RECIPE_FIELDS = tuple(
    f.name
    for f in fields(TrainingSettings)
    if f.name not in ("timeline", "profile_steps", "engine")
)
# Trainer options a pipeline passes in training.extra_args that shape the model too: a switch,
# or an option with a value.
RECIPE_SWITCHES = ("augment",)
RECIPE_OPTIONS = ("warmup_epochs", "momentum", "weight_decay")

Source = Literal["run", "champion", "config"]


@dataclass(frozen=True)
class Origin:
    """Where one training setting of a run came from, and why."""

    field: str
    value: Any
    source: Source
    why: str


@dataclass(frozen=True)
class Recipe:
    """The settings a champion was trained with (from its run's ``metrics.json``)."""

    run_id: str
    settings: dict[str, Any]  # TrainingSettings fields of RECIPE_FIELDS
    extra: dict[str, Any]  # RECIPE_SWITCHES (bool) and RECIPE_OPTIONS (values)
    trained_epochs: int | None = None  # the epochs its training ran (early stopping ended it)

    @classmethod
    def from_metrics(cls, run_id: str, metrics: Mapping[str, Any]) -> Recipe | None:
        """The recipe in a run's metrics (None when they hold no trainer arguments)."""
        args = metrics.get("args")
        if not isinstance(args, Mapping):
            return None
        settings = {k: args[k] for k in RECIPE_FIELDS if k in args}
        extra = {k: args[k] for k in (*RECIPE_SWITCHES, *RECIPE_OPTIONS) if k in args}
        history = metrics.get("epochs")
        trained = len(history) if isinstance(history, list) and history else None
        return cls(run_id, settings, extra, trained)


class RecipeError(ValueError):
    """The champion's recipe holds a value no run may train with; the message names each."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def recipe_problems(recipe: Recipe, names: Iterable[str]) -> list[str]:
    """Why the recipe's values of ``names`` cannot train a run, one phrase per value: each is
    checked as the trainer's argument it is (``TrainerArgs``: its type and bounds, the same
    metadata the config's training section and the trainer's command line read). Types are
    checked strictly: a champion's ``metrics.json`` holds the values its trainer parsed, so
    an epoch count of ``1e6`` (a float) is a record edited by hand, not a setting."""
    values = {n: recipe.settings.get(n, recipe.extra.get(n)) for n in names}
    # The trainer's two required paths, so that only the recipe's values are judged.
    doc = {"data_dir": "-", "output_dir": "-", **values}
    try:
        TypeAdapter(TrainerArgs).validate_json(json.dumps(doc), strict=True)
    except ValidationError as exc:
        return [
            f"{'.'.join(map(str, err['loc'])) or '?'} {_shown(values.get(str(err['loc'][0])))}: "
            f"{err['msg']}"
            for err in exc.errors()
        ]
    except (TypeError, ValueError) as exc:  # not even JSON (a value json cannot write)
        return [f"its values cannot be read ({type(exc).__name__})"]
    return []


def explicit_training_fields(
    overrides: Iterable[str], fields: Iterable[str] | Mapping[str, Any] = (), deployed: bool = False
) -> dict[str, str]:
    """The training fields a run sets for itself, each with where it set it, as the run's
    summary says it: ``--set training.lr=0.1`` (``overrides``: the command line's ``--set``,
    or, for a run of a deployment, its ``overrides`` parameter, which the deployment's
    parameters and the run form fill in) or the run's own fields (``training.epochs``, ...:
    the form's first fields, a trigger's). The config file every run starts from is not among
    them: the recipe replaces its values."""
    named: dict[str, str] = {}
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        parts = key.split(".")
        if parts[0] == "training" and len(parts) > 1:
            shown = hide_credentials(item.strip())
            named[parts[1]] = (
                f"set by the run's overrides parameter ({shown})"
                if deployed
                else f"set with --set {shown}"
            )
    values = fields if isinstance(fields, Mapping) else dict.fromkeys(fields)
    for key, value in values.items():
        parts = key.strip().split(".")
        if parts[0] == "training" and len(parts) > 1:
            given = f" ({value!r})" if value is not None else ""
            named[parts[1]] = f"set by the run's {parts[1]} parameter{given}"
    return named


def _extra_words(extra_args: list[str]) -> set[str]:
    return {w[2:].split("=", 1)[0].replace("-", "_") for w in extra_args if w.startswith("--")}


def _clash(config: TrainingSettings, explicit: Iterable[str], recipe: Recipe) -> str | None:
    """Why the champion's weights do not fit the network the run sets, if they don't."""
    for name in ("model", "image_size"):
        mine, theirs = getattr(config, name), recipe.settings.get(name)
        if name in explicit and name in recipe.settings and mine != theirs:
            return (
                f"the run sets training.{name} {mine!r}, the champion (run "
                f"{recipe.run_id}) was trained with {theirs!r}"
            )
    return None


def training_settings(
    config: TrainingSettings,
    explicit: Iterable[str] | Mapping[str, str],
    recipe: Recipe | None,
    config_source: str = "the config",
) -> tuple[TrainingSettings, list[Origin]]:
    """The run's training settings, and where each came from.

    ``config``: the run's training section (its file and overrides applied); ``explicit``:
    the fields the run states itself, each with where it stated it
    (:func:`explicit_training_fields`); ``config_source``: where the rest of the config came
    from, as the summary names it (the config file, the form's config); ``recipe``:
    the champion's, or None when the data root has none (then the config is used as it is, and
    the run starts from scratch unless it says otherwise). With a recipe the run starts from
    the champion's weights (``init_from: champion``) unless the deployment states
    ``init_from``; each recipe field the deployment does not state is the champion's; a recipe
    switch or option the deployment's ``extra_args`` does not name is added to them (an
    ``extra_args`` the deployment states is its own, whole). A recipe value applied that no
    run could train with (out of its bounds, or not of its type) raises :class:`RecipeError`
    naming each one, before anything is provisioned."""
    stated = (
        dict(explicit)
        if isinstance(explicit, Mapping)
        else dict.fromkeys(explicit, "set for this run")
    )
    origins: list[Origin] = []
    updates: dict[str, Any] = {}
    names = [f.name for f in fields(config)]
    for name in names:
        value = getattr(config, name)
        if name in stated:
            origins.append(Origin(name, value, "run", stated[name]))
        elif recipe is not None and name in recipe.settings:
            updates[name] = recipe.settings[name]
            why = f"the champion's recipe (run {recipe.run_id})"
            origins.append(Origin(name, recipe.settings[name], "champion", why))
        elif name == "init_from" and recipe is not None:
            clash = _clash(config, stated, recipe)
            if clash:
                why = f"from scratch: {clash}, so its weights cannot be carried"
                origins.append(Origin(name, value, "config", why))
            else:
                updates[name] = "champion"
                why = f"a champion exists (run {recipe.run_id}): retrain it"
                origins.append(Origin(name, "champion", "champion", why))
        else:
            why = (
                f"{config_source} (no champion yet)"
                if recipe is None
                else f"{config_source} (not part of a recipe)"
            )
            origins.append(Origin(name, value, "config", why))
    trained = recipe.trained_epochs if recipe is not None else None
    if updates.get("init_from") == "champion" and "epochs" not in stated and trained:
        # The champion's cap was for a training from scratch: a warm start's is fitted to the
        # data (tasks/fit_to_data.py), from the epochs the champion's training ran.
        updates["epochs"] = None
        origins = [o for o in origins if o.field != "epochs"]
        why = (
            f"left to be fitted to a warm start from the champion, whose training ran "
            f"{trained} epochs (run {recipe.run_id if recipe else None})"
        )
        origins.append(Origin("epochs", None, "champion", why))
    applied = [n for n in updates if recipe is not None and n in recipe.settings]
    if recipe is not None and "extra_args" in names and "extra_args" not in stated:
        extra = list(getattr(config, "extra_args"))  # noqa: B009 - TrainingConfig's field
        given = _extra_words(extra)
        for name in RECIPE_SWITCHES:
            if recipe.extra.get(name) is True and name not in given:
                extra.append(flag(name))
                applied.append(name)
        defaults = {f.name: f.default for f in fields(TrainerArgs)}
        for name in RECIPE_OPTIONS:
            # Only a value other than the trainer's default: the task stays as it was.
            if name in recipe.extra and name not in given and recipe.extra[name] != defaults[name]:
                extra += [flag(name), str(recipe.extra[name])]
                applied.append(name)
        updates["extra_args"] = extra
        origins = [o for o in origins if o.field != "extra_args"]
        why = f"{config_source}, with the champion's recipe (run {recipe.run_id}) added"
        origins.append(Origin("extra_args", extra, "champion", why))
    if recipe is not None and (problems := recipe_problems(recipe, applied)):
        raise RecipeError(
            f"the champion's recipe (run {recipe.run_id}) holds values no run may train with: "
            + "; ".join(problems)
        )
    return replace(config, **updates), origins


def describe(origins: list[Origin]) -> list[str]:
    """One line per setting, for the run's summary."""
    return [f"training.{o.field} = {o.value!r}: {o.why}" for o in origins]
