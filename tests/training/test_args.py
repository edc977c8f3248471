"""The trainer's arguments, defined once: the config, the task spec and the trainer agree."""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from backends.taskspec import pack_image_size, training_task
from core.config import ConfigError, TrainingConfig, load_config
from tests.conftest import ROOT, child_env
from training.args import (
    TrainerArgs,
    TrainingSettings,
    parse_trainer_args,
)

LOCAL = ROOT / "configs" / "local.yaml"
PATHS = ["--data-dir", "d", "--output-dir", "o"]


def _trainer_argv(config_overrides: list[str]) -> list[str]:
    """The words the training task's command line hands the trainer (after launch.sh)."""
    spec = training_task(load_config(LOCAL, config_overrides), "t", "key", "out")
    script = shlex.split(spec.command_line)[-1]  # /bin/bash -c '<script>'
    words = shlex.split(script.split("; ", 1)[1])  # after the PYTHONPATH export
    return words[words.index("bash") + 2 :]  # bash <launch.sh> <the trainer's arguments>


@pytest.mark.processes
def test_the_orchestrator_imports_no_torch() -> None:
    """The config and the task spec read the definition, the input size included, without
    importing torch (about 2 s, and not installed where only the orchestrator runs)."""
    code = (
        "import sys\n"
        "from core.config import load_config\n"
        "from backends.taskspec import pack_image_size\n"
        f"config = load_config({str(LOCAL)!r}, ['training.model=resnet18'])\n"
        "assert pack_image_size(config) == 224\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["training.model=resnet18"],
        ["training.image_size=48", "training.model=resnet50"],
        ["nfs.shards=false"],
    ],
)
def test_staging_packs_at_the_size_the_trainer_reads(overrides: list[str]) -> None:
    config = load_config(LOCAL, overrides)
    trainer = parse_trainer_args(_trainer_argv(overrides))
    assert pack_image_size(config) == (trainer.input_size() if config.nfs.shards else 0)


def test_a_runs_settings_reach_the_trainer_as_set() -> None:
    overrides = [
        "training.epochs=7",
        "training.batch_size=9",
        "training.lr=0.125",
        "training.model=resnet18",
        "training.image_size=40",
        "training.seed=11",
        "training.timeline=false",
        "training.engine=ddp",
        "training.extra_args=[--warmup-epochs, '0', --fp16-allreduce]",
    ]
    config = load_config(LOCAL, overrides)
    trainer = parse_trainer_args(_trainer_argv(overrides))
    for f in fields(TrainingSettings):
        assert getattr(trainer, f.name) == getattr(config.training, f.name), f.name
    assert trainer.warmup_epochs == 0 and trainer.fp16_allreduce is True
    # launch.sh starts the launcher the same setting names
    spec = training_task(config, "t", "key", "out")
    assert spec.environment["RETRAIN_ENGINE"] == trainer.engine == "ddp"


def test_an_unknown_engine_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"training\.engine"):
        load_config(LOCAL, ["training.engine=mpi"])


def test_the_config_and_the_trainer_share_defaults() -> None:
    """Every default but the timeline's, which a pipeline run records unless told not to."""
    trainer, config = parse_trainer_args(PATHS), TrainingConfig()
    differ = [
        f.name
        for f in fields(TrainingSettings)
        if getattr(trainer, f.name) != getattr(config, f.name)
    ]
    assert differ == ["timeline"] and config.timeline is True and trainer.timeline is False


BOUNDED = [
    (f.name, key, bound)
    for f in fields(TrainerArgs)
    for key, bound in f.metadata.items()
    if key in ("ge", "gt", "le")
]


@pytest.mark.parametrize(("name", "key", "bound"), BOUNDED)
def test_the_trainer_refuses_what_is_out_of_bounds(
    name: str, key: str, bound: float, capsys: pytest.CaptureFixture[str]
) -> None:
    value = {"ge": bound - 1, "gt": bound, "le": bound + 1}[key]
    flag = "--" + name.replace("_", "-")
    with pytest.raises(SystemExit) as exit_:
        parse_trainer_args([*PATHS, flag, str(value)])
    assert exit_.value.code == 2
    assert f"{flag} must" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "key", "bound"),
    [b for b in BOUNDED if b[0] in {f.name for f in fields(TrainingSettings)}],
)
def test_the_config_refuses_the_same_values(name: str, key: str, bound: float) -> None:
    value = {"ge": bound - 1, "gt": bound, "le": bound + 1}[key]
    with pytest.raises(ConfigError, match=f"training.{name}"):
        load_config(LOCAL, [f"training.{name}={value}"])


def test_checkpoints_default_beside_the_outputs() -> None:
    args = parse_trainer_args(PATHS)
    assert args.checkpoints == Path("o") / "checkpoints"
    assert args.as_record()["checkpoint_dir"] == str(Path("o") / "checkpoints")
    assert parse_trainer_args([*PATHS, "--checkpoint-dir", "c"]).checkpoints == Path("c")
