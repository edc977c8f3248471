"""The trainer's arguments, defined once: names, types, defaults, choices, bounds and help.

Three readers share this one definition:

* the pipeline config embeds :class:`TrainingSettings` as its ``training`` section: pydantic
  validates it from the metadata below (it reads a dataclass field's ``description``, ``ge``,
  ``gt``, ``le`` and ``allow_inf_nan``), and the Prefect UI renders it as a form;
* the task spec turns a run's settings into the trainer's command line (:func:`settings_argv`);
* ``python -m training.train`` parses its command line into :class:`TrainerArgs`
  (:func:`parse_trainer_args`), with the same bounds.

The input image size is decided here too (:meth:`TrainingSettings.input_size`), for staging's
packed shards and for the trainer alike: the trainer reads shards only at its own size, so two
answers would make it silently fall back to the loose files.

This module imports neither torch nor pydantic: the orchestrator imports it (and must not pay
for torch), and the training image has no pydantic.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from training.architectures import ModelName, architecture, input_sizes
from training.stopping import MetricName

Precision = Literal["auto", "bf16", "fp16", "fp32"]
OptimizerKernel = Literal["auto", "fused", "foreach"]
EngineName = Literal["horovod", "ddp"]

BOUNDS = ("ge", "gt", "le")
# Fine-tuning when starting from weights, as measured by bench/warm_start.py (docs/trainer.md).
DEFAULT_HEAD_ONLY_EPOCHS = 0
DEFAULT_BACKBONE_LR_SCALE = 1.0
# The epoch cap of a trainer started without --epochs (the pipeline fits one to its data first).
DEFAULT_EPOCH_CAP = 30


def about(description: str, **bounds: float | bool) -> dict[str, Any]:
    """A field's metadata: its help, and bounds under pydantic's ``Field`` keyword names."""
    return {"description": description, **bounds}


def field_metadata(cls: type, name: str) -> Any:
    """The metadata (help, bounds) of field ``name`` of the dataclass ``cls``: for a subclass
    that gives the field another default."""
    return {f.name: f for f in fields(cls)}[name].metadata


def default_input_size(model: str) -> int:
    """The side in pixels ``model`` reads when no ``--image-size`` is given."""
    return architecture(model).input_size


@dataclass
class TrainingSettings:
    """What a pipeline run sets of the trainer (see ``python -m training.train --help``)."""

    epochs: int | None = field(
        default=None,
        metadata=about(
            "the most passes over the training data: training stops earlier once the val "
            "metric stops improving (patience); unset: fitted to the data (docs/trainer.md), "
            f"{DEFAULT_EPOCH_CAP} for the trainer alone",
            ge=1,
            le=10000,
        ),
    )
    patience: int = field(
        default=10,
        metadata=about(
            "epochs in a row without an improvement of the val metric (the val split's, or a "
            "slice held out of train when there is none) after which training stops and keeps "
            "its best epoch's model; 0: train to the epoch cap, keeping the best epoch's model",
            ge=0,
            le=10000,
        ),
    )
    min_improvement: float = field(
        default=0.0,
        metadata=about(
            "the rise of the val metric over its best that counts as an improvement for "
            "patience (0: any rise)",
            ge=0,
            le=1,
            allow_inf_nan=False,
        ),
    )
    batch_size: int = field(
        default=64,
        metadata=about(
            "images per process and step; at most 8192 (a batch of 8192 images at 224 px is "
            "already 4.9 GB of float32 input on one GPU)",
            ge=1,
            le=8192,
        ),
    )
    lr: float = field(
        default=0.05,
        metadata=about(
            "single-worker learning rate; scaled by the number of workers",
            gt=0,
            allow_inf_nan=False,
        ),
    )
    model: ModelName = field(default="cnn", metadata=about("the network to train"))
    image_size: int | None = field(
        default=None,
        metadata=about(
            f"input size in pixels; default the model's own ({input_sizes()}); at most 1024, "
            "where one image is 3 MB in the shards and 12 MB as the model's float32 input",
            ge=8,
            le=1024,
        ),
    )
    seed: int = field(
        default=0,
        metadata=about(
            "seed of every random stream (plus the rank); 0 to 2**32 - 1, numpy's range (torch "
            "refuses 2**64 and more only once training starts)",
            ge=0,
            le=2**32 - 1,
        ),
    )
    timeline: bool = field(
        default=False, metadata=about("write a Horovod timeline (the horovod engine only)")
    )
    engine: EngineName = field(
        default="horovod",
        metadata=about(
            "the data-parallel engine: horovod (under horovodrun) or ddp (PyTorch's "
            "DistributedDataParallel under torchrun; needs no Horovod build)"
        ),
    )
    checkpoint_minutes: float | None = field(
        default=None,
        metadata=about(
            "also checkpoint every this many minutes of training, inside an epoch too (a retry "
            "resumes at the first batch not yet trained); off when unset: once per epoch",
            gt=0,
            le=10080,
            allow_inf_nan=False,
        ),
    )
    profile_steps: int | None = field(
        default=None,
        metadata=about(
            "record this many training steps (after two of warm-up) with the PyTorch profiler "
            "into the run's TensorBoard logs, for TensorBoard's profiler view; off when unset",
            ge=1,
            le=1000,
        ),
    )

    head_only_epochs: int | None = field(
        default=None,
        metadata=about(
            "when starting from weights: epochs at the start in which only the classifier "
            "learns (the backbone's rate is 0); default 0 (docs/trainer.md says how the "
            "defaults were measured)",
            ge=0,
            le=1000,
        ),
    )
    backbone_lr_scale: float | None = field(
        default=None,
        metadata=about(
            "when starting from weights: the backbone's learning rate as a fraction of the "
            "classifier's; default 1",
            gt=0,
            le=1,
            allow_inf_nan=False,
        ),
    )

    def input_size(self) -> int:
        """The side in pixels of every image the trainer reads, and so of the packed shards."""
        return self.image_size or default_input_size(self.model)

    def epoch_cap(self) -> int:
        """The most epochs the trainer trains."""
        return self.epochs or DEFAULT_EPOCH_CAP


@dataclass(kw_only=True)
class TrainerArgs(TrainingSettings):
    """Everything ``python -m training.train`` takes: a run's settings, where its data and
    outputs are, and the tuning a pipeline passes through ``training.extra_args``."""

    data_dir: str = field(metadata=about("image folders, CIFAR-10 batches, or synthetic:N"))
    output_dir: Path = field(metadata=about("model.pt, metrics.json, TensorBoard, timeline"))
    checkpoint_dir: Path | None = field(
        default=None, metadata=about("default: <output-dir>/checkpoints")
    )
    init_from: Path | None = field(
        default=None,
        metadata=about(
            "start from these weights instead of random ones: a model.pt of this trainer (the "
            "network and the rows of the classes both know are carried, by class name) or a "
            "state dict of the same network, such as torchvision's ImageNet weights; read by "
            "rank 0, sent to every rank"
        ),
    )
    init_from_run: str | None = field(
        default=None,
        metadata=about("the run whose model --init-from is, recorded in metrics.json"),
    )
    val_metric: MetricName = field(
        default="accuracy",
        metadata=about(
            "the metric early stopping watches and the best epoch is chosen by (the pipeline "
            "passes its promotion.metric)"
        ),
    )
    warmup_epochs: float | None = field(
        default=None,
        metadata=about(
            "epochs of linear warm-up to the scaled rate (from the single-worker rate; from 0 "
            "when starting from weights); default 1 from random weights, none from weights "
            "(bench/warm_start.py: a warm-up spends the head start)",
            ge=0,
        ),
    )
    momentum: float = field(default=0.9, metadata=about("SGD momentum", ge=0))
    weight_decay: float = field(default=5e-4, metadata=about("SGD weight decay", ge=0))
    fp16_allreduce: bool = field(
        default=False,
        metadata=about("compress gradients to fp16 (horovod: Compression.fp16; ddp: a comm hook)"),
    )
    backward_passes_per_step: int = field(
        default=1, metadata=about("batches whose gradients add up to one step", ge=1)
    )
    adasum: bool = field(
        default=False, metadata=about("Adasum instead of averaging (the horovod engine only)")
    )
    sync_batchnorm: bool = field(
        default=False,
        metadata=about("batch-norm statistics over all ranks' batches (the ddp engine on GPU)"),
    )
    no_amp: bool = field(default=False, metadata=about("disable mixed precision on GPU"))
    no_onnx: bool = field(
        default=False,
        metadata=about(
            "write no model.onnx: its export and its check against PyTorch cost about 5 "
            "CPU-seconds whatever the model (torch.export and onnxscript load), most of a small "
            "run's; for runs whose model is not served through ONNX"
        ),
    )
    precision: Precision = field(
        default="auto",
        metadata=about("autocast type; auto: bf16 on GPUs with it, fp16 on older, fp32 on CPU"),
    )
    channels_last: bool = field(
        default=False, metadata=about("weights and inputs in NHWC layout (faster convolutions)")
    )
    compile: bool = field(
        default=False,
        metadata=about("torch.compile the model (costs a minute or more before the first step)"),
    )
    optimizer_kernel: OptimizerKernel = field(
        default="auto", metadata=about("SGD's kernels; auto: fused on GPU, foreach on CPU")
    )
    augment: bool = field(
        default=False,
        metadata=about(
            "random crops (up to 1/8 of the side) and horizontal flips, drawn per image on the "
            "device for the whole batch"
        ),
    )
    shard_optimizer_state: bool = field(
        default=False,
        metadata=about(
            "partition the optimizer state across ranks (ZeRO stage 1: PyTorch's "
            "ZeroRedundancyOptimizer; the ddp engine only)"
        ),
    )
    workers: int = field(
        default=-1,
        metadata=about(
            "data loader processes for data read image by image (packed shards are gathered a "
            "batch at a time in the training process); -1: auto",
            ge=-1,
        ),
    )
    no_verify_images: bool = field(
        default=False,
        metadata=about("skip decoding every image at start (when a data gate already did)"),
    )
    keep_checkpoints: int = field(default=3, metadata=about("newest checkpoints kept", ge=1))
    prune_checkpoint_folders: float | None = field(
        default=None,
        metadata=about(
            "remove the other checkpoint folders beside --checkpoint-dir that no run will "
            "resume: those whose training finished, and unfinished ones last written more "
            "than this many days ago (the pipeline's NFS checkpoints; see training/checkpoint.py)",
            ge=0,
            allow_inf_nan=False,
        ),
    )
    log_every: int = field(default=50, metadata=about("steps between loss checks", ge=1))
    stop_file: Path | None = field(
        default=None,
        metadata=about(
            "when this file exists at the start of an epoch, stop there: the last checkpoint "
            "is kept to resume from, a PROGRESS line says so, and the exit status is 0 (a "
            "requested stop is no failure to retry); the pipeline's budget stop"
        ),
    )
    heartbeat_seconds: float = field(
        default=30.0,
        metadata=about(
            "seconds between rank 0's HEARTBEAT lines (batches done), which an orchestrator's "
            "stall deadline counts as progress",
            gt=0,
            allow_inf_nan=False,
        ),
    )

    def warmup(self) -> float:
        """Epochs of warm-up: ``--warmup-epochs``, or its default for the start."""
        if self.warmup_epochs is not None:
            return self.warmup_epochs
        return 0.0 if self.init_from is not None else 1.0

    @property
    def checkpoints(self) -> Path:
        """Where checkpoints are written and resumed from."""
        return self.checkpoint_dir or self.output_dir / "checkpoints"

    def as_record(self) -> dict[str, Any]:
        """The arguments as plain values (paths as text), for metrics.json and checkpoints."""
        values = {**asdict(self), "checkpoint_dir": self.checkpoints}
        return {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# What a pipeline's run passes itself: where it reads and writes (the validated data it staged,
# the run's outputs, the checkpoints of its training key), which checkpoint folders go, the
# metric early stopping watches (its promotion.metric) and the orchestrator's stop request.
PIPELINE_OPTIONS = (
    "data_dir",
    "output_dir",
    "checkpoint_dir",
    "prune_checkpoint_folders",
    "val_metric",
    "stop_file",
)


# What a pipeline's run sets from its ``training.init_from`` (the weights it resolved and checked).
INIT_FROM_OPTIONS = ("init_from", "init_from_run")


def extra_option_owner(word: str) -> str | None:
    """Who sets the trainer option in ``word`` (``--name`` or ``--name=value``) when a pipeline
    runs the trainer: "the pipeline" for its paths and pruning, ``training.<field>`` for a
    setting the run records; None for the tuning options extra arguments are for. The trainer
    takes the last of a repeated option, so an extra one would replace the owner's value
    unseen."""
    if not word.startswith("--"):
        return None
    name = word[2:].split("=", 1)[0].replace("-", "_")
    if name in PIPELINE_OPTIONS:
        return "the pipeline"
    if name in INIT_FROM_OPTIONS:
        return "training.init_from"
    if name in {f.name for f in fields(TrainingSettings)}:
        return f"training.{name}"
    return None


def settings_argv(settings: TrainingSettings) -> list[str]:
    """The trainer's options for ``settings``: ``--name value`` per field and a switch when
    true; an unset field (None) or a switch that is off is left out, so the trainer's own
    default applies. Only the fields of :class:`TrainingSettings`, whatever subclass is given."""
    words: list[str] = []
    for f in fields(TrainingSettings):
        value = getattr(settings, f.name)
        if value is None or value is False:
            continue
        words.append(flag(f.name))
        if value is not True:
            words.append(str(value))
    return words


def _option_type(annotation: Any) -> tuple[Any, tuple[str, ...] | None]:
    """The argparse type of a field's annotation and its choices (a Literal's values)."""
    if get_origin(annotation) in (Union, UnionType):
        (annotation,) = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Literal:
        return str, get_args(annotation)
    return annotation, None


def _out_of_bounds(f: Field[Any], value: Any) -> str | None:
    """Why ``value`` is outside the field's bounds, or None."""
    meta = f.metadata
    if isinstance(value, float) and not math.isfinite(value) and meta.get("allow_inf_nan") is False:
        return "must be a positive number" if meta.get("gt") == 0 else "must be a finite number"
    if "ge" in meta and not value >= meta["ge"]:
        return f"must be at least {meta['ge']}"
    if "gt" in meta and not value > meta["gt"]:
        return "must be a positive number" if meta["gt"] == 0 else f"must exceed {meta['gt']}"
    if "le" in meta and not value <= meta["le"]:
        return f"must be at most {meta['le']}"
    return None


def trainer_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The trainer's command line, one option per field of :class:`TrainerArgs` (the required
    ones first); a bool field is a switch, off unless given."""
    # No abbreviations: ``--data-d X`` must not reach --data-dir past checks on whole names.
    p = argparse.ArgumentParser(
        prog="python -m training.train", description=description, allow_abbrev=False
    )
    hints = get_type_hints(TrainerArgs)
    ordered = sorted(fields(TrainerArgs), key=lambda f: f.default is not MISSING)
    for f in ordered:
        kind, choices = _option_type(hints[f.name])
        help_text = f.metadata.get("description")
        if kind is bool:
            p.add_argument(flag(f.name), action="store_true", help=help_text)
        elif f.default is MISSING:
            p.add_argument(flag(f.name), type=kind, required=True, help=help_text)
        else:
            p.add_argument(
                flag(f.name), type=kind, default=f.default, choices=choices, help=help_text
            )
    return p


def parse_trainer_args(argv: list[str] | None, description: str | None = None) -> TrainerArgs:
    """The trainer's arguments; an option out of its bounds exits 2 naming it."""
    p = trainer_parser(description)
    parsed = vars(p.parse_args(argv))
    for f in fields(TrainerArgs):
        value = parsed[f.name]
        if value is not None and not isinstance(value, bool) and (why := _out_of_bounds(f, value)):
            p.error(f"{flag(f.name)} {why}")
    return TrainerArgs(**parsed)
