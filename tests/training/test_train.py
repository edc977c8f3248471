"""The trainer under both engines' real launchers (horovodrun, torchrun): learning, outputs,
identical ranks, resume after a kill, checkpoints either engine resumes; bad arguments, a
diverging loss and an unusable option refused by name."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    ENGINES,
    ENGINES_REPEATED,
    LOSS_LOG_ARGS,
    ROOT,
    Result,
    child_env,
    first_step_losses,
    run_trainer,
    trainer_command,
)
from training.checkpoint import checkpoint_position, list_checkpoints
from training.distributed import state_digest
from training.models import build_model

pytestmark = pytest.mark.usefixtures("horovodrun")


@pytest.fixture(scope="module")
def two_rank_runs(
    digits_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Result]:
    """An engine's 2-process run on the digits, run once per module when first asked for."""
    done: dict[str, Result] = {}

    def run(engine: str) -> Result:
        if engine not in done:
            out = tmp_path_factory.mktemp(f"{engine}2") / "out"
            args = ("--epochs", "3", "--timeline", "--seed", "3", *LOSS_LOG_ARGS)
            done[engine] = run_trainer(2, digits_dir, out, *args, engine=engine, onnx=True)
            assert done[engine].returncode == 0, done[engine].output
        return done[engine]

    return run


@pytest.fixture(params=ENGINES)
def two_rank_run(request: pytest.FixtureRequest, two_rank_runs: Callable[[str], Result]) -> Result:
    return two_rank_runs(request.param)


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
    # Every training image (the train split less the slice early stopping watches: the digits
    # have no val split) is seen once per epoch across the two ranks (DistributedSampler pads
    # the odd one out), so the per-epoch count proves the shards were disjoint.
    assert m["early_stopping"]["split"] == "train slice"
    trained = m["dataset"]["num_train"] - m["early_stopping"]["images"]
    assert m["epochs"][0]["images"] == trained + trained % 2


def test_both_engines_take_the_same_first_steps(two_rank_runs: Callable[[str], Result]) -> None:
    """The same data, seeds, model and schedule: the first batch's loss depends only on the
    weights rank 0 broadcast and the sampler's order, and each step after it on the average of
    the ranks' gradients, which both engines compute (in another order of additions: equal
    within float rounding, and the log's four decimals). Later steps, and so the accuracy of a
    short run, may drift apart chaotically on some processors: they are not compared."""
    runs = {engine: two_rank_runs(engine) for engine in ENGINES}
    first = {engine: first_step_losses(r.output) for engine, r in runs.items()}
    assert first["ddp"] == pytest.approx(first["horovod"], abs=2e-3), first
    metrics = {engine: r.metrics for engine, r in runs.items()}
    for m in metrics.values():
        assert [e["lr"] for e in m["epochs"]] == [e["lr"] for e in metrics["horovod"]["epochs"]]
        assert set(m) == set(metrics["horovod"])  # the same metrics.json keys


def test_outputs_are_complete(two_rank_run: Result) -> None:
    out = two_rank_run.output_dir
    saved = torch.load(out / "model.pt", weights_only=True)
    assert saved["model_name"] == "cnn" and saved["input_size"] == 32
    assert saved["class_names"] == two_rank_run.metrics["class_names"]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    if two_rank_run.metrics["args"]["engine"] == "horovod":
        timeline = json.loads((out / "timeline.json").read_text())
        assert any("ALLREDUCE" in json.dumps(event) for event in timeline)
    else:
        assert "no timeline is written under --engine ddp" in two_rank_run.output
    assert [e for e, _ in list_checkpoints(out / "checkpoints")] == [3, 2, 1]
    # The stepping optimizer's state, momentum included, so a resumed run goes on as it was.
    state = torch.load(out / "checkpoints" / "checkpoint-3.pt", weights_only=True)
    momenta = state["optimizer"]["state"]
    params = [i for group in state["optimizer"]["param_groups"] for i in group["params"]]
    assert sorted(momenta) == sorted(params)
    # ... as it was after epoch 3, not as it was before the first step
    earlier = torch.load(out / "checkpoints" / "checkpoint-2.pt", weights_only=True)
    for index, entry in momenta.items():
        before = earlier["optimizer"]["state"][index]["momentum_buffer"]
        assert not torch.equal(entry["momentum_buffer"], before), index
    progress = [line for line in two_rank_run.output.splitlines() if "PROGRESS " in line]
    assert len(progress) == 3  # rank 0 only: one line per epoch, not one per rank


def test_model_onnx_is_checked_and_written_beside_model_pt(two_rank_run: Result) -> None:
    """Rank 0 exports model.onnx (any batch size, the classes and the input size in its
    metadata), checked against PyTorch on the test split, both figures in metrics.json."""
    import numpy as np
    import onnxruntime as ort

    from common.atomic import file_md5
    from training.onnx_export import TOLERANCE

    out, metrics = two_rank_run.output_dir, two_rank_run.metrics
    check = metrics["onnx"]
    assert check["images"] == min(128, metrics["dataset"]["num_test"])
    assert check["top1_agreement"] == 1.0
    assert 0 <= check["max_prob_diff"] <= check["tolerance"] == TOLERANCE
    assert metrics["onnx_md5"] == file_md5(out / "model.onnx")
    session = ort.InferenceSession(out / "model.onnx", providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    assert json.loads(meta["classes"]) == metrics["class_names"]
    assert meta["input_size"] == "32"
    (images,) = session.get_inputs()
    assert (images.name, images.type, images.shape[1:]) == ("images", "tensor(float)", [3, 32, 32])
    assert isinstance(images.shape[0], str)  # a named dimension: any batch size
    for batch in (1, 5):
        pixels = np.random.default_rng(batch).integers(0, 256, (batch, 3, 32, 32))
        (logits,) = session.run(None, {"images": pixels.astype(np.float32)})
        assert logits.shape == (batch, len(metrics["class_names"]))


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


def _progress(output: str) -> list[dict[str, object]]:
    return [
        json.loads(line.split("PROGRESS ", 1)[1])
        for line in output.splitlines()
        if "PROGRESS " in line
    ]


def _wait_for(path: Path, proc: subprocess.Popen[bytes], seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, "training ended before it could be killed"
        assert time.monotonic() < deadline, f"no {path.name} within {seconds:.0f} s"
        time.sleep(0.05)


def test_killed_job_resumes_at_next_epoch(digits_dir: Path, tmp_path: Path) -> None:
    """The launcher and every rank killed mid-epoch; the job run again goes on at the epoch
    after the newest checkpoint. Resuming is the trainer's, not the engine's (DDP's is
    test_torchrun_restarts_the_ranks_when_one_dies, and each engine loads the other's
    checkpoints in test_either_engine_resumes_the_others_checkpoint)."""
    engine = "horovod"
    out = tmp_path / "out"
    cmd = trainer_command(2, digits_dir, out, "--epochs", "4", "--seed", "5", engine=engine)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait_for(out / "checkpoints" / "checkpoint-2.pt", proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-epoch
        proc.wait()
    assert not (out / "metrics.json").exists()
    k = list_checkpoints(out / "checkpoints")[0][0]
    assert 2 <= k < 4

    result = run_trainer(2, digits_dir, out, "--epochs", "4", "--seed", "5", engine=engine)
    assert result.returncode == 0, result.output
    assert f"resuming from checkpoint-{k}.pt: starting at epoch {k + 1}" in result.output
    progress = _progress(result.output)
    assert [p["epoch"] for p in progress] == list(range(k + 1, 5))
    assert {p["resumed_from"] for p in progress} == {k}  # what orchestrators report
    m = result.metrics
    assert m["resumed_from_epoch"] == k
    assert [e["epoch"] for e in m["epochs"]] == [1, 2, 3, 4]
    assert m["test_accuracy"] > 0.6


def test_a_stop_request_ends_training_at_a_checkpoint_the_next_run_resumes(
    tmp_path: Path,
) -> None:
    """The budget's stop: a file the orchestrator writes while the job trains. Both ranks stop
    together at the next checkpoint, with status 0 (no failure for Batch to retry) and no
    model; an attempt started while the request stands resumes from that checkpoint and stops
    again before training anything."""
    out, stop = tmp_path / "out", tmp_path / "share" / "stop-requests" / "train-r1"
    args = ("--epochs", "5", "--batch-size", "16", "--seed", "3", "--stop-file", str(stop))
    cmd = trainer_command(2, "synthetic:400", out, *args)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the request arrives while epoch 2 trains
        lines.append(line)
        if "PROGRESS " in line and '"epoch": 1,' in line:
            stop.parent.mkdir(parents=True)
            stop.write_text("budget\n")
    assert proc.wait(timeout=300) == 0, "".join(lines)
    progress = _progress("".join(lines))
    (stopped,) = [p for p in progress if p.get("stopped")]
    k = stopped["epochs_done"]
    assert isinstance(k, int) and 1 <= k < 5 and stopped["stopped"] == "requested"
    assert [p["epoch"] for p in progress if "epoch" in p] == list(range(1, k + 1))
    assert not (out / "model.pt").exists() and not (out / "metrics.json").exists()
    assert list_checkpoints(out / "checkpoints")[0][0] == k

    again = run_trainer(1, "synthetic:400", out, *args)
    assert again.returncode == 0, again.output
    assert f"resuming from checkpoint-{k}.pt: starting at epoch {k + 1}" in again.output
    assert _progress(again.output) == [
        {"stopped": "requested", "epochs": 5, "epochs_done": k, "resumed_from": k}
    ]
    assert not (out / "model.pt").exists()


def _batch_losses(output: str, epoch: int) -> dict[int, str]:
    """Rank 0's running mean loss after each batch of ``epoch`` (--log-every 1), as logged."""
    found = re.findall(rf"epoch {epoch} batch (\d+): mean loss so far ([0-9.]+)", output)
    return {int(batch): loss for batch, loss in found}


def _newest_inside_an_epoch(checkpoints: Path) -> tuple[int, int] | None:
    """(epoch, batches done) of the newest checkpoint when it is one inside an epoch."""
    found = list_checkpoints(checkpoints)
    position = checkpoint_position(found[0][1]) if found else None
    if position is None or position[1] == 0:
        return None
    return position[0] + 1, position[1]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_kill_inside_an_epoch_resumes_at_the_batch_after_its_checkpoint(
    engine: str, tmp_path: Path
) -> None:
    """Checkpoints by time (--checkpoint-minutes) land inside epochs; the job killed after one
    goes on at the next batch: the same batch, on the same weights, optimizer state, random
    streams and sums of the epoch so far, as the killed attempt trained there. So both log the
    same running mean loss at that batch (2 ranks: each skips exactly its own share)."""
    out = tmp_path / "out"
    args = ("--epochs", "1", "--batch-size", "8", "--seed", "4", *LOSS_LOG_ARGS)
    args += ("--checkpoint-minutes", "0.001")  # due at every agreement point (~2 s)
    log_path = tmp_path / "first.txt"
    cmd = trainer_command(2, "synthetic:320", out, *args, engine=engine)
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=child_env(),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, "training ended before a checkpoint inside an epoch"
            assert time.monotonic() < deadline, "no checkpoint inside an epoch within 300 s"
            at = _newest_inside_an_epoch(out / "checkpoints")
            if at and at[1] + 2 in _batch_losses(log_path.read_text(errors="replace"), at[0]):
                break
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank
        proc.wait()
    at = _newest_inside_an_epoch(out / "checkpoints")
    assert at is not None
    epoch, done = at
    first = _batch_losses(log_path.read_text(errors="replace"), epoch)
    assert done + 1 in first, "the killed attempt did not log the batch after its checkpoint"

    second = run_trainer(2, "synthetic:320", out, *args, engine=engine)
    assert second.returncode == 0, second.output
    assert (
        f"resuming from checkpoint-{epoch}-{done}.pt (written by time): epoch {epoch} goes on "
        f"at batch {done + 1}"
    ) in second.output
    again = _batch_losses(second.output, epoch)
    assert min(again) == done + 1  # no batch of the epoch trained twice
    assert again[done + 1] == first[done + 1]
    m = second.metrics
    assert [e["epoch"] for e in m["epochs"]] == [1]
    # No val split: the epoch trains the train images less the slice early stopping holds out
    # (the resumed order is the held-out sampler's), every rank an equal share of them.
    watched = m["early_stopping"]
    assert watched["split"] == "train slice", watched
    trained = m["dataset"]["num_train"] - watched["images"]
    full = -(-trained // 2) * 2  # DistributedSampler pads to equal shares
    assert m["epochs"][epoch - 1]["images"] == full  # the sums before the kill carried over
    resumed = [p for p in _progress(second.output) if p["epoch"] == epoch]
    assert resumed[0]["resumed_from"] == epoch - 1 and resumed[0]["resumed_batch"] == done


def _rank_pids(launcher: int, rank: int) -> list[int]:
    """The processes below ``launcher`` whose environment says they are ``rank``."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = int(status.read_text().split("PPid:")[1].split()[0])
            environ = (status.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            found.append(int(status.parent.name))
    return found


def test_torchrun_restarts_the_ranks_when_one_dies(digits_dir: Path, tmp_path: Path) -> None:
    """One rank killed after epoch k: torchrun (--max-restarts) starts every rank again in the
    same job, and they go on from checkpoint k at epoch k+1."""
    out = tmp_path / "out"
    cmd = trainer_command(2, digits_dir, out, "--epochs", "4", "--seed", "5", engine="ddp")
    cmd[1:1] = ["--max-restarts", "1"]
    log_path = tmp_path / "log.txt"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=child_env(), stdout=log_file, stderr=subprocess.STDOUT
        )
        try:
            _wait_for(out / "checkpoints" / "checkpoint-2.pt", proc)
            (victim,) = _rank_pids(proc.pid, 1)
            os.kill(victim, signal.SIGKILL)
            assert proc.wait(timeout=300) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    output = log_path.read_text()
    k = int(output.split("resuming from checkpoint-")[1].split(".pt")[0])
    assert 2 <= k < 4
    assert f"resuming from checkpoint-{k}.pt: starting at epoch {k + 1}" in output
    resumed = [p for p in _progress(output) if p["resumed_from"] is not None]
    assert [p["epoch"] for p in resumed] == list(range(k + 1, 5))
    m = Result(0, output, out).metrics
    assert m["resumed_from_epoch"] == k and m["test_accuracy"] > 0.6
    assert m["weights_digest_per_rank"][0] == m["weights_digest_per_rank"][1]


@pytest.mark.parametrize(
    ("first", "then"),
    # One direction proves the format is the engines' own; the other is a repeat (slow).
    [("horovod", "ddp"), pytest.param("ddp", "horovod", marks=pytest.mark.slow)],
)
def test_either_engine_resumes_the_others_checkpoint(first: str, then: str, tmp_path: Path) -> None:
    args = ("--batch-size", "16", "--seed", "2")
    out = tmp_path / "out"
    before = run_trainer(1, "synthetic:200", out, "--epochs", "1", *args, engine=first)
    assert before.returncode == 0, before.output
    saved = torch.load(out / "checkpoints" / "checkpoint-1.pt", weights_only=True)
    after = run_trainer(2, "synthetic:200", out, "--epochs", "2", *args, engine=then)
    assert after.returncode == 0, after.output
    assert "resuming from checkpoint-1.pt: starting at epoch 2" in after.output
    m = after.metrics
    assert m["args"]["engine"] == then and m["world_size"] == 2
    assert [e["epoch"] for e in m["epochs"]] == [1, 2]
    assert m["epochs"][0] == saved["history"][0]  # epoch 1 as the other engine recorded it


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
    # --no-onnx (run_trainer's default): model.pt and no model.onnx, nothing recorded of one.
    assert (tmp_path / "out" / "model.pt").is_file()
    assert not (tmp_path / "out" / "model.onnx").exists()
    assert again.metrics["onnx"] is None and again.metrics["onnx_md5"] is None


@pytest.mark.parametrize("engine", ENGINES)
def test_gradient_options_keep_ranks_in_step(engine: str, tmp_path: Path) -> None:
    """fp16 compression and gradient accumulation (DDP: no_sync) still leave both ranks
    identical."""
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
        engine=engine,
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


@pytest.mark.parametrize(
    ("engine", "launcher_np", "extra", "named"),
    [
        ("ddp", 1, ["--adasum"], "--adasum is Horovod's"),
        ("ddp", 1, ["--sync-batchnorm"], "--sync-batchnorm needs GPUs"),
        ("horovod", 1, ["--sync-batchnorm"], "--sync-batchnorm needs --engine ddp"),
        ("horovod", 1, ["--engine", "mpi"], "--engine"),
    ],
)
def test_options_an_engine_cannot_honour_are_refused(
    engine: str, launcher_np: int, extra: list[str], named: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = run_trainer(launcher_np, "synthetic:100", out, "--epochs", "1", *extra, engine=engine)
    assert result.returncode != 0
    assert named in result.output
    assert not (out / "model.pt").exists()


@pytest.mark.parametrize(("launcher", "engine"), [("horovod", "ddp"), ("ddp", "horovod")])
def test_an_engine_started_by_the_other_launcher_is_refused(
    launcher: str, engine: str, tmp_path: Path
) -> None:
    """Two ranks that each believed they were alone would both write every output."""
    out = tmp_path / "out"
    cmd = trainer_command(2, "synthetic:100", out, "--epochs", "1", engine=launcher)
    cmd += ["--engine", engine]  # the last one given wins
    proc = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.returncode != 0
    assert f"--engine {engine} was started by" in proc.stdout
    assert not (out / "model.pt").exists()


def test_ddp_needs_no_horovod(tmp_path: Path) -> None:
    """A machine without the Horovod build trains with --engine ddp: horovod is imported only
    by the engine that uses it."""
    blocker = tmp_path / "blocker" / "horovod"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('no Horovod build here')\n")
    env = child_env()
    env["PYTHONPATH"] = f"{blocker.parent}{os.pathsep}{env['PYTHONPATH']}"
    out = tmp_path / "out"
    cmd = trainer_command(1, "synthetic:100", out, "--epochs", "1", engine="ddp")
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.returncode == 0, proc.stdout
    assert (out / "model.pt").exists()
    horovod = subprocess.run(
        trainer_command(1, "synthetic:100", tmp_path / "h", "--epochs", "1"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert "no Horovod build here" in horovod.stdout  # the blocker does block


@pytest.fixture(scope="module")
def digit_versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """v1: real digits without digit_3 (so every later class sits one index lower than in v2);
    v2: the same with digit_3; and v1's model.pt, trained one epoch."""
    import shutil

    from imagedata.make_images import write_digits

    root = tmp_path_factory.mktemp("versions")
    write_digits(root / "v2", test_fraction=0.25, seed=0, per_class=30)
    shutil.copytree(root / "v2", root / "v1")
    for split in ("train", "test"):
        shutil.rmtree(root / "v1" / split / "digit_3")
    first = run_trainer(1, root / "v1", root / "o1", "--epochs", "1", "--batch-size", "16")
    assert first.returncode == 0, first.output
    return root / "v1", root / "v2", root / "o1" / "model.pt"


@pytest.mark.parametrize("engine", ENGINES_REPEATED)
def test_init_from_carries_the_shared_classes_to_every_rank(
    engine: str, digit_versions: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """A data set with one class more than the model it starts from: rank 0 reads the file,
    every rank trains from the same carried weights (the trainer compares the ranks' weights
    at the end), and the classes both know keep their classifier rows under their new index.
    At a rate of 1e-9 the weights barely move, so what was carried can be compared."""
    _v1, v2, model_pt = digit_versions
    result = run_trainer(
        2,
        v2,
        tmp_path / "out",
        *("--init-from", str(model_pt), "--init-from-run", "run-1"),
        *("--epochs", "1", "--batch-size", "16", "--lr", "1e-9"),
        engine=engine,
    )
    assert result.returncode == 0, result.output
    m = result.metrics
    assert m["weights_digest_per_rank"][0] == m["weights_digest_per_rank"][1]
    old = torch.load(model_pt, weights_only=True)
    started = m["init_from"]
    assert started["source"] == str(model_pt) and started["run_id"] == "run-1"
    assert started["classes_new"] == ["digit_3"] and started["classes_dropped"] == []
    assert started["classes_carried"] == old["class_names"] and len(old["class_names"]) == 9
    new = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert new["class_names"] == [f"digit_{i}" for i in range(10)]
    parameters = {n for n, p in build_model("cnn", 10).named_parameters()}
    for key in parameters - {"1.head.3.weight", "1.head.3.bias"}:
        assert torch.allclose(new["state_dict"][key], old["state_dict"][key], atol=1e-6), key
    for key in ("1.head.3.weight", "1.head.3.bias"):
        for name in old["class_names"]:
            was, now = old["class_names"].index(name), new["class_names"].index(name)
            assert torch.allclose(
                new["state_dict"][key][now], old["state_dict"][key][was], atol=1e-6
            ), (key, name)


@pytest.mark.parametrize("engine", ENGINES_REPEATED)
def test_a_refused_init_from_stops_every_rank_before_training(
    engine: str, digit_versions: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """Rank 0 finds the file cut short; every rank stops with its error (none waits for a
    broadcast that never comes), before a step is trained or a file written."""
    _v1, v2, model_pt = digit_versions
    cut = tmp_path / "cut.pt"
    cut.write_bytes(model_pt.read_bytes()[:4000])
    out = tmp_path / "out"
    result = run_trainer(2, v2, out, "--init-from", str(cut), "--epochs", "1", engine=engine)
    assert result.returncode != 0, result.output
    for rank in (0, 1):
        assert f"[rank {rank}] error: --init-from {cut} cannot be read" in result.output
    assert "PROGRESS" not in result.output
    assert not (out / "model.pt").exists() and not list_checkpoints(out / "checkpoints")
