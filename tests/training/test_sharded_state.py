"""``--shard-optimizer-state`` (DDP with ZeRO stage 1): ranks stay identical, a checkpoint holds
the whole optimizer state in a plain optimizer's format, and it resumes under Horovod, plain DDP
and sharded DDP alike, each taking the same steps after it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import run_trainer
from training.models import build_model

pytestmark = [pytest.mark.processes, pytest.mark.usefixtures("horovodrun")]

ARGS = ("--batch-size", "16", "--seed", "6", "--log-every", "1", "--model", "cnn")
SHARDED = ("--shard-optimizer-state",)


def _epoch_losses(output: str, epoch: int) -> list[float]:
    found = re.findall(rf"epoch {epoch} batch (\d+): mean loss so far ([0-9.]+)", output)
    return [float(loss) for _, loss in sorted(found, key=lambda f: int(f[0]))]


def test_sharded_checkpoints_are_whole_and_resume_under_every_engine(tmp_path: Path) -> None:
    source = tmp_path / "source"
    first = run_trainer(2, "synthetic:400", source, "--epochs", "1", *ARGS, *SHARDED, engine="ddp")
    assert first.returncode == 0, first.output
    m = first.metrics
    assert m["args"]["shard_optimizer_state"] is True
    assert m["weights_digest_per_rank"][0] == m["weights_digest_per_rank"][1]
    saved = torch.load(source / "checkpoints" / "checkpoint-1.pt", weights_only=True)
    model = build_model("cnn", 10)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True).state_dict()
    optimizer = saved["optimizer"]
    assert [set(g) for g in optimizer["param_groups"]] == [set(g) for g in plain["param_groups"]]
    shapes = [p.shape for p in model.parameters()]
    assert sorted(optimizer["state"]) == list(range(len(shapes)))  # both ranks' shares
    for index, entry in optimizer["state"].items():
        assert entry["momentum_buffer"].shape == shapes[index]
        assert entry["momentum_buffer"].abs().sum() > 0

    losses = {}
    for name, engine, extra in (
        ("horovod", "horovod", ()),
        ("ddp", "ddp", ()),
        ("ddp sharded", "ddp", SHARDED),
    ):
        out = tmp_path / name.replace(" ", "-")
        shutil.copytree(source / "checkpoints", out / "checkpoints")
        after = run_trainer(2, "synthetic:400", out, "--epochs", "2", *ARGS, *extra, engine=engine)
        assert after.returncode == 0, after.output
        assert "resuming from checkpoint-1.pt: starting at epoch 2" in after.output
        assert (
            after.metrics["weights_digest_per_rank"][0]
            == after.metrics["weights_digest_per_rank"][1]
        )
        losses[name] = _epoch_losses(after.output, 2)[:4]
    # The same weights, momentum, random streams and data order: the same first steps (within
    # float rounding between the engines' orders of addition, at the log's four decimals).
    assert len(losses["horovod"]) == 4
    for name in ("ddp", "ddp sharded"):
        assert losses[name] == pytest.approx(losses["horovod"], abs=2e-3), losses


def test_horovod_refuses_to_shard_the_optimizer_state(tmp_path: Path) -> None:
    result = run_trainer(1, "synthetic:100", tmp_path / "out", "--epochs", "1", *SHARDED)
    assert result.returncode != 0
    assert "--shard-optimizer-state needs --engine ddp" in result.output
