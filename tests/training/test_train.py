"""The trainer under real horovodrun: learning, outputs, identical ranks, resume after a kill;
bad arguments, a diverging loss and an unusable option refused by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, Result, child_env, run_trainer, trainer_command
from training.checkpoint import list_checkpoints
from training.distributed import state_digest

pytestmark = pytest.mark.usefixtures("horovodrun")


@pytest.fixture(scope="module")
def two_rank_run(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Result:
    out = tmp_path_factory.mktemp("hvd2") / "out"
    result = run_trainer(2, digits_dir, out, "--epochs", "3", "--timeline", "--seed", "3")
    assert result.returncode == 0, result.output
    return result


def test_two_ranks_learn_far_above_chance(two_rank_run: Result) -> None:
    m = two_rank_run.metrics
    assert m["world_size"] == 2
    assert len(m["class_names"]) == 10
    assert m["test_accuracy"] > 0.6  # chance is 0.1
    assert [e["epoch"] for e in m["epochs"]] == [1, 2, 3]
    assert m["epochs"][-1]["train_loss"] < m["epochs"][0]["train_loss"]
    for key in ("images_per_sec", "images_per_sec_per_worker", "wall_seconds"):
        assert m[key] > 0
    assert m["images_per_sec"] == pytest.approx(2 * m["images_per_sec_per_worker"])
    # Every training image is seen once per epoch across the two ranks (DistributedSampler
    # pads the odd one out), so the per-epoch count proves the shards were disjoint.
    assert m["epochs"][0]["images"] == m["dataset"]["num_train"] + m["dataset"]["num_train"] % 2


def test_outputs_are_complete(two_rank_run: Result) -> None:
    out = two_rank_run.output_dir
    saved = torch.load(out / "model.pt", weights_only=True)
    assert saved["model_name"] == "cnn" and saved["input_size"] == 32
    assert saved["class_names"] == two_rank_run.metrics["class_names"]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    timeline = json.loads((out / "timeline.json").read_text())
    assert any("ALLREDUCE" in json.dumps(event) for event in timeline)
    assert [e for e, _ in list_checkpoints(out / "checkpoints")] == [3, 2, 1]
    progress = [line for line in two_rank_run.output.splitlines() if "PROGRESS " in line]
    assert len(progress) == 3  # rank 0 only: one line per epoch, not one per rank


def test_ranks_hold_identical_weights(two_rank_run: Result) -> None:
    digests = two_rank_run.metrics["weights_digest_per_rank"]
    saved = torch.load(two_rank_run.output_dir / "model.pt", weights_only=True)
    assert len(digests) == 2
    assert digests[0] == digests[1] == state_digest(saved["state_dict"])


def test_scorer_agrees_with_metrics(two_rank_run: Result, digits_dir: Path, tmp_path: Path) -> None:
    import sys

    out = tmp_path / "score.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "training.score",
            "--model",
            str(two_rank_run.output_dir / "model.pt"),
            "--data-dir",
            str(digits_dir),
            "--output",
            str(out),
        ],
        cwd=ROOT,
        env=child_env(),
        check=True,
    )
    score = json.loads(out.read_text())
    assert score["num_images"] == two_rank_run.metrics["dataset"]["num_test"]
    assert score["accuracy"] == pytest.approx(
        two_rank_run.metrics["test_accuracy"], abs=1.5 / score["num_images"]
    )
    assert len(score["confusion_matrix"]) == 10
    assert sum(map(sum, score["confusion_matrix"])) == score["num_images"]
    assert set(score["per_class"]["digit_3"]) == {"precision", "recall", "f1", "support"}


def test_killed_job_resumes_at_next_epoch(digits_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = trainer_command(2, digits_dir, out, "--epochs", "4", "--seed", "5")
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    try:
        while not (out / "checkpoints" / "checkpoint-2.pt").exists():
            assert proc.poll() is None, "training ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint-2.pt within 300 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-epoch
        proc.wait()
    assert not (out / "metrics.json").exists()
    k = list_checkpoints(out / "checkpoints")[0][0]
    assert 2 <= k < 4

    result = run_trainer(2, digits_dir, out, "--epochs", "4", "--seed", "5")
    assert result.returncode == 0, result.output
    assert f"resuming from checkpoint-{k}.pt: starting at epoch {k + 1}" in result.output
    progress = [
        json.loads(line.split("PROGRESS ", 1)[1])
        for line in result.output.splitlines()
        if "PROGRESS " in line
    ]
    assert [p["epoch"] for p in progress] == list(range(k + 1, 5))
    assert {p["resumed_from"] for p in progress} == {k}  # what orchestrators report
    m = result.metrics
    assert m["resumed_from_epoch"] == k
    assert [e["epoch"] for e in m["epochs"]] == [1, 2, 3, 4]
    assert m["test_accuracy"] > 0.6


def test_a_rerun_after_the_last_epoch_says_where_it_resumed(tmp_path: Path) -> None:
    """A job killed after its last checkpoint trains nothing when run again, and still
    reports the checkpoint it resumed from (an orchestrator reads it from PROGRESS)."""
    args = ("--epochs", "1", "--batch-size", "16")
    first = run_trainer(1, "synthetic:100", tmp_path / "out", *args)
    assert first.returncode == 0, first.output
    again = run_trainer(1, "synthetic:100", tmp_path / "out", *args)
    assert again.returncode == 0, again.output
    progress = [
        json.loads(line.split("PROGRESS ", 1)[1])
        for line in again.output.splitlines()
        if "PROGRESS " in line
    ]
    assert progress == [{"epochs": 1, "resumed_from": 1}]
    assert again.metrics["resumed_from_epoch"] == 1


def test_gradient_options_keep_ranks_in_step(tmp_path: Path) -> None:
    """fp16 compression and gradient accumulation still leave both ranks identical."""
    result = run_trainer(
        2,
        "synthetic:400",
        tmp_path / "out",
        "--epochs",
        "2",
        "--fp16-allreduce",
        "--backward-passes-per-step",
        "2",
        "--batch-size",
        "16",
    )
    assert result.returncode == 0, result.output
    m = result.metrics
    assert m["weights_digest_per_rank"][0] == m["weights_digest_per_rank"][1]
    assert m["args"]["fp16_allreduce"] is True
    assert m["test_accuracy"] > 0.3  # 10 classes: chance is 0.1


def test_nan_loss_stops_with_clear_error(tmp_path: Path) -> None:
    result = run_trainer(
        1, "synthetic:400", tmp_path / "out", "--epochs", "3", "--lr", "1e12", "--log-every", "2"
    )
    assert result.returncode == 2, result.output
    assert "training loss became nan" in result.output.lower()
    assert "lower --lr" in result.output
    assert not (tmp_path / "out" / "model.pt").exists()


@pytest.mark.parametrize(
    "bad", [["--epochs", "0"], ["--lr", "-1"], ["--lr", "nan"], ["--model", "vgg"]]
)
def test_bad_arguments_refused(bad: list[str], tmp_path: Path) -> None:
    result = run_trainer(1, "synthetic:100", tmp_path / "out", *bad)
    assert result.returncode == 2
    assert bad[0] in result.output


def test_adasum_without_mpi_or_nccl_is_refused(tmp_path: Path, horovodrun: Path) -> None:
    import horovod.torch as hvd

    if hvd.mpi_built():
        pytest.skip("this Horovod has MPI, so Adasum is available and there is nothing to refuse")
    result = run_trainer(2, "synthetic:200", tmp_path / "out", "--adasum", "--epochs", "1")
    assert result.returncode != 0
    assert "--adasum needs Horovod with MPI (CPU) or NCCL (GPU)" in result.output
