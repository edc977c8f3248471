"""After the champion's recipe, before ``resolve-init-from``: the training settings a run leaves
unset, fitted to the data the gate has just read.

The config's defaults were a guess made for no data in particular: 32 px photographs of
textures lose the grain that tells them apart, and four epochs of 360 images are a dozen
optimizer steps. The gate already knows every image's size and every class's count, so before
anything is provisioned the run fits what it was not told (:func:`fit_training`, pure: the same
facts always give the same settings, and the up-to-date check and the checkpoint key see the
fitted values) and says in its summary what it chose and why. A setting the config, the run or
the champion's recipe states is never changed. docs/trainer.md gives the rules and
docs/performance.md the measurements behind their numbers.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from prefect import get_run_logger

from core.config import PipelineConfig
from core.run import Run
from tasks.steps import Done, step
from training.architectures import architecture
from training.args import DEFAULT_EPOCH_CAP, TrainingSettings
from training.stopping import HOLDOUT_FRACTION

# The input size: the photographs' own detail, in steps of 16 px, between these bounds per
# network (a larger input costs compute by its square and adds no detail to a small image).
SIZE_STEP = 16
SIZE_BOUNDS: dict[str, tuple[int, int]] = {
    "cnn": (32, 96),
    "resnet18": (64, 224),
    "resnet50": (64, 224),
}
# The epoch cap: enough epochs for this many optimizer steps, within these bounds. Early
# stopping ends most trainings well before it (docs/performance.md).
TARGET_STEPS = 100
MIN_EPOCH_CAP = 15
MAX_EPOCH_CAP = 60
# A retrain from the champion's weights trains this share of the fewer of the epochs the
# champion's training ran and the cap a training from scratch would get here (rounded up):
# bench/warm_start_flow.py measures what it reaches in them (docs/warm-start.md).
WARM_EPOCH_SHARE = 3  # one third


@dataclass(frozen=True)
class DataFacts:
    """What the gate read of the data version a run trains."""

    images: dict[str, int]  # readable images per split
    classes: int
    median_side: int | None  # the median shorter side of the train images, in pixels

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]]) -> DataFacts:
        """The facts of the gate's manifest rows (one per image: split, label, width, height,
        readable). A tar shard's rows are its samples."""
        readable = [r for r in rows if r.get("readable") and r.get("split") and r.get("label")]
        images = Counter(str(r["split"]) for r in readable)
        sides = [
            min(int(r["width"]), int(r["height"]))
            for r in readable
            if r["split"] == "train" and r.get("width") and r.get("height")
        ]
        return cls(
            images=dict(sorted(images.items())),
            classes=len({r["label"] for r in readable}),
            median_side=round(statistics.median(sides)) if sides else None,
        )

    def as_record(self) -> dict[str, Any]:
        return {"images": self.images, "classes": self.classes, "median_side": self.median_side}


Settings = TypeVar("Settings", bound=TrainingSettings)


def fitted_input_size(model: str, median_side: int) -> int:
    """The input size for images whose median shorter side is ``median_side``."""
    low, high = SIZE_BOUNDS[model]
    return max(low, min(high, median_side // SIZE_STEP * SIZE_STEP))


def fitted_epoch_cap(train_images: int, global_batch: int) -> int:
    """The epoch cap that gives :data:`TARGET_STEPS` optimizer steps, within its bounds."""
    steps_per_epoch = max(1, math.ceil(train_images / global_batch))
    return max(MIN_EPOCH_CAP, min(MAX_EPOCH_CAP, math.ceil(TARGET_STEPS / steps_per_epoch)))


def fit_training(
    training: Settings, facts: DataFacts, processes: int, warm_from: int | None = None
) -> tuple[Settings, list[str]]:
    """``training`` with its unset input size and epoch cap fitted to ``facts`` (``processes``:
    the training processes, whose batches make one step; ``warm_from``: the epochs the
    champion's training ran, for a retrain from its weights), and one line per setting saying
    what was chosen and why."""
    updates: dict[str, Any] = {}
    lines: list[str] = []
    native = architecture(training.model).input_size
    if training.image_size is None:
        if getattr(training, "init_from", None) is not None:
            lines.append(
                "training.image_size not fitted: the run starts from weights, whose size "
                f"applies (the champion's; else the {training.model}'s own, {native})"
            )
        elif facts.median_side is None:
            lines.append(
                f"training.image_size = {native}: the {training.model}'s own size (the gate "
                "measured no train image)"
            )
        else:
            size = fitted_input_size(training.model, facts.median_side)
            low, high = SIZE_BOUNDS[training.model]
            updates["image_size"] = size
            lines.append(
                f"training.image_size = {size}: the train images' median shorter side is "
                f"{facts.median_side} px; the {training.model} reads it in steps of "
                f"{SIZE_STEP} px between {low} and {high}"
            )
    if training.epochs is None:
        given = facts.images.get("train", 0)
        train, held = given, ""
        if not facts.images.get("val"):  # early stopping watches a slice held out of train
            train = given - round(given * HOLDOUT_FRACTION)
            held = f" (the {given} less the {HOLDOUT_FRACTION:.0%} held out)"
        if train <= 0:
            updates["epochs"] = DEFAULT_EPOCH_CAP
            lines.append(f"training.epochs = {DEFAULT_EPOCH_CAP}: the trainer's default cap")
        else:
            global_batch = training.batch_size * processes
            cap = fitted_epoch_cap(train, global_batch)
            steps = math.ceil(train / global_batch)
            scratch = (
                f"{train} train images{held} make {steps} steps of {training.batch_size} x "
                f"{processes} processes an epoch; about {TARGET_STEPS} steps, within "
                f"{MIN_EPOCH_CAP}-{MAX_EPOCH_CAP} epochs"
            )
            if warm_from is not None and getattr(training, "init_from", None) == "champion":
                warm = math.ceil(min(warm_from, cap) / WARM_EPOCH_SHARE)
                updates["epochs"] = warm
                lines.append(
                    f"training.epochs = {warm}: a warm start from the champion trains a third "
                    f"of the fewer of the {warm_from} epochs the champion's training ran and "
                    f"the {cap} a training from scratch would get ({scratch})"
                )
            else:
                updates["epochs"] = cap
                lines.append(
                    f"training.epochs = {cap} (a cap; early stopping with patience "
                    f"{training.patience} ends most trainings sooner): {scratch}"
                )
    return replace(training, **updates), lines


@step("fit-to-data")
def fit_to_data(
    config: PipelineConfig, facts: DataFacts, run: Run, warm_from: int | None = None
) -> Done[PipelineConfig]:
    """The run's config with its unset training settings fitted to the data (the step's
    details, in the run's summary, say what and why)."""
    processes = config.pool.nodes * config.pool.processes_per_node
    training, lines = fit_training(config.training, facts, processes, warm_from)
    logger = get_run_logger()
    for line in lines:
        logger.info("run %s: %s", run.id, line)
    fitted = config.model_copy(update={"training": training})
    return Done(bool(lines), fitted, {"data": facts.as_record(), "settings": lines})
