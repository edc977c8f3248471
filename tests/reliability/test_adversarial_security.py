"""Hostile values and misuse on documented paths: shell injection through the trainer's
arguments, paths with spaces, a pool id that walks out of the work dir, stale pid files whose
PID was reused, and two runs of one config at once. Every case runs the real thing (the local
cluster's processes, the fake Batch node that executes command lines, the retrain CLI)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.blob import container_client
from backends.local.cluster import ClusterError, LocalCluster
from backends.taskspec import TaskSpec, training_task
from core.config import ConfigError, PipelineConfig, load_config
from imagedata.make_images import write_digits
from tests.conftest import ROOT, prefect_api_env
from tests.nodes_helpers import copy_scripts
from tests.pipeline_helpers import make_config, seed
from tests.reliability import report


def hostile_args(markers: Path) -> list[str]:
    """Values a user (or a trigger) could put in training.extra_args: each would run a command,
    or split into several arguments, if it reached a shell unquoted."""
    return [
        f"$(touch {markers}/dollar)",
        f"`touch {markers}/backtick`",
        f"x; touch {markers}/semicolon",
        f"x && touch {markers}/and",
        "$AZ_BATCH_NODE_MOUNTS_DIR",
        "two words",
        'it\'s "quoted"',
    ]


@pytest.fixture
def storage(azurite: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite)


def _with_extra_args(config: PipelineConfig, args: list[str]) -> PipelineConfig:
    training = dataclasses.replace(config.training, extra_args=args)
    pool = config.pool.model_copy(update={"processes_per_node": 1})
    return config.model_copy(update={"training": training, "pool": pool})


def _assert_passed_verbatim(output: str, args: list[str], markers: Path) -> None:
    assert list(markers.iterdir()) == [], "a value on the command line ran as a command"
    # The trainer refused them as unknown options: it saw each value as the user wrote it.
    refused = next(line for line in output.splitlines() if "unrecognized arguments" in line)
    for arg in args:
        assert arg in refused, f"{arg!r} did not reach the trainer as written"


@pytest.mark.usefixtures("storage", "horovodrun")
def test_hostile_extra_args_run_nothing_on_the_local_cluster(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    base = tmp_path / "paths with spaces"
    config = _with_extra_args(make_config(base), hostile_args(markers))
    share = config.share.local_dir
    copy_scripts(share)
    cluster = LocalCluster(
        config.work_dir,
        config.pool.id,
        1,
        config.nfs.local_dir,
        share,
        container_client(config.output, create=True),
    )
    cluster.ensure_pool()
    lines: list[str] = []

    result = cluster.run_task(
        training_task(config, "train-hostile", "key", "runs/hostile"), lines.append
    )

    assert result.exit_code != 0  # the trainer refuses unknown options, as it should
    assert any(line.startswith("prepare_node: torch") for line in lines), "\n".join(lines)
    _assert_passed_verbatim("\n".join(lines), config.training.extra_args, markers)
    report.record(
        "adversarial",
        "shell metacharacters in training.extra_args, local cluster, paths with spaces",
        "passed verbatim, nothing ran",
        values=len(config.training.extra_args),
    )


@pytest.mark.usefixtures("prefect_api", "horovodrun")
def test_hostile_extra_args_run_nothing_on_a_batch_node(
    fake_azure_account: Any, tmp_path: Path
) -> None:
    """The request body the Batch cluster sends, executed as a node executes it."""
    from prefect.blocks.system import Secret

    from backends.share import collect_files
    from backends.target import PROJECT_ROOT, target_for
    from tasks.provision import SCRIPT_PACKAGES
    from tests.azure_helpers import azure_config
    from tests.fakes.node import PoolNodes
    from tests.nodes_helpers import require_emulated_nodes

    Secret(value="c2hhcmUta2V5").save("retrain-files-key", overwrite=True)
    Secret(value="registry-password").save("retrain-acr-pull", overwrite=True)
    markers = tmp_path / "markers"
    markers.mkdir()
    config = _with_extra_args(
        azure_config(tmp_path, "pool.dedicated_nodes=1", "retries.training_attempts=1"),
        hostile_args(markers),
    )
    target_for(config).share().upload(collect_files(PROJECT_ROOT, SCRIPT_PACKAGES))
    require_emulated_nodes()
    lines: list[str] = []
    with PoolNodes(
        tmp_path / "node with spaces",
        None,
        tmp_path / "nfs",
        lambda target: fake_azure_account.files.materialize(config.share.name, target),
    ) as node:
        node.attach(fake_azure_account.batch)
        fake_azure_account.batch.allocation_ticks = 1
        cluster = target_for(config).cluster()
        cluster.ensure_pool()
        result = cluster.run_task(
            training_task(config, "train-hostile", "key", "runs/hostile"), lines.append
        )

    assert result.exit_code != 0
    assert any("launch.sh" in command for _, command in node.commands)
    _assert_passed_verbatim("\n".join(lines), config.training.extra_args, markers)
    report.record(
        "adversarial",
        "shell metacharacters in training.extra_args, Batch command line on a node",
        "passed verbatim, nothing ran",
        values=len(config.training.extra_args),
    )


@pytest.mark.usefixtures("storage", "prefect_api", "horovodrun")
def test_flow_with_spaces_in_every_path_and_a_value_that_looks_like_a_command(
    tmp_path: Path,
) -> None:
    """The whole local flow with work_dir, the NFS and the share folders under a folder named
    with a space, a Batch variable and a command substitution: every path the pipeline hands
    the trainer (data, outputs, checkpoints) must stay that literal folder, not a variable or a
    command. (training.extra_args cannot carry a path: the pipeline owns them all.)
    """
    from flows.retrain import retrain

    source = tmp_path / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=20)
    marker = tmp_path / "injected"
    hostile = f"$AZ_BATCH_TASK_WORKING_DIR $(touch {marker})"
    config = make_config(tmp_path / "my runs" / hostile, "training.epochs=1")
    seed(config, source)

    state = retrain(config=config, return_state=True)

    assert state.is_completed(), state.message
    assert not marker.exists()
    checkpoints = sorted(config.nfs.local_dir.rglob("checkpoint-*.pt"))
    assert checkpoints, "the trainer wrote no checkpoint below the NFS folder it was given"
    assert f"/my runs/{hostile}/nfs/" in str(checkpoints[0])
    outputs = config.work_dir / "pools" / config.pool.id / "tasks"
    assert any(outputs.rglob("metrics.json")), "the trainer wrote no metrics below work_dir"
    report.record(
        "adversarial",
        "local flow: work_dir, NFS and share paths with a space; '$VAR $(cmd)' as a value",
        "flow completed; value used as a literal path",
        accuracy=round(state.result()["accuracy"], 3),
    )


@pytest.mark.parametrize(
    "pool_id", ["../../victim", "a/b", "..", "a.b", "pool id", "", "p" * 65, "x\n"]
)
def test_pool_ids_batch_would_refuse_fail_at_load(pool_id: str, tmp_path: Path) -> None:
    path = _config_file(tmp_path, pool_id)
    with pytest.raises(ConfigError, match=r"pool\.id: .*not a valid pool id"):
        load_config(path)


def test_pool_ids_batch_accepts_load(tmp_path: Path) -> None:
    for pool_id in ("retrain-pool", "Pool_2", "p" * 64):
        assert load_config(_config_file(tmp_path, pool_id)).pool.id == pool_id


def _config_file(tmp_path: Path, pool_id: str) -> Path:
    tree = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    tree["pool"]["id"] = pool_id
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.usefixtures("storage", "horovodrun")
def test_pool_id_that_leaves_the_work_dir_deletes_nothing(tmp_path: Path) -> None:
    """Defence in depth: even with the config check bypassed, release() stays inside its root."""
    victim = tmp_path / "victim" / "node"
    victim.mkdir(parents=True)
    (victim / "keep.txt").write_text("not the pool's")
    outputs = container_client(make_config(tmp_path).output, create=True)
    for pool_id in ("../../victim", "../pools/../../victim", "/abs"):
        with pytest.raises(ClusterError, match="outside"):
            cluster = LocalCluster(
                tmp_path / "work", pool_id, 1, tmp_path / "nfs", tmp_path / "share", outputs
            )
            cluster.release()
    assert (victim / "keep.txt").read_text() == "not the pool's"
    report.record(
        "adversarial",
        "pool.id=../../victim",
        "refused at load (names pool.id); the local cluster refuses it too; nothing deleted",
    )


@contextlib.contextmanager
def unrelated_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process group this project did not start (as another user's job would be)."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.usefixtures("storage", "horovodrun")
def test_stale_pid_file_whose_pid_was_reused_names_nothing(tmp_path: Path) -> None:
    """A task's pid file left behind (its orchestrator was killed), its task ended, and the PID
    now belongs to someone else's process: no task waits on it and release() kills nothing."""
    go = tmp_path / "go"
    outputs = container_client(make_config(tmp_path).output, create=True)
    cluster = LocalCluster(tmp_path / "work", "p", 1, tmp_path / "nfs", tmp_path / "share", outputs)
    cluster.ensure_pool()
    pidfile = cluster.root / "running" / "first.pid"
    spec = TaskSpec("first", f"/bin/bash -c 'while [ ! -e {go} ]; do sleep 0.05; done'")
    worker = threading.Thread(target=cluster.run_task, args=(spec,))
    worker.start()
    while not pidfile.exists():  # the task runs: its pid file is there, as written
        assert worker.is_alive()
        time.sleep(0.02)
    left_behind = pidfile.read_text()
    old_pid = next(iter(cluster.running_tasks().values()))
    go.touch()
    worker.join()

    with unrelated_process() as stranger:
        # The same file, its PID now in use by the stranger.
        pidfile.write_text(left_behind.replace(str(old_pid), str(stranger.pid), 1))
        assert cluster.running_tasks() == {}
        lines: list[str] = []
        result = cluster.run_task(TaskSpec("second", "/bin/true"), lines.append)
        assert result.exit_code == 0 and not any("waits for" in line for line in lines)
        assert cluster.release()["killed_tasks"] == []
        assert stranger.poll() is None, "release() killed a process it did not start"
    report.record(
        "adversarial",
        "stale pid file, PID reused by an unrelated process",
        "not waited on, not killed",
    )


@pytest.mark.usefixtures("storage", "horovodrun")
def test_release_from_another_process_stops_a_running_task(tmp_path: Path) -> None:
    """What the pid files are for still works: a live task is verified and stopped."""
    outputs = container_client(make_config(tmp_path).output, create=True)
    cluster = LocalCluster(tmp_path / "work", "p", 1, tmp_path / "nfs", tmp_path / "share", outputs)
    cluster.ensure_pool()
    box: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: box.update(result=cluster.run_task(TaskSpec("long", "sleep 300")))
    )
    worker.start()
    while not cluster.running_tasks():
        assert worker.is_alive()
        time.sleep(0.02)
    other = LocalCluster(tmp_path / "work", "p", 1, tmp_path / "nfs", tmp_path / "share", outputs)
    assert other.release()["killed_tasks"] == ["long"]
    worker.join()
    assert box["result"].exit_code == -signal.SIGKILL


# The same scenario, the second run started once the first holds the pool, and what each ends
# with: tests/reliability/test_adversarial_up_to_date.py::test_two_runs_of_one_new_version_
# train_it_once, in `make test`. Started together, here: `make reliability`.
@pytest.mark.slow
@pytest.mark.usefixtures("storage", "prefect_api", "horovodrun")
def test_two_cli_runs_of_one_config_at_once_both_succeed(tmp_path: Path) -> None:
    """Two ``python -m flows.retrain`` with the same config started together: the second waits
    for the pool instead of having its tasks killed by the first one's release."""
    source = tmp_path / "digits"
    write_digits(source, test_fraction=0.25, seed=0, per_class=20)
    config = make_config(tmp_path, "training.epochs=1", "pool.processes_per_node=1")
    seed(config, source)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**prefect_api_env(), "PYTHONUNBUFFERED": "1"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "flows.retrain", "--config", str(path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=900)[0] for proc in runs]

    codes = [proc.returncode for proc in runs]
    assert codes == [0, 0], "\n\n".join(outputs)
    waited = [out for out in outputs if f"pool {config.pool.id} is in use by" in out]
    assert len(waited) == 1, "the runs did not take turns on the pool"
    report.record(
        "adversarial",
        "two `python -m flows.retrain` runs of one config at once",
        "both completed; the second waited for the pool",
        exit_codes=codes,
    )


@pytest.mark.processes
def test_pid_records_identify_the_process(tmp_path: Path) -> None:
    from backends.local.processes import is_alive, read_record, record_of, write_record

    with unrelated_process() as proc:
        record = record_of(proc.pid)
        assert record is not None and is_alive(record)
        write_record(record, tmp_path / "p.pid")
        assert read_record(tmp_path / "p.pid") == record
        # Same PID, created at another time: another process.
        assert not is_alive(type(record)(record.pid, record.created + 0.01))
    assert not is_alive(record)
    (tmp_path / "bare.pid").write_text(str(os.getpid()))  # a PID alone proves nothing
    assert read_record(tmp_path / "bare.pid") is None


@pytest.mark.usefixtures("storage", "horovodrun")
def test_abort_hook_leaves_alone_a_pool_another_run_holds(tmp_path: Path) -> None:
    """The crash/cancellation hook of one run must not release the pool while another run holds
    it (it would stop that run's tasks); once the pool is free, it releases it."""
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Cancelled

    from backends.target import target_for
    from flows.pool_lock import local_pool_lock
    from flows.retrain import _release_after_abort, retrain

    config = make_config(tmp_path)
    cluster = target_for(config).cluster()
    cluster.ensure_pool()
    box: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: box.update(result=cluster.run_task(TaskSpec("other", "sleep 300")))
    )
    worker.start()
    while not cluster.running_tasks():
        assert worker.is_alive()
        time.sleep(0.02)
    aborted = FlowRun(flow_id=uuid4(), parameters={"config": config.model_dump(mode="json")})

    with local_pool_lock(config, "the run that uses the pool now") as held:
        assert held
        _release_after_abort(retrain, aborted, Cancelled())
        assert cluster.state() == "steady" and set(cluster.running_tasks()) == {"other"}
    _release_after_abort(retrain, aborted, Cancelled())
    worker.join()
    assert cluster.state() == "released" and box["result"].exit_code == -signal.SIGKILL


@pytest.mark.usefixtures("prefect_database")
def test_runs_on_two_machines_sharing_a_batch_pool_take_turns(tmp_path: Path) -> None:
    """Two orchestrators with work dirs of their own (two machines: no file lock in common)
    and one Batch pool: the pool's global concurrency limit, created on first use, lets one
    run hold the pool at a time."""
    from prefect.client.orchestration import get_client

    from core.pool_slot import pool_slot
    from flows.pool_lock import hold_pool
    from tests.azure_helpers import azure_config

    first = azure_config(tmp_path / "machine-a")
    second = first.model_copy(update={"work_dir": tmp_path / "machine-b" / "work"})
    events: list[str] = []
    entered = threading.Event()

    def other_machine() -> None:
        with hold_pool(second, "run on machine b", shared=True):
            events.append("b holds")
            entered.set()

    with hold_pool(first, "run on machine a", shared=True):
        events.append("a holds")
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(pool_slot(first.pool.id))
        assert (limit.limit, limit.active_slots) == (1, 1)
        thread = threading.Thread(target=other_machine)
        thread.start()
        assert not entered.wait(5), "the second run got the pool while the first held it"
        events.append("a releases")
    thread.join(timeout=300)
    assert events == ["a holds", "a releases", "b holds"]


@pytest.mark.parametrize(
    ("extra", "owner"),
    [
        (["--data-dir", "/tmp/unvalidated"], "the pipeline"),
        (["--output-dir=/tmp/elsewhere"], "the pipeline"),
        (["--checkpoint-dir", "/tmp/other"], "the pipeline"),
        (["--prune-checkpoint-folders", "0"], "the pipeline"),
        (["--epochs", "100"], "training.epochs"),
        (["--engine=ddp"], "training.engine"),
        (["--seed", "4"], "training.seed"),
    ],
)
def test_extra_args_cannot_give_what_the_pipeline_or_a_setting_owns(
    extra: list[str], owner: str
) -> None:
    """The trainer takes the last of a repeated option, so a value in training.extra_args would
    replace the staged (validated) data, where outputs and checkpoints go, or a setting the
    run's fingerprint records: refused at load, naming the option and what sets it."""
    from core.config import ConfigError, load_config
    from tests.conftest import ROOT

    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "local.yaml", [f"training.extra_args={extra}"])
    option = extra[0].split("=")[0]
    assert "training.extra_args" in str(err.value) and option in str(err.value)
    assert owner in str(err.value)
    report.record(
        "adversarial",
        f"training.extra_args={extra}",
        "refused at load, naming the option and its owner",
    )


def test_trainer_takes_no_abbreviated_options(tmp_path: Path) -> None:
    """argparse matches an unambiguous prefix by default: ``--data-d X`` would have set
    --data-dir past any check on whole option names."""
    from training.args import parse_trainer_args

    with pytest.raises(SystemExit) as exit_:
        parse_trainer_args(
            ["--data-dir", "synthetic:10", "--output-dir", str(tmp_path), "--output-d", "/x"]
        )
    assert exit_.value.code == 2
