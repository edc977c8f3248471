"""The retrain flow on the local target: Azurite for Blob, real Prefect server, real horovodrun."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from backends.blob import container_client
from backends.local.ports import free_port
from backends.local.processes import read_record
from bench.pipeline import analyse
from flows.retrain import retrain
from flows.steps import ALWAYS, NAMES
from imagedata.make_images import write_digits
from imagedata.webdataset import pack_folders
from registry.layout import champion_blob, last_run_blob
from servers.gateway import serve
from tests.conftest import ROOT
from tests.isolated import label_with_onnxruntime_alone
from tests.pipeline_helpers import flow_run_logs, make_config, seed, task_runs_and_artifacts
from tests.reliability import report
from training.checkpoint import FINISHED

pytestmark = pytest.mark.usefixtures("prefect_api", "horovodrun")


@pytest.fixture(autouse=True)
def _storage(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)


@pytest.fixture(scope="module")
def digits_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits-src")
    write_digits(root, test_fraction=0.25, seed=0, per_class=60)
    return root


def run(config: Any) -> tuple[Any, dict[str, Any], list[Any]]:
    state = retrain(config=config, return_state=True)
    task_runs, artifacts = task_runs_and_artifacts(state.state_details.flow_run_id)
    return state, task_runs, artifacts


def test_end_to_end_then_rerun(
    tmp_path: Path, digits_source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    # Two ranks, as configs/local.yaml trains: the one flow test of the distributed job itself.
    config = make_config(
        tmp_path, f"output.links_url=http://127.0.0.1:{port}", "pool.processes_per_node=2"
    )
    seed(config, digits_source)
    # The outputs gateway, as `python -m cli.models serve` runs it: the run's links open.
    gateway = serve(container_client(config.output, create=True), "", "127.0.0.1", port)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    state, task_runs, artifacts = run(config)
    assert state.is_completed(), state.message
    result = state.result()
    assert result["accuracy"] > 0.5 and result["promoted"] is True
    # A data root without versions (train/ and test/ directly below it) is trained whole.
    assert result["data"]["version"] is None and result["data"]["prefix"] == config.data.prefix

    outputs = container_client(config.output)
    prefix = f"runs/{result['run_id']}"
    names = {b.name[len(prefix) + 1 :] for b in outputs.list_blobs(name_starts_with=prefix + "/")}
    for expected in (
        "model.pt",
        "model.onnx",
        "metrics.json",
        "score.json",
        "timeline.json",
        "promotion.json",
        "logs/stdout.txt",
        "data_docs/index.html",
    ):
        assert expected in names, f"{expected} missing from {sorted(names)}"
    assert any(n.startswith("tensorboard/events.out.tfevents") for n in names)
    score = json.loads(outputs.download_blob(f"{prefix}/score.json").readall())
    metrics = json.loads(outputs.download_blob(f"{prefix}/metrics.json").readall())
    assert score["accuracy"] == pytest.approx(
        metrics["test_accuracy"], abs=1.5 / score["num_images"]
    )
    assert metrics["world_size"] == 2
    # Staging packed the images; the trainer read the shards, not the loose files.
    staged = {s["step"]: s for s in result["steps"]}["stage-data"]["details"]
    assert staged["shards"]["action"] == "packed"
    assert staged["shards"]["images"] == metrics["dataset"]["num_train"] + score["num_images"]
    assert metrics["dataset"]["kind"] == "image-folders (packed shards)"
    champion = json.loads(outputs.download_blob(champion_blob("", config.data.root)).readall())
    assert champion["run_id"] == result["run_id"]

    keys = {a.key for a in artifacts if a.key}
    assert {"data-gate", "retrain-summary", "per-class-metrics", "training-progress"} <= keys
    assert {"output-model-pt", "output-metrics-json", "output-score-json"} <= keys
    gate_report = next(a for a in artifacts if a.key == "data-gate").data
    assert "Every expectation was met." in gate_report and "| table |" not in gate_report
    progress = [a for a in artifacts if a.key == "training-progress"]
    assert progress[0].data == 100.0
    summary = next(a for a in artifacts if a.key == "retrain-summary").data
    assert "| stage-data | ran |" in summary and "promoted" in summary
    # The pictures are in the summary itself and in the outputs, the same bytes.
    for name, title in (("curves", "loss and accuracy per epoch"), ("confusion", "confusion")):
        png = outputs.download_blob(f"{prefix}/charts/{name}.png").readall()
        assert png.startswith(b"\x89PNG") and title in summary
        assert f"(data:image/png;base64,{base64.b64encode(png).decode()})" in summary
        # Each is an artifact of its own too: an image of the copy the gateway serves.
        chart = next(a for a in artifacts if a.key == f"chart-{name}")
        assert chart.type == "image" and chart.data.endswith(f"/{prefix}/charts/{name}.png")
        with urllib.request.urlopen(chart.data, timeout=60) as response:
            assert (response.headers["Content-Type"], response.read()) == ("image/png", png)
    links = [a.data for a in artifacts if isinstance(a.data, str) and a.data.startswith("[")]
    for name in ("model.pt", "metrics.json", "score.json", "logs/stdout.txt"):
        link = next((x for x in links if f"{prefix}/{name})" in x), None)
        assert link is not None, f"no link to {name}"
        # Every link opens, with no signature in it, and gives the stored bytes.
        url = re.search(r"\((http://[^)]+)\)", link)
        assert url and "sig=" not in url.group(1)
        with urllib.request.urlopen(url.group(1), timeout=60) as response:
            assert response.read() == outputs.download_blob(f"{prefix}/{name}").readall()
    docs = re.search(r"\((http://[^)]+/data_docs/index\.html)\)", gate_report)
    assert docs, gate_report
    with urllib.request.urlopen(docs.group(1), timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/html")
        page = response.read().decode()
    # The Data Docs carry their styles and scripts: nothing comes from a CDN.
    assert "static/vendor/jquery/dist/jquery.min.js" in page
    assert not re.findall(r'<(?:script|link)[^>]*(?:src|href)="https?://', page)
    assert result["outputs"] == f"http://127.0.0.1:{port}/{prefix}/"
    # The model as ONNX, fetched through the gateway, labels the test split with onnxruntime
    # alone (docs/onnx.md's example, in a process that cannot import torch or this project)
    # exactly as well as the trainer measured with PyTorch.
    with urllib.request.urlopen(f"{result['outputs']}model.onnx", timeout=60) as response:
        assert response.headers["Content-Type"] == "application/octet-stream"
        (tmp_path / "model.onnx").write_bytes(response.read())
    assert metrics["onnx"]["top1_agreement"] == 1.0
    alone = label_with_onnxruntime_alone(
        tmp_path / "model.onnx", digits_source / "test", tmp_path / "alone"
    )
    assert alone["images"] == metrics["dataset"]["num_test"]
    assert alone["right"] / alone["images"] == metrics["test_accuracy"]
    gateway.shutdown()

    # Steps 2 to 5 ran concurrently: each of the short ones started while staging, the long
    # one, was still running (the short ones may end before the next starts on a busy machine).
    parallel = [
        task_runs[s] for s in ("upload-scripts", "stage-data", "build-image", "ensure-pool")
    ]
    staging = task_runs["stage-data"]
    assert all(r.start_time < staging.end_time for r in parallel)
    assert task_runs["validate-data"].end_time <= min(r.start_time for r in parallel)
    assert task_runs["release-pool"].state.is_completed()
    # The pipeline benchmark reads this run's critical path from the same API: the steps
    # declared in flows/steps.py are exactly the flow's, in the order the run recorded them
    # (the report is the run's last task, and records no step), and the path fits inside the
    # wall time.
    assert [s["step"] for s in result["steps"]] == [n for n in ALWAYS if n != "report"]
    timing = analyse(state.state_details.flow_run_id)
    assert list(timing["steps"]) == list(ALWAYS) and set(ALWAYS) < set(NAMES)
    assert timing["critical_path"][0] == "validate-data" and timing["critical_path"][-1] == "report"
    assert 0 < timing["critical_path_seconds"] <= timing["wall_seconds"]
    pool = json.loads((config.work_dir / "pools" / config.pool.id / "pool.json").read_text())
    assert pool["state"] == "released"

    # Run again with nothing changed: up to date, it ends after the gate and provisions,
    # stages, trains and scores nothing.
    pool_file = config.work_dir / "pools" / config.pool.id / "pool.json"
    pool_before = pool_file.read_bytes()
    same, same_runs, same_artifacts = run(config)
    assert same.is_completed(), same.message
    assert same.result()["up_to_date"] is True
    assert set(same_runs) == {"validate-data", "fit-to-data", "check-up-to-date", "report"}
    assert pool_file.read_bytes() == pool_before  # the pool was not even looked at
    summary = next(a for a in same_artifacts if a.key == "retrain-summary").data
    assert "up to date" in summary and result["run_id"] in summary
    assert "| epoch |" not in summary and "images/s" not in summary

    # One epoch, under the other engine (DDP through torchrun, from the same task spec), and a
    # margin no challenger can clear: the settings changed, so it trains (and says why); it
    # skips the scripts, data and image; it is not promoted, and the champion stays.
    second = config.model_copy(
        update={
            "training": dataclasses.replace(config.training, epochs=1, engine="ddp"),
            "promotion": config.promotion.model_copy(update={"min_improvement": 1.0}),
        }
    )
    state2, runs2, artifacts2 = run(second)
    assert state2.is_completed(), state2.message
    steps = {s["step"]: s for s in state2.result()["steps"]}
    assert steps["check-up-to-date"]["details"]["up_to_date"] is False
    assert "run-training" in runs2
    assert steps["upload-scripts"]["status"] == "skipped"
    assert steps["stage-data"]["status"] == "skipped"
    assert steps["stage-data"]["details"]["downloaded"] == 0
    assert steps["stage-data"]["details"]["shards"]["action"] == "unchanged"
    # The gate read no image again: every blob's description came from its cache, and the
    # verdict on the same manifest and rules came from the first run's (the suites ran once).
    gate = steps["validate-data"]["details"]
    assert gate["read_from_cache"] == gate["images"] > 0
    assert gate["verdict_reused"] is True
    first_gate = {s["step"]: s for s in result["steps"]}["validate-data"]["details"]
    assert first_gate["verdict_reused"] is False
    reused_report = next(a for a in artifacts2 if a.key == "data-gate").data
    assert "was judged before: this is that verdict" in reused_report
    assert "judged before" not in gate_report
    assert steps["build-image"]["status"] == "skipped"
    assert state2.result()["promoted"] is False
    assert f"against the champion's {result['accuracy']:.4f}" in state2.result()["reason"]
    champion = json.loads(outputs.download_blob(champion_blob("", config.data.root)).readall())
    assert champion["run_id"] == result["run_id"]
    ddp_prefix = f"runs/{state2.result()['run_id']}"
    ddp = json.loads(outputs.download_blob(f"{ddp_prefix}/metrics.json").readall())
    assert ddp["args"]["engine"] == "ddp" and ddp["world_size"] == 2
    assert len(set(ddp["weights_digest_per_rank"])) == 1
    stdout = outputs.download_blob(f"{ddp_prefix}/logs/stdout.txt").readall().decode()
    assert "(torchrun)" in stdout and "engine: ddp" in stdout
    progress = [a for a in artifacts2 if a.key == "training-progress"]
    assert progress[0].data == 100.0

    # force trains the unchanged config again, from scratch (no finished checkpoint resumed),
    # and becomes the run the next one compares with.
    forced = retrain(config=second, force=True, return_state=True)
    assert forced.is_completed(), forced.message
    steps = {s["step"]: s for s in forced.result()["steps"]}
    assert steps["run-training"]["details"]["epochs_run"] == [1]
    assert steps["run-training"]["details"]["resumed_from_epoch"] is None
    last = json.loads(outputs.download_blob(last_run_blob("", config.data.root)).readall())
    assert last["run_id"] == forced.result()["run_id"]
    # What the trainings left in the NFS folder's checkpoints/: the last one's folder only
    # (a forced run's key is its own; each training removes the finished ones' folders).
    # Merged from tests/reliability/test_nfs_checkpoints.py, which now runs in
    # `make reliability`.
    forced_key = steps["run-training"]["details"]["checkpoint_key"]
    checkpoints = config.nfs.local_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [forced_key]
    assert (checkpoints / forced_key / FINISHED).is_file()

    # The forced run's inputs again: up to date with it, and the model in use is still the
    # first run's, the champion (before, the summary, the command line and `list` named the
    # model of the run matched, which was not promoted). Merged from tests/flows/
    # test_champions.py, whose own three runs told the same story.
    trained_run, champion_run = forced.result()["run_id"], result["run_id"]
    third = retrain(config=second, return_state=True)
    assert third.is_completed(), third.message
    latest = third.result()
    assert latest["up_to_date"] is True and latest["matched_run"] == trained_run
    assert latest["champion_run"] == champion_run
    assert latest["accuracy"] == pytest.approx(result["accuracy"])
    assert latest["outputs"].endswith(f"/runs/{champion_run}/")
    _, third_artifacts = task_runs_and_artifacts(third.state_details.flow_run_id)
    summary = next(a for a in third_artifacts if a.key == "retrain-summary").data
    root = config.data.root.where
    assert f"The model in use is the champion of {root}: [runs/{champion_run}/model.pt]" in summary
    assert f"Run {trained_run}, whose data, code and settings these are, was not promoted" in (
        summary
    )
    from cli.models import main as models

    where = ["--set", f"output.container={config.output.container}"]
    where += ["--set", f"data.container={config.data.container}"]
    capsys.readouterr()
    assert models(["--config", str(ROOT / "configs" / "local.yaml"), *where, "list"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[champion_run].endswith("<- champion")
    assert rows[latest["run_id"]].split()[1] == root
    assert (
        f"up to date: nothing trained: the data, code and settings of run {trained_run}"
        in (rows[latest["run_id"]])
    )
    assert "<- champion" not in rows[trained_run] + rows[latest["run_id"]]


def _gate_case(case: str, source: Path) -> str:
    if case == "missing-class":
        shutil.rmtree(source / "test" / "digit_3")
        return "expect_column_values_to_be_between"
    if case == "corrupt-images":
        for i, target in enumerate(sorted((source / "train" / "digit_1").iterdir())[:3]):
            target.write_bytes(b"not an image" if i else b"")
        return "readable"
    first = sorted((source / "train" / "digit_2").iterdir())[0]
    shutil.copy(first, source / "test" / "digit_2" / "leaked.png")
    return "leak"


def test_a_dataset_uploaded_as_tar_shards_is_gated_staged_and_trained_packed(
    tmp_path: Path, digits_source: Path
) -> None:
    """The README's advice for large datasets, end to end: WebDataset shards are gated by
    their samples, staged as the few blobs they are, and packed for the trainer and the scorer
    from the tars themselves: no image is ever a file of its own on the NFS server."""
    packed = tmp_path / "packed"
    shards = pack_folders(digits_source, packed, max_bytes=40_000)
    images = sum(1 for p in digits_source.rglob("*.png"))
    config = make_config(tmp_path, "training.epochs=1")  # what is read, not how well it learns
    assert seed(config, packed) == sum(shards.values())
    state, _, artifacts = run(config)
    assert state.is_completed(), state.message
    result = state.result()
    gate = next(a for a in artifacts if a.key == "data-gate").data
    assert "Every expectation was met." in gate and f"{images} images" in gate
    staged = {s["step"]: s for s in result["steps"]}["stage-data"]["details"]
    assert staged["shards"]["action"] == "packed" and staged["shards"]["images"] == images
    outputs = container_client(config.output)
    prefix = f"runs/{result['run_id']}"
    metrics = json.loads(outputs.download_blob(f"{prefix}/metrics.json").readall())
    score = json.loads(outputs.download_blob(f"{prefix}/score.json").readall())
    assert metrics["dataset"]["kind"] == "image-folders (packed shards)"
    assert metrics["dataset"]["num_train"] + score["num_images"] == images
    on_nfs = [p for p in (config.nfs.local_dir / "data").rglob("*") if p.is_file()]
    assert not [p for p in on_nfs if p.suffix == ".png"]
    assert len([p for p in on_nfs if p.suffix == ".tar"]) == sum(shards.values())


@pytest.mark.parametrize(
    "case",
    # One refusal in `make test`: the flow's path is the same for every rule (the rules
    # themselves: tests/gate/); the other two are repeats of the scenario (slow).
    [
        "missing-class",
        pytest.param("corrupt-images", marks=pytest.mark.slow),
        pytest.param("leakage", marks=pytest.mark.slow),
    ],
)
def test_gate_stops_before_provisioning(case: str, tmp_path: Path, digits_source: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(digits_source, source)
    expected = _gate_case(case, source)
    config = make_config(tmp_path)
    seed(config, source)
    state, task_runs, artifacts = run(config)
    assert state.is_failed()
    # The run ends with the gate's own message, named as in its artifact, and its log holds
    # that message and no traceback (the gate's refusal is not an error in the code).
    assert state.message.startswith("data gate failed, nothing was provisioned: "), state.message
    assert expected in state.message
    ended = f"Finished in state Failed('{state.message[:60]}"
    deadline = time.monotonic() + 30  # the flow's last line reaches the API in the next batch
    while ended not in (logs := flow_run_logs(state.state_details.flow_run_id)):
        assert time.monotonic() < deadline, logs
        time.sleep(0.5)
    assert "Traceback" not in logs and "NoneType: None" not in logs, logs
    gate = next(a for a in artifacts if a.key == "data-gate").data
    assert "FAILED" in gate and expected in gate
    for step in ("upload-scripts", "stage-data", "build-image", "ensure-pool", "run-training"):
        assert step not in task_runs, f"{step} ran after a failed gate"
    assert not (config.nfs.local_dir / "data").exists()
    assert not (config.work_dir / "pools" / config.pool.id / "tasks").exists()
    # No pool was made, or it is released (what tests/reliability/test_orchestrator.py's
    # failure in the data gate checked too).
    pool = config.work_dir / "pools" / config.pool.id / "pool.json"
    assert not pool.exists() or json.loads(pool.read_text())["state"] == "released"


def test_a_run_over_a_root_mixing_loose_files_and_versions_fails_at_the_gate_and_says_so(
    tmp_path: Path, digits_source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the documented path left before versions were one concept: the seeded data loose
    under the root and a new version beside it. The run fails at the gate with both named,
    before anything is provisioned, and `list` says where and why."""
    from backends.blob import upload_directory
    from cli.models import main as models

    config = make_config(tmp_path)
    seed(config, digits_source)
    container = container_client(config.data)
    upload_directory(container, digits_source, f"{config.data.prefix}/v2")
    container.upload_blob(f"{config.data.prefix}/v2/_SUCCESS", b"")
    state, task_runs, _ = run(config)
    assert state.is_failed()
    assert "holds both loose files (test/, train/) and data versions (v2)" in state.message
    assert set(task_runs) <= {"validate-data", "release-pool"}  # released in its finally
    assert not (config.work_dir / "pools" / config.pool.id / "tasks").exists()
    where = ["--set", f"output.container={config.output.container}"]
    assert models(["--config", str(ROOT / "configs" / "local.yaml"), *where, "list"]) == 0
    (row,) = capsys.readouterr().out.splitlines()[1:]
    assert "newest (not chosen)" in row
    assert "failed at validate-data: DataVersionError: data root" in row


def test_killed_training_attempt_is_retried_and_resumes(
    tmp_path: Path, digits_source: Path
) -> None:
    config = make_config(tmp_path, "training.epochs=4", "retries.backoff_seconds=0")
    seed(config, digits_source)
    box: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: box.update(state=retrain(config=config, return_state=True))
    )
    worker.start()
    running = config.work_dir / "pools" / config.pool.id / "running"
    deadline = time.monotonic() + 600
    killed = False
    while worker.is_alive() and not killed and time.monotonic() < deadline:
        ckpts = list((config.nfs.local_dir / "checkpoints").glob("*/checkpoint-1.pt"))
        pidfiles = list(running.glob("train-*.pid")) if running.exists() else []
        record = read_record(pidfiles[0]) if pidfiles else None
        if ckpts and record:
            os.killpg(record.pid, signal.SIGKILL)  # the whole job, mid-run
            killed = True
        time.sleep(0.05)
    worker.join(timeout=600)
    assert killed, "the training task finished before it could be killed"
    state = box["state"]
    assert state.is_completed(), state.message
    steps = {s["step"]: s for s in state.result()["steps"]}
    assert steps["run-training"]["details"]["resumed_from_epoch"] >= 1
    assert 1 not in steps["run-training"]["details"]["epochs_run"]
    task_runs, _ = task_runs_and_artifacts(state.state_details.flow_run_id)
    assert task_runs["run-training"].run_count == 2


def test_a_stopped_rank_ends_the_attempt_by_its_deadline_and_the_retry_resumes(
    tmp_path: Path, digits_source: Path
) -> None:
    """A rank stuck in a collective (SIGSTOP: a frozen node) hangs the other one in its
    allreduce; no progress for the bound after epoch 1 ends the attempt with that reason, and
    the retry resumes from the checkpoint. The bound is kept small, and under Gloo's own
    30-second timeout, so it is the deadline that ends the attempt."""
    import psutil

    config = make_config(
        tmp_path,
        "training.epochs=5",
        "pool.processes_per_node=2",
        "retries.backoff_seconds=0",
        "retries.stall_floor_seconds=8",
        "retries.stall_factor=2",
        "retries.stall_first_epoch_seconds=300",
    )
    seed(config, digits_source)
    box: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: box.update(state=retrain(config=config, return_state=True))
    )
    worker.start()
    running = config.work_dir / "pools" / config.pool.id / "running"
    deadline = time.monotonic() + 600
    stopped: psutil.Process | None = None
    while worker.is_alive() and stopped is None and time.monotonic() < deadline:
        # Epoch 1 reported (its PROGRESS line in the task's log) and checkpointed.
        logs = (config.work_dir / "pools" / config.pool.id / "tasks").glob("train-*/stdout.txt")
        reported = any('"epoch": 1,' in log.read_text(errors="replace") for log in logs)
        ckpts = list((config.nfs.local_dir / "checkpoints").glob("*/checkpoint-1.pt"))
        pidfiles = list(running.glob("train-*.pid")) if running.exists() else []
        record = read_record(pidfiles[0]) if pidfiles else None
        if reported and ckpts and record:
            with contextlib.suppress(psutil.NoSuchProcess):
                for proc in psutil.Process(record.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if proc.environ().get("HOROVOD_RANK") == "1":
                            proc.send_signal(signal.SIGSTOP)  # rank 1 freezes mid-epoch
                            stopped = proc
                            break
        time.sleep(0.05)
    worker.join(timeout=600)
    assert stopped is not None, "the training task finished before a rank could be stopped"
    assert not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE  # ended
    state = box["state"]
    assert state.is_completed(), state.message
    steps = {s["step"]: s for s in state.result()["steps"]}
    assert steps["run-training"]["details"]["resumed_from_epoch"] >= 1
    task_runs, _ = task_runs_and_artifacts(state.state_details.flow_run_id)
    assert task_runs["run-training"].run_count == 2
    logs = flow_run_logs(state.state_details.flow_run_id)
    reason = re.search(r"no progress for 8 s after epoch \d+(?=: ending the attempt)", logs)
    assert reason, logs[-3000:]
    report.record(
        "training",
        "a rank stopped (SIGSTOP) after epoch 1, 2 ranks (local cluster, through the flow)",
        "attempt ended by the progress deadline; Prefect's retry resumed; model produced",
        message=reason.group(0),
        resumed_from=steps["run-training"]["details"]["resumed_from_epoch"],
        before_fix="no deadline: the hang lasts until Gloo's own timeout (NCCL: none) or the "
        "task's 6-hour maximum",
    )


def test_task_processes_do_not_inherit_storage_secrets(tmp_path: Path, azurite: str) -> None:
    from backends.local.cluster import LocalCluster
    from backends.taskspec import TaskSpec

    outputs = container_client(make_config(tmp_path).output, create=True)
    cluster = LocalCluster(tmp_path / "work", "p", 1, tmp_path / "nfs", tmp_path / "share", outputs)
    cluster.ensure_pool()
    lines: list[str] = []
    result = cluster.run_task(TaskSpec("env", "/bin/bash -c env"), lines.append)
    assert result.exit_code == 0
    seen = "\n".join(lines)
    assert "AZ_BATCH_NODE_MOUNTS_DIR=" in seen
    assert "AZURE_STORAGE_CONNECTION_STRING" not in seen and "AccountKey" not in seen
    assert cluster.release()["was"] == "steady" and cluster.state() == "released"


def test_a_run_starts_from_the_champion_and_records_it(
    tmp_path: Path, digits_source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--set training.init_from=champion``: the run resolves the champion before anything is
    provisioned, trains from its weights (carrying every class) and records which run and
    bytes it started from; the champion is a new input, so the run is not up to date with the
    one before. A champion whose bytes no longer match its recorded MD5 stops the next run
    before any pool, stage or training, and changes nothing stored."""
    config = make_config(tmp_path, "training.epochs=1")
    seed(config, digits_source)
    first = retrain(config=config, overrides=["training.lr=0.07"], return_state=True)
    assert first.is_completed(), first.message
    champion_run = first.result()["run_id"]
    assert first.result()["promoted"] is True

    # A retrain of the champion (as the nightly runs it): its weights and its recipe (lr 0.07,
    # not the config's default), but what the run sets itself (its overrides) wins.
    state = retrain(
        config=config,
        overrides=["training.follow_champion=true", "training.batch_size=32"],
        return_state=True,
    )
    assert state.is_completed(), state.message
    result = state.result()
    steps = {s["step"]: s for s in result["steps"]}
    settings = steps["follow-champion"]["details"]["settings"]
    assert f"training.lr = 0.07: the champion's recipe (run {champion_run})" in settings
    assert "training.batch_size = 32: set with --set training.batch_size=32" in settings
    assert (
        f"training.init_from = 'champion': a champion exists (run {champion_run}): "
        "retrain it" in settings
    )
    outputs = container_client(config.output)
    first_metrics = json.loads(outputs.download_blob(f"runs/{champion_run}/metrics.json").readall())
    start = steps["resolve-init-from"]["details"]
    assert start["asked"] == "champion" and start["run_id"] == champion_run
    assert start["resolved"] == f"output:runs/{champion_run}/model.pt"
    assert start["md5"] == first_metrics["model_md5"]
    assert steps["check-up-to-date"]["details"]["up_to_date"] is False
    metrics = json.loads(outputs.download_blob(f"runs/{result['run_id']}/metrics.json").readall())
    started = metrics["init_from"]
    assert started["run_id"] == champion_run and started["md5"] == first_metrics["model_md5"]
    assert started["classes_carried"] == first_metrics["class_names"]
    assert started["classes_new"] == [] and started["kind"] == "model file"
    assert metrics["args"]["lr"] == 0.07 and metrics["args"]["batch_size"] == 32
    # The lineage of the new model, as `cli.models lineage` prints it, back to scratch.
    from cli.models import main as models

    where = ["--set", f"output.container={config.output.container}"]
    capsys.readouterr()
    cli = ["--config", str(ROOT / "configs" / "local.yaml"), *where, "lineage"]
    assert models([*cli, "--run", result["run_id"]]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{result['run_id']}  started from run {champion_run}",
        f"{champion_run}  started from scratch",
    ]

    # The same retrain again: whichever run is the champion now, the version it was trained
    # on with this code and recipe is up to date (the start is not a new input when following).
    again = retrain(
        config=config,
        overrides=["training.follow_champion=true", "training.batch_size=32"],
        return_state=True,
    )
    assert again.is_completed() and again.result()["up_to_date"] is True, again.message

    champion_blob_name = champion_blob("", config.data.root)
    champion = outputs.download_blob(champion_blob_name).readall()
    outputs.upload_blob(json.loads(champion)["model"], b"replaced bytes", overwrite=True)
    tasks_dir = config.work_dir / "pools" / config.pool.id / "tasks"
    trained = sorted(tasks_dir.iterdir())
    bad, task_runs, _ = run(
        config.model_copy(
            update={"training": dataclasses.replace(config.training, init_from="champion")}
        )
    )
    assert bad.is_failed()
    assert "do not match the MD5 the trainer recorded" in str(
        task_runs["resolve-init-from"].state.message
    )
    assert set(task_runs) <= {"validate-data", "fit-to-data", "resolve-init-from", "release-pool"}
    assert sorted(tasks_dir.iterdir()) == trained  # no task ran on the pool
    assert outputs.download_blob(champion_blob_name).readall() == champion
